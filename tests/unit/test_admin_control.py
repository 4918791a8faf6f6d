"""coordinator.control.SpeculationControl (the hot switch) and its effect on Generation rounds."""

from __future__ import annotations

import pytest

from coordinator.control import SpeculationControl
from coordinator.loop import Generation
from specmesh.core.types import DraftProposal, GenerationRequest, SamplingParams, VerifyOutcome
from specmesh.errors import InvalidArgument


def test_defaults_pass_the_request_through():
    c = SpeculationControl(max_k=16)
    assert c.effective("ngram", 4) == ("ngram", 4)
    assert c.effective("off", 0) == ("off", 0)


def test_off_on_method_k_and_reset():
    seen = []
    c = SpeculationControl(max_k=16, on_change=seen.append)
    assert c.set(enabled=False).version == 1
    assert c.effective("ngram", 4) == ("off", 0)
    c.set(enabled=True, method="draft_model", k=2)
    assert c.effective("ngram", 4) == ("draft_model", 2)
    assert c.effective("off", 0) == ("off", 0)  # a request that asked for the target alone stays so
    c.set(method="", k=-1)  # clear the overrides
    assert c.effective("ngram", 4) == ("ngram", 4)
    c.set(k=0)
    assert c.effective("ngram", 4) == ("off", 0)
    s = c.set(reset=True)
    assert (s.enabled, s.method, s.k) == (True, None, None) and c.effective("ngram", 4) == ("ngram", 4)
    assert [x.version for x in seen] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("kwargs", [{"method": "magic"}, {"k": 17}, {"k": -2}])
def test_bad_values_are_invalid_argument(kwargs):
    c = SpeculationControl(max_k=16)
    with pytest.raises(InvalidArgument):
        c.set(**kwargs)
    assert c.state.version == 0


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


class Target:
    def prefill(self, seq_id, prompt, params, timeout, max_new_tokens=0):
        return 1

    def verify(self, seq_id, draft, timeout):
        return VerifyOutcome(len(draft.token_ids), list(draft.token_ids) + [2], True)

    def release(self, seq_id):
        pass


class Drafts:
    def __init__(self):
        self.calls = []

    def propose(self, seq_id, context, k, method, params, round_, timeout):
        self.calls.append((method, k))
        return DraftProposal([3] * k)

    def release(self, seq_id):
        pass


def test_switch_applies_to_the_next_round_of_a_running_request():
    control, drafts, rounds = SpeculationControl(16), Drafts(), []
    req = GenerationRequest([5, 6], 40, SamplingParams(), "ngram", 3)
    gen = Generation(req, Target(), drafts, Tok(), set(), 5.0, control=control,
                     observer=lambda *a: rounds.append(a))
    it = gen.run()
    next(it)  # prefill
    next(it)  # round 1 with k=3
    control.set(enabled=False)
    next(it)  # round 2: target alone
    control.set(enabled=True, k=1)
    next(it)  # round 3: k=1
    assert drafts.calls == [("ngram", 3), ("ngram", 1)]
    assert [r[1] for r in rounds] == [3, 0, 1]  # drafted per round, seen by the observer
    assert [r[0] for r in rounds] == ["ngram", "off", "ngram"]
    it.close()


def test_request_run_while_switched_off_reports_method_off():
    control = SpeculationControl(16)
    control.set(enabled=False)
    drafts = Drafts()
    gen = Generation(GenerationRequest([5], 6, SamplingParams(), "ngram", 4), Target(), drafts, Tok(), set(),
                     5.0, control=control)
    list(gen.run())
    assert gen.method == "off" and gen.stats.drafted_tokens == 0 and drafts.calls == []
