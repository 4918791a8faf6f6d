"""The speculation canary's pure core: the arm choice (stable hash, share, keys), the hot
switch's canary state, histogram quantiles and the guard's verdict, on hand-built numbers."""

from __future__ import annotations

import hashlib
import math

import pytest

from coordinator.control import SpeculationControl
from specmesh.config import ConfigError, load_config
from specmesh.core.canary import CONTROL, SPEC, Canary, check_share, choose_arm, hash_fraction, parse_keys
from specmesh.core.canary_stats import ArmStats, count, guard_verdict, merge, quantile, subtract
from specmesh.errors import InvalidArgument

IDS = [f"req-{i:05d}" for i in range(20000)]
INF = math.inf


def test_hash_fraction_is_stable_in_range_and_is_sha256():
    assert hash_fraction("abc") == hash_fraction("abc")
    assert all(0.0 <= hash_fraction(i) < 1.0 for i in IDS[:2000])
    # sha256("abc") starts ba7816bf8f01cfea: 0xba7816bf8f01cfea / 2**64
    assert hash_fraction("abc") == pytest.approx(0xBA7816BF8F01CFEA / 2 ** 64)
    assert hashlib.sha256(b"abc").hexdigest().startswith("ba7816bf8f01cfea")


@pytest.mark.parametrize("share", [0.05, 0.25, 0.5, 0.9])
def test_share_of_requests_in_spec(share):
    n = sum(choose_arm(i, share) == SPEC for i in IDS)
    # binomial: 20000 draws, 4 standard deviations
    assert abs(n / len(IDS) - share) < 4 * math.sqrt(share * (1 - share) / len(IDS))


def test_share_edges_and_monotonic_growth():
    assert all(choose_arm(i, 0.0) == CONTROL for i in IDS[:3000])
    assert all(choose_arm(i, 1.0) == SPEC for i in IDS[:3000])
    small = {i for i in IDS if choose_arm(i, 0.05) == SPEC}
    large = {i for i in IDS if choose_arm(i, 0.2) == SPEC}
    assert small < large  # raising the share only moves requests from control to spec


def test_keys_limit_the_canary_and_opt_outs_are_control():
    rid = next(i for i in IDS if hash_fraction(i) < 0.5)  # in spec at share 0.5
    assert choose_arm(rid, 0.5) == SPEC
    assert choose_arm(rid, 0.5, ("team-a",), "team-a") == SPEC
    assert choose_arm(rid, 0.5, ("team-a",), "team-b") == CONTROL
    assert choose_arm(rid, 0.5, ("team-a",), "") == CONTROL  # no key (auth off) is not in a key list
    assert choose_arm(rid, 1.0, (), "anyone", speculates=False) == CONTROL  # asked for no speculation
    assert Canary(0.5, ("team-a",)).arm(rid, "team-a") == SPEC


def test_parse_keys_and_check_share():
    assert parse_keys("team-b, team-a,,team-a ") == ("team-a", "team-b")
    assert parse_keys("") == () and parse_keys(None) == ()
    assert check_share(0) == 0.0 and check_share(1) == 1.0
    for bad in (-0.1, 1.01, float("nan"), float("inf"), True):
        with pytest.raises(InvalidArgument):
            check_share(bad)


def test_control_holds_the_canary_resets_and_trips():
    seen = []
    c = SpeculationControl(16, on_change=seen.append, canary=Canary(0.0))
    assert c.arm("x") == CONTROL  # share 0 from the configuration
    s = c.set(share=0.5, keys=("team-a",))
    assert (s.canary.share, s.canary.keys, s.version) == (0.5, ("team-a",), 1)
    assert c.set(enabled=False).canary.share == 0.5  # other fields leave the canary alone
    with pytest.raises(InvalidArgument):
        c.set(share=2.0)
    assert c.trip("slow", seen=Canary(0.7)) is None  # judged another canary: nothing done
    tripped = c.trip("slow", seen=c.state.canary)
    assert tripped.canary.share == 0.0 and tripped.canary.tripped == "slow" and tripped.canary.keys == ("team-a",)
    assert c.set(share=0.1).canary.tripped == ""  # setting the share again clears the trip
    assert c.set(reset=True).canary == Canary(0.0)  # back to the configuration
    assert [x.version for x in seen] == [1, 2, 3, 4, 5]


