"""The opt-in precision rule of the host timing modes: sample until every median is known to
within a target, instead of for a fixed time (pure parts; the GPU loop calls HostSettings.done)."""

import math
import random
import statistics

import pytest

from gemmrl.bench.stats import median_ci_rel, precise_enough
from gemmrl.bench.timing import HostSettings


def test_median_ci_shrinks_with_samples_and_needs_eight():
    rng = random.Random(0)
    draw = [10.0 * (1 + 0.05 * rng.gauss(0, 1)) for _ in range(4000)]
    assert median_ci_rel(draw[:7]) == math.inf
    w100, w400, w1600 = (median_ci_rel(draw[:n]) for n in (100, 400, 1600))
    assert w100 > w400 > w1600 > 0
    # normal noise of 5%: the median's CI half-width is about 1.96 * 1.2533 * 0.05 / sqrt(n)
    assert w1600 == pytest.approx(1.96 * 1.2533 * 0.05 / 40, rel=0.3)
    assert median_ci_rel([5.0] * 20) == 0.0


def test_precise_enough_needs_every_implementation():
    rng = random.Random(1)
    tight = [10 + rng.random() * 0.01 for _ in range(100)]
    loose = [10 + rng.random() * 5 for _ in range(100)]
    assert precise_enough({"a": tight}, 0.005)
    assert not precise_enough({"a": tight, "b": loose}, 0.005)


def test_done_v2_rule_is_unchanged_and_v3_stops_on_precision_or_caps():
    v2 = HostSettings(min_rounds=30, max_rounds=200, budget_s=0.5)
    assert v2.protocol() == "offline:v2"
    assert not v2.done(29, 10.0, {}) and not v2.done(30, 0.4, {}) and v2.done(30, 0.6, {}) and v2.done(200, 0.0, {})
    v3 = HostSettings(min_rounds=30, max_rounds=2000, target_ci=0.005, max_s=5.0)
    assert v3.protocol() == "offline:v3:ci=0.005"
    assert HostSettings(mode="server", target_ci=0.01).protocol() == "server:v3:ci=0.01:qps=1000"
    tight = {"a": [10.0 + 0.001 * i for i in range(40)]}
    loose = {"a": [10.0 + (i % 7) for i in range(40)]}
    assert not v3.done(29, 0.0, tight)  # below min_rounds: never
    assert v3.done(40, 0.6, tight)  # precise: stop, however short
    assert not v3.done(40, 0.6, loose)  # not precise and under max_s: go on (v2 would stop here)
    assert v3.done(40, 5.1, loose) and v3.done(2000, 0.0, loose)  # the caps
    # past the first 10 rounds the precision is checked every 10th round only (it sorts every
    # sample); the caps are checked at every round
    assert not v3.done(41, 0.6, tight) and v3.done(50, 0.6, tight)
    assert v3.done(41, 5.1, loose)


def test_server_gaps_round_is_its_own_protocol_and_checked():
    each = HostSettings(mode="server", target_ci=0.005)
    rnd = HostSettings(mode="server", target_ci=0.005, gaps="round")
    assert each.protocol() == "server:v3:ci=0.005:qps=1000"  # unchanged: earlier runs still resume
    assert rnd.protocol() == "server:v3:ci=0.005:qps=1000:gaps=round"
    assert HostSettings(mode="server", gaps="round").protocol() == "server:v2:qps=1000:gaps=round"
    with pytest.raises(ValueError, match="gaps must be one of"):
        HostSettings(mode="server", gaps="paired")
    with pytest.raises(ValueError, match="server-mode setting"):
        HostSettings(mode="offline", gaps="round")
    with pytest.raises(ValueError, match="max_s"):
        HostSettings(max_s=0)


def test_draw_gaps_each_keeps_the_old_draws_and_round_shares_one():
    from gemmrl.bench.timing import draw_gaps

    order = ["a", "b", "c", "d"]
    s_each = HostSettings(mode="server", qps=2000.0)
    # "each": the draws the timer made before gaps= existed, one expovariate per call in order
    old = random.Random(7)
    assert draw_gaps(random.Random(7), order, s_each) == [old.expovariate(2000.0) for _ in order]
    rng = random.Random(3)
    rounds = [draw_gaps(rng, order, HostSettings(mode="server", qps=2000.0, gaps="round")) for _ in range(4000)]
    assert all(len(set(g)) == 1 and len(g) == 4 for g in rounds)  # one gap, waited by every call
    firsts = [g[0] for g in rounds]
    assert len(set(firsts)) == len(firsts)  # a fresh draw every round
    assert statistics.fmean(firsts) == pytest.approx(1 / 2000.0, rel=0.05)  # still exponential at the QPS
    assert statistics.median(firsts) == pytest.approx(math.log(2) / 2000.0, rel=0.06)
    assert draw_gaps(random.Random(0), order, HostSettings(mode="offline")) == [0.0] * 4


