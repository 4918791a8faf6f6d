"""The fuzz slice: 300 generated cases (220 public, 80 internal) against the in-process mesh.
Every answer must be a documented status, nothing may hang, and afterwards the target holds no
sequence and a greedy generation is unchanged. A failure prints the seed and case to replay:
`specmesh chaos --parts fuzz --seed 14 --only public:12`."""

from __future__ import annotations

import pytest

from specmesh.reliability import fuzz

pytestmark = pytest.mark.service
SEED = 14


def test_fuzz_slice(rmesh):
    result = fuzz.run_fuzz(rmesh, rmesh.cfg, SEED, public_n=220, internal_n=80, concurrency=4, log=lambda _m: None)
    failed = [f"{o.case.part}:{o.case.index} [{o.case.kind}] {o.case.summary}: {o.failure}" for o in result.failures()]
    assert not failed, f"seed {SEED}:\n" + "\n".join(failed)
    assert result.post == {"processes": "ok", "sequences_released": "ok", "generation_unchanged": "ok"}
    public, internal = result.histogram("public"), result.histogram("internal")
    for code in ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "UNIMPLEMENTED"):
        assert public[code] > 0, (code, public)  # the slice reaches each of these answers
    for code in ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION"):
        assert internal[code] > 0, (code, internal)
    assert not set(public) & {"UNKNOWN", "INTERNAL", "DATA_LOSS"}


def test_a_case_is_rebuilt_from_seed_and_index():
    from specmesh.reliability.internal_cases import internal_case
    from specmesh.reliability.public_cases import public_case

    assert [public_case(SEED, i) for i in range(20)] == [public_case(SEED, i) for i in range(20)]
    assert [internal_case(SEED, i) for i in range(20)] == [internal_case(SEED, i) for i in range(20)]
    assert [public_case(SEED, i) for i in range(20)] != [public_case(SEED + 1, i) for i in range(20)]