def test_config_keys_defaults_env_and_validation():
    cfg = load_config(environ={})
    assert cfg.coordinator.canary.share == 1.0 and cfg.coordinator.canary.guard_margin is None
    env = {"SPECMESH_COORDINATOR__CANARY__SHARE": "0.05", "SPECMESH_COORDINATOR__CANARY__KEYS": "team-a,team-b",
           "SPECMESH_COORDINATOR__CANARY__GUARD_MARGIN": "0.2"}
    c = load_config(environ=env).coordinator.canary
    assert (c.share, c.keys, c.guard_margin) == (0.05, ("team-a", "team-b"), 0.2)
    for key, value in (("SHARE", "1.5"), ("GUARD_MARGIN", "-1"), ("GUARD_MIN_REQUESTS", "0")):
        with pytest.raises(ConfigError, match="coordinator.canary"):
            load_config(environ={f"SPECMESH_COORDINATOR__CANARY__{key}": value})


# ------------------------------------------------------------------ histograms and the guard

H = ((0.01, 0), (0.02, 50), (0.05, 100), (INF, 100))  # 50 samples in (10, 20] ms, 50 in (20, 50] ms


def test_quantile_interpolates_inside_buckets():
    assert quantile(H, 0.5) == pytest.approx(0.02)
    assert quantile(H, 0.25) == pytest.approx(0.015)
    assert quantile(H, 0.99) == pytest.approx(0.02 + 0.03 * 49 / 50)
    assert quantile(((0.1, 10), (INF, 10)), 0.5) == pytest.approx(0.05)  # first bucket: from 0
    assert quantile(((0.1, 1), (0.2, 1), (INF, 10)), 0.99) == pytest.approx(0.2)  # +Inf: highest bound
    assert quantile(((0.1, 0), (INF, 0)), 0.5) is None and quantile((), 0.5) is None


def test_subtract_and_merge():
    before = ((0.01, 0), (0.02, 20), (0.05, 30), (INF, 30))
    assert subtract(H, before) == ((0.01, 0), (0.02, 30), (0.05, 70), (INF, 70))
    assert subtract(H, None) == H and count(merge(H, before)) == 130 and merge((), H) == H
    with pytest.raises(ValueError):
        merge(H, ((0.5, 1), (INF, 1)))


def test_arm_stats_error_rate_and_window():
    now = ArmStats({"OK": 18, "CANCELLED": 1, "UNAVAILABLE": 1}, H, H)
    assert now.requests == 20 and now.errors == 1 and now.error_rate == pytest.approx(0.05)
    win = now.since(ArmStats({"OK": 8}, ((0.01, 0), (0.02, 50), (0.05, 50), (INF, 50)), ()))
    assert win.codes == {"OK": 10, "CANCELLED": 1, "UNAVAILABLE": 1}
    assert win.summary()["tpot_p50_s"] == pytest.approx(0.02 + 0.03 * 25 / 50)
    assert ArmStats().error_rate is None and ArmStats().summary()["tpot_p99_s"] is None


def hist(values_ms, bounds=(5, 10, 20, 40, 80, 160)):
    """A cumulative histogram (seconds) of the given millisecond values."""
    return tuple((b / 1000, sum(v <= b for v in values_ms)) for b in bounds) + ((INF, len(values_ms)),)


def test_guard_trips_only_beyond_the_margin_with_enough_samples():
    control = hist([8] * 30)  # p99 inside (5, 10] ms
    slow = hist([8] * 20 + [70] * 10)  # p99 inside (40, 80] ms
    v = guard_verdict(slow, control, margin=0.2, min_requests=20)
    assert v.ready and v.trip and v.spec_p99 > v.control_p99 * 1.2 and "exceeds" in v.reason
    assert not guard_verdict(control, control, 0.2, 20).trip  # equal: within
    same_bucket = hist([9] * 30)
    assert not guard_verdict(same_bucket, control, 0.2, 20).trip
    few = guard_verdict(slow, hist([8] * 5), 0.2, 20)
    assert not few.ready and not few.trip and "waiting" in few.reason
    assert not guard_verdict(slow, control, margin=20.0, min_requests=20).trip  # a wide margin tolerates it