def test_mean_rule_is_v4_and_stops_on_the_means_ci():
    from gemmrl.bench.stats import mean_ci_rel

    rng = random.Random(5)
    # a bimodal server-like draw: the mean's CI shrinks as 1/sqrt(n) and is what v4 stops on
    draw = [rng.choice((30.0, 90.0)) * (1 + 0.05 * rng.gauss(0, 1)) for _ in range(4000)]
    sd, mean = statistics.stdev(draw), statistics.fmean(draw)
    assert mean_ci_rel(draw) == pytest.approx(1.96 * sd / math.sqrt(4000) / mean, rel=1e-9)
    assert mean_ci_rel(draw[:7]) == math.inf and mean_ci_rel(draw[:100]) > mean_ci_rel(draw[:1600])
    v4 = HostSettings(mode="server", target_ci=0.03, stat="mean", gaps="round", max_s=20.0)
    assert v4.protocol() == "server:v4:ci=0.03:qps=1000:gaps=round"
    # stat= changes only the precision rule: without a target the protocol is still v2
    assert HostSettings(mode="server", stat="mean").protocol() == "server:v2:qps=1000"
    samples = {"a": draw[:2000], "b": draw[2000:]}
    assert mean_ci_rel(draw[:2000]) < 0.03 and v4.done(2000 - 1, 1.0, samples)
    assert not v4.done(60, 1.0, {"a": draw[:60]})  # 60 bimodal samples: the mean is not known to 3%
    with pytest.raises(ValueError, match="stat must be"):
        HostSettings(stat="mode")


def test_paired_rounds_divide_out_the_rounds_state():
    from gemmrl.bench.stats import PairedRounds

    p = PairedRounds()
    assert p.ratio("a", "b") is None and p.ratios(["a", "b"]) == {"a": {}, "b": {}}
    rng = random.Random(1)
    for _ in range(400):
        state = rng.choice((30.0, 90.0))  # shared by the round's calls
        cold = lambda: 1.5 if rng.random() < 0.2 else 1.0  # noqa: E731  (and each call's own)
        p.add_round({"a": state * cold(), "b": state * 1.10 * cold(), "c": state * 0.95 * cold()})
    r = p.ratios(["a", "b", "c"])
    assert r["a"]["b"] == pytest.approx(1.10) and r["a"]["c"] == pytest.approx(0.95)
    assert r["b"]["a"] == pytest.approx(1 / r["a"]["b"]) and r["c"]["b"] == pytest.approx(1.10 / 0.95)
    assert p.precise_enough(["a", "b", "c"], 0.01)
    q = PairedRounds()
    q.add_round({"a": 1.0, "b": 2.0})
    assert not q.precise_enough(["a", "b"], 0.5)  # under 8 rounds nothing is known
    assert PairedRounds().precise_enough(["a", "missing"], 0.5) is False
    # an implementation absent from some rounds (failed, say) is compared on the rounds both ran
    p.add_round({"a": 10.0, "c": 30.0})
    assert len(p.log_ratios("a", "c")) == 401 and len(p.log_ratios("a", "b")) == 400
    with pytest.raises(ValueError, match="finite and positive"):
        p.add_round({"a": 0.0})


def test_paired_rule_is_v5_server_only_and_stops_on_the_ratios_ci():
    from gemmrl.bench.stats import PairedRounds

    v5 = HostSettings(mode="server", target_ci=0.01, stat="paired", gaps="round", max_s=20.0)
    assert v5.protocol() == "server:v5:ci=0.01:qps=1000:gaps=round"
    with pytest.raises(ValueError, match="server-mode statistic"):
        HostSettings(mode="offline", stat="paired")
    rng = random.Random(2)
    p = PairedRounds()
    samples = {"a": [], "b": []}
    for _ in range(60):
        state = rng.choice((30.0, 90.0))
        rnd = {"a": state * (1 + 0.002 * rng.gauss(0, 1)), "b": state * 1.2 * (1 + 0.002 * rng.gauss(0, 1))}
        p.add_round(rnd)
        for k, v in rnd.items():
            samples[k].append(v)
    # the means are far from known to 1% (the state is bimodal); the paired ratios are
    assert not precise_enough(samples, 0.01, stat="mean")
    assert v5.done(60, 1.0, samples, p)
    assert not v5.done(20, 1.0, samples, p)  # under min_rounds (30)
    with pytest.raises(ValueError, match="needs the rounds"):
        v5.done(60, 1.0, samples)


def test_reached_says_whether_the_target_held_when_sampling_stopped():
    from gemmrl.bench.stats import PairedRounds

    tight = {"a": [10.0 + 0.001 * i for i in range(40)]}
    loose = {"a": [10.0 + (i % 7) for i in range(40)]}
    assert HostSettings().reached(tight) is None  # no target: nothing to say
    v3 = HostSettings(target_ci=0.005)
    assert v3.reached(tight) is True and v3.reached(loose) is False
    rng = random.Random(3)
    p = PairedRounds()
    for _ in range(300):
        base = rng.choice([10.0, 20.0])  # the rounds' shared state: divides out of the ratio
        p.add_round({"a": base, "b": base * 1.1 * (1 + 0.001 * rng.random())})
    srv = HostSettings(mode="server", target_ci=0.005, gaps="round", stat="paired")
    samples = {"a": [1.0], "b": [1.0]}
    p2 = PairedRounds()
    for _ in range(12):
        p2.add_round({"a": 10.0, "b": rng.uniform(5.0, 50.0)})
    assert srv.reached(samples, p) is True
    assert srv.reached(samples, p2) is False  # twelve scattered rounds: not known to 0.5%
    with pytest.raises(ValueError, match="PairedRounds"):
        srv.reached(samples)


