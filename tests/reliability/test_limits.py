"""Every size the public API accepts, at its limit and one past it, and the internal bounds, on the
in-process mesh (the suite's small limits: specmesh/reliability/harness.py SUITE_GATEWAY)."""

from __future__ import annotations

import pytest

from gateway.streams import StreamLimits
from specmesh.errors import ResourceExhausted
from specmesh.reliability import fuzz, limits

pytestmark = pytest.mark.service


def _failed(rows) -> list[str]:
    return [f"{r.limit}: at {r.status_at}, past {r.status_past} (want {r.expected_past}) {r.note}"
            for r in rows if not r.passed]


def test_public_limits(rmesh, prompt_encoder):
    rows = limits.public_rows(rmesh, prompt_encoder)
    assert not _failed(rows)
    assert {r.key for r in rows} >= {"gateway.max_message_bytes", "gateway.max_prompt_bytes", "gateway.max_prompt_tokens",
                                     "gateway.max_messages", "gateway.max_stop_strings", "gateway.max_stop_chars",
                                     "gateway.max_request_id_chars", "gateway.max_streams_per_connection",
                                     "gateway.max_streams_per_key"}


def test_internal_bounds(rmesh):
    rows = limits.internal_rows(rmesh, fuzz.model_facts(rmesh, rmesh.cfg))
    assert not _failed(rows)


def test_stream_limits_count_per_connection_and_per_key():
    streams = StreamLimits(per_connection=2, per_key=3)
    with streams.slot("peer-a", "k1"), streams.slot("peer-a", "k1"):
        with pytest.raises(ResourceExhausted, match="per connection"):
            streams._take("peer-a", "k2")
        with streams.slot("peer-b", "k1"):
            with pytest.raises(ResourceExhausted, match="per API key"):
                streams._take("peer-c", "k1")
            with streams.slot("peer-c", "k2"):  # another key on another connection still gets in
                pass
    assert streams.held() == (0, 0)  # every slot given back, nothing left counted
    unlimited = StreamLimits(per_connection=1, per_key=0)
    with unlimited.slot("p1", "k"), unlimited.slot("p2", "k"):
        pass
