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