def test_kernel_graphs_are_sized_from_a_burst_and_hold_whole_passes_over_the_sets():
    from gemmrl.bench.timing import ESTIMATE_BURST_CALLS, calls_per_replay, estimate_burst

    assert estimate_burst(250.0) == ESTIMATE_BURST_CALLS > 1  # a cold single call: time a burst
    assert estimate_burst(5000.0) == 1  # a long call is its own estimate
    # 8.5 us a call, 4 sets, 2 ms: 59 passes; an estimate 30x too high gave 2 passes (8 calls)
    assert calls_per_replay(8.5, 4, 2000.0) == 236 and calls_per_replay(250.0, 4, 2000.0) == 8
    assert calls_per_replay(5000.0, 3, 2000.0) == 3  # at least one pass over the sets
    assert calls_per_replay(1.0, 1024, 500.0) == 1024
    with pytest.raises(ValueError):
        calls_per_replay(0.0, 4, 2000.0)


def test_one_graph_length_for_a_session_sized_for_its_fastest_call():
    from gemmrl.bench.timing import MAX_REPLAY_MULTIPLE, session_calls

    sizes = session_calls({"lt": 8.0, "ours": 3.5, "torch": 9.0, "slow": 400.0}, 4, 2000.0)
    assert sizes["lt"] == sizes["ours"] == sizes["torch"] == 572  # 2 ms at the fastest's 3.5 us
    # 400 us a call: at most MAX_REPLAY_MULTIPLE times the target, in whole passes over the sets
    assert MAX_REPLAY_MULTIPLE == 4.0 and sizes["slow"] == 20  # 5 passes of 4 sets: 8 ms
    assert session_calls({}, 4, 2000.0) == {}


def test_kernel_v1_rule_is_unchanged_and_v2_stops_on_precision_or_caps():
    from gemmrl.bench.timing import KernelSettings

    tight = {"a": [100.0] * 12, "b": [50.0] * 12}
    loose = {"a": [100.0, 90.0, 110.0] * 4, "b": [50.0] * 12}
    v1 = KernelSettings()
    assert v1.protocol() == "kernel:v1" and v1.reached(tight) is None
    assert not v1.done(9, 100.0, tight)  # min_rounds first
    assert not v1.done(10, 0.4, tight) and v1.done(10, 0.6, loose)  # then budget_s, precise or not
    assert v1.done(40, 0.0, loose)  # max_rounds
    v2 = KernelSettings(target_ci=0.005, max_rounds=400, max_s=3.0)
    assert v2.protocol() == "kernel:v2:ci=0.005"
    assert not v2.done(9, 0.0, tight)
    assert v2.done(12, 0.1, tight) and v2.reached(tight) is True  # precise: stops early
    assert not v2.done(12, 2.9, loose) and v2.reached(loose) is False  # not precise: goes on
    assert v2.done(12, 3.1, loose)  # until max_s
    assert v2.done(400, 0.0, loose)  # or max_rounds
    for bad in ({"target_ci": 0.0}, {"max_s": 0.0}, {"min_rounds": 50, "max_rounds": 40}, {"stat": "mean"},
                {"stat": "paired"}):  # paired is a target's statistic: without a target, v1's rule
        with pytest.raises(ValueError):
            KernelSettings(**bad)


def test_kernel_v3_stops_on_the_paired_ratios_which_the_clocks_steps_leave_alone():
    from gemmrl.bench.stats import PairedRounds
    from gemmrl.bench.timing import KernelSettings

    rng = random.Random(1)
    v3 = KernelSettings(target_ci=0.005, max_rounds=400, max_s=3.0, stat="paired")
    assert v3.protocol() == "kernel:v3:ci=0.005"
    # the clock steps between 200 and 240 us a call over the rounds; a and b share each round's
    # clock, b 2% slower, each with 0.1% of its own noise: the medians are not known to 0.5%,
    # the ratio is
    samples, paired = {"a": [], "b": []}, PairedRounds()
    for r in range(30):
        clock = 1.0 + 0.2 * rng.random()
        t = {"a": 200 * clock * (1 + 0.001 * rng.gauss(0, 1)), "b": 204 * clock * (1 + 0.001 * rng.gauss(0, 1))}
        for n in t:
            samples[n].append(t[n])
        paired.add_round(t)
    assert not precise_enough(samples, 0.005)
    assert v3.reached(samples, paired) is True and v3.done(30, 0.5, samples, paired)
    assert paired.ratio("a", "b") == pytest.approx(1.02, rel=0.002)
    assert not v3.done(9, 0.5, samples, paired)  # min_rounds first
    with pytest.raises(ValueError):
        v3.done(30, 0.5, samples)  # the paired target needs the rounds' ratios
