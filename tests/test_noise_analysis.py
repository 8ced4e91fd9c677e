"""The analysis of server-noise traces (gemmrl.report.noise): pure, no GPU."""

import random

import pytest

from gemmrl.report.noise import agreement_table, chunk_disagreements


def _trace(rounds, gaps="each", names=("t", "t#2"), draw=None, shape="64x64x64"):
    rng = random.Random(0)
    draw = draw or (lambda rng, r, name: 10.0)
    return [{"shape": shape, "gaps": gaps, "round": r, "name": n, "time_us": draw(rng, r, n)}
            for r in range(rounds) for n in names]


def test_identical_series_agree_exactly_and_chunks_are_counted():
    rows = _trace(10, names=("a", "b", "c"))
    d = chunk_disagreements(rows, 3, "median")
    assert d == {"each": [0.0] * 9}  # 3 whole chunks of 3 rounds (the 10th round left over) x 3 pairs
    assert chunk_disagreements(rows, 3, "median", warmup_rounds=4) == {"each": [0.0] * 6}


def test_the_median_of_a_bimodal_series_is_less_stable_than_its_mean():
    # cold/warm calls: 30 or 90 us at random, what server mode's idle gaps produce
    def bimodal(rng, r, n):
        return rng.choice((30.0, 90.0)) * (1 + 0.02 * rng.gauss(0, 1))

    rows = _trace(6000, draw=bimodal) + _trace(6000, gaps="round", draw=bimodal, shape="128x64x64")
    t = {(r["gaps"], r["stat"]): r for r in agreement_table(rows, [300])}
    for gaps in ("each", "round"):
        assert t[(gaps, "mean")]["pairs"] == 20
        assert t[(gaps, "mean")]["median"] < t[(gaps, "median")]["median"]
        assert t[(gaps, "mean")]["within"] > t[(gaps, "median")]["within"]


def test_a_real_difference_shows_as_disagreement():
    rows = _trace(100, draw=lambda rng, r, n: 10.0 if n == "t" else 10.5)
    (row,) = agreement_table(rows, [50], ["mean"])
    assert row["median"] == pytest.approx(0.05) and row["within"] == 0.0 and row["pairs"] == 2


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="chunk size"):
        chunk_disagreements([], 0, "mean")
    with pytest.raises(ValueError, match="stat must be"):
        chunk_disagreements([], 5, "mode")
    with pytest.raises(ValueError, match="time_us must be positive"):
        chunk_disagreements(_trace(2, draw=lambda rng, r, n: 0.0), 1, "mean")


def test_the_paired_statistic_removes_a_state_the_rounds_share():
    # gaps=round: every call of a round sees the same machine state (30 or 90 us), and a call is
    # cold (1.5x) at random on its own, plus 1% noise: the paired statistic divides the state out
    # and is robust to the cold calls; the mean is not
    def shared(rng, r, n, states={}):
        state = states.setdefault(r, random.Random(r).choice((30.0, 90.0)))
        return state * (1.5 if rng.random() < 0.3 else 1.0) * (1 + 0.01 * rng.gauss(0, 1))

    rows = _trace(3000, gaps="round", draw=shared, names=("a", "b", "c"))
    t = {r["stat"]: r for r in agreement_table(rows, [150])}
    assert t["paired"]["pairs"] == t["mean"]["pairs"] == 60
    assert t["paired"]["within"] == 1.0 and t["paired"]["max"] < 0.01
    assert t["mean"]["within"] < 0.9
    # a real difference is kept: b 5% slower in every round
    rows = _trace(200, gaps="round", draw=lambda rng, r, n: (30.0 if r % 2 else 90.0) * (1.05 if n == "b" else 1.0),
                  names=("a", "b"))
    (row,) = agreement_table(rows, [100], ["paired"])
    assert row["median"] == pytest.approx(0.05)


def _m(M, impl, mode, median, mean=None, **details):
    return {"M": M, "N": 64, "K": 64, "impl": impl, "mode": mode, "median_us": median,
            "mean_us": median if mean is None else mean, "status": "ok", "details": details}


def test_repeat_agreement_compares_each_impl_with_its_repeat_by_every_statistic():
    from gemmrl.report.noise import repeat_agreement

    recs = [_m(64, "torch.matmul", "offline", 10.0, ci_reached=True),
            _m(64, "torch.matmul@repeat", "offline", 10.1, ci_reached=True),
            _m(128, "torch.matmul", "offline", 20.0, 20.0, ci_reached=False),
            _m(128, "torch.matmul@repeat", "offline", 21.0, 20.2, ci_reached=False),
            _m(256, "torch.matmul", "offline", 5.0),  # no repeat: not compared
            {**_m(512, "torch.matmul@repeat", "offline", 5.0), "status": "wrong"},
            _m(512, "torch.matmul", "offline", 5.0),  # its repeat failed: not compared
            _m(64, "torch.matmul", "server", 50.0, 60.0, paired={"torch.matmul@repeat": 1.012}),
            _m(64, "torch.matmul@repeat", "server", 55.0, 61.0, paired={"torch.matmul": 1 / 1.012})]
    t = repeat_agreement(recs)
    off = t["offline"]["torch.matmul"]
    assert set(t["offline"]) == {"torch.matmul"}  # the @repeat is the twin, not an implementation
    med = off["stats"]["median"]
    assert med["shapes"] == 2 and med["within"] == 1 and med["share_within"] == 0.5
    assert med["max"] == pytest.approx(0.05) and med["worst"] == "128x64x64"
    assert off["stats"]["mean"]["within"] == 2  # 1% and 1%
    assert "paired" not in off["stats"]
    assert (off["with_target"], off["target_reached"]) == (2, 1)
    srv = t["server"]["torch.matmul"]["stats"]
    assert srv["paired"]["max"] == pytest.approx(0.012)  # the ratio the reports compare: within 2%
    assert srv["median"]["max"] == pytest.approx(0.10)  # the medians 10% apart
    assert t["server"]["torch.matmul"]["with_target"] == 0
    assert repeat_agreement([]) == {}


def test_replay_fixed_cost_is_recovered_from_repeats_with_unlike_graph_lengths():
    from gemmrl.report.noise import replay_fixed_cost

    rng = random.Random(5)
    x = 4.0
    pairs = []
    for _ in range(200):
        t = rng.uniform(3.0, 50.0)  # the call's own time
        n1, n2 = rng.choice([8, 12, 20, 56, 84, 236]), rng.choice([8, 12, 20, 56, 84, 236])
        pairs.append((t * (1 + rng.gauss(0, 0.002)) + x / n1, t * (1 + rng.gauss(0, 0.002)) + x / n2, n1, n2))
    r = replay_fixed_cost(pairs)
    assert r["fixed_cost_us"] == pytest.approx(x, rel=0.05)
    assert r["beyond_tolerance"] > 0 and r["beyond_tolerance_without_it"] == 0
    same = replay_fixed_cost([(5.0, 5.05, 56, 56), (5.0, 5.2, 20, 20)])  # one length: nothing to fit
    assert same["fitted_on"] == 0 and "fixed_cost_us" not in same and same["beyond_tolerance"] == 1
