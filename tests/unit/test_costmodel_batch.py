"""The verify cost model by batch (specmesh/core/costmodel.py): forwards of several sequences are
priced by their own one-row step and per-extra-row slope, not as one sequence's chain."""

import pytest

from specmesh.core.costmodel import VerifyCost

# a Zen 4 EPYC's micro-bench (docs/bench/engine.md#19), seconds: one sequence's rows, then batches
ZEN4_ROWS = {1: 0.0326, 5: 0.0243, 9: 0.0332, 17: 0.0455, 33: 0.070, 65: 0.130}


def _zen4() -> VerifyCost:
    c = VerifyCost(dict(ZEN4_ROWS))
    c.seed_batches({4: 0.0237, 16: 0.0488}, {4: 0.0018, 16: 0.00177})
    return c


def test_batches_are_priced_by_their_step_and_slope():
    c = _zen4()
    assert c.estimate(16, 16) == pytest.approx(0.0488)  # not the rows table's 16 rows (~0.044)
    assert c.estimate(80, 16) == pytest.approx(0.0488 + 64 * 0.00177, rel=0.01)  # measured 16 x 5: 0.1621
    assert c.estimate(20, 4) == pytest.approx(0.0237 + 16 * 0.0018)  # measured 4 x 5: 0.0526
    assert c.estimate(8, 8) == pytest.approx(0.0237 + (0.0488 - 0.0237) * 4 / 12)  # between the buckets
    assert c.estimate(5) == pytest.approx(c.estimate(5, 1.0))  # one sequence: the rows table
    assert c.estimate(2, 2) == pytest.approx(0.0326 + (0.0237 - 0.0326) / 3)  # from one sequence's step to 4's


def test_extra_rows_cost_at_least_what_the_rows_table_says():
    """A batch bucket's slope learnt near 0 (seen at 8 sequences, session 41) does not price a
    draft beside others as free: the extra rows cost at least one sequence's step from B to that
    many rows."""
    c = VerifyCost(dict(ZEN4_ROWS))
    c.seed_batches({4: 0.0237, 8: 0.030, 16: 0.0488}, {4: 0.0018, 8: 0.00001, 16: 0.00177})
    floor = c.estimate(17) - c.estimate(9)  # the rows table's 9 -> 17 rows
    assert c.estimate(17, 9) - c.estimate(9, 9) == pytest.approx(floor) and floor > 8 * 0.0005
    assert c.estimate(20, 4) == pytest.approx(0.0237 + 16 * 0.0018)  # a measured slope above the floor stays


def test_a_batch_without_its_step_falls_back_to_the_rows_table():
    c = VerifyCost(dict(ZEN4_ROWS))
    assert c.estimate(20, 4) == pytest.approx(c.estimate(20))
    c.observe(20, 0.06, batch=4)  # no one-row step of 4 known: the rows table learns it
    assert "batches" in c.as_dict() and c.as_dict()["batches"] == []


def test_one_row_steps_teach_the_step_and_drafting_forwards_the_slope():
    c = _zen4()
    for _ in range(60):
        c.observe(16, 0.0488, batch=16)
        c.observe(32, 0.0488 + 16 * 0.003, batch=16)  # extra rows dearer than seeded
    assert c.estimate(16, 16) == pytest.approx(0.0488, rel=0.05)
    assert (c.estimate(32, 16) - c.estimate(16, 16)) / 16 == pytest.approx(0.003, rel=0.1)


def test_the_batch_model_round_trips_and_tolerates_an_older_worker():
    c = _zen4()
    d = VerifyCost.from_dict(c.as_dict())
    for rows, batch in ((16, 16), (48, 16), (12, 4), (5, 1), (9, 8)):
        assert d.estimate(rows, batch) == pytest.approx(c.estimate(rows, batch), rel=1e-6)
    old = VerifyCost.from_dict({"rows": [1, 9], "seconds": [0.03, 0.04]})  # no batches sent
    assert old.estimate(16, 16) == pytest.approx(old.estimate(16))


def test_the_wire_carries_the_batches():
    from specmesh.rpc.convert import cost_from_pb, cost_to_pb

    sent = {**_zen4().as_dict(), "live": 3}
    got = cost_from_pb(cost_to_pb(sent))
    assert got["batches"] == [4, 16] and got["batch_slopes"] == pytest.approx([0.0018, 0.00177])
    assert VerifyCost.from_dict(got).estimate(48, 16) == pytest.approx(0.0488 + 32 * 0.00177, rel=1e-5)


def test_a_slower_machine_while_every_forward_drafts_moves_the_drift_not_the_slope():
    c = _zen4()
    for _ in range(80):  # the machine 30% slower, and no one-row step to tell it
        c.observe(32, 1.3 * (0.0488 + 16 * 0.00177), batch=16)
    assert c.estimate(16, 16) == pytest.approx(1.3 * 0.0488, rel=0.05)
    assert (c.estimate(32, 16) - c.estimate(16, 16)) / 16 == pytest.approx(1.3 * 0.00177, rel=0.1)


def test_a_falling_last_bucket_is_not_extended_below_its_own_step():
    # the steps of batches 4 and 8 learnt in different minutes: 8 read cheaper than 4. Extending
    # that fall priced 16 sequences at 0 s (a ZeroDivisionError in the goodput rule, CI session 35)
    c = VerifyCost({1: 0.030})
    c.seed_batches({4: 0.040, 8: 0.034}, {4: 0.0, 8: 0.0})
    for batch in (8, 12, 16, 64):
        assert c.estimate(batch, batch) == pytest.approx(0.034)
    assert c.estimate(6, 6) == pytest.approx(0.037)  # between the buckets: as measured
    assert c.estimate(32, 16) == pytest.approx(0.034)  # slopes of 0 past 8: the same
    c.seed_batches({16: 0.050}, {16: 0.002})  # a rising last segment still extends
    assert c.estimate(24, 24) == pytest.approx(0.050 + 8 * (0.050 - 0.034) / 8)
