"""Host cost and latency of single calls, for the experiment scripts that ask where a call's time
goes outside the judge's protocols (scripts/cutlass-host-cost.py, scripts/lt-host-cost.py).

Two numbers per implementation, each called the harness's way (fn(a, b_nn, b_tn, c)):
- enqueue: host time per call in bursts of `burst_calls` calls with no synchronisation (under the
  launch queue's depth, so the host never waits for the GPU), the median of `bursts` bursts,
  implementations interleaved;
- latency: synchronise, call, synchronise, one call at a time, implementations in a shuffled
  order each round, the median of `rounds` rounds: what `bench --mode offline` sees of one call.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Callable


def enqueue_and_latency(fns: dict[str, Callable], args: tuple, outs: dict, *, bursts: int = 25,
                        burst_calls: int = 200, rounds: int = 600, warm: int = 20, seed: int = 0,
                        sync: Callable[[], None] | None = None,
                        clock: Callable[[], float] = time.perf_counter) -> tuple[dict, dict]:
    """({name: median enqueue us}, {name: median latency us}) of `fns`, each called as
    fn(*args, outs[name]). `sync` waits for the device (default torch.cuda.synchronize); `clock`
    is the host clock in seconds. Both are arguments so that the bookkeeping is tested without a
    GPU."""
    if bursts < 1 or burst_calls < 1 or rounds < 1:
        raise ValueError(f"bursts, burst_calls and rounds must be positive, got {bursts}, {burst_calls}, {rounds}")
    if sync is None:
        import torch

        sync = torch.cuda.synchronize
    for _ in range(warm):  # warm every path
        for name, fn in fns.items():
            fn(*args, outs[name])
    sync()
    enq: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(bursts):
        for name, fn in fns.items():
            c = outs[name]
            sync()
            t0 = clock()
            for _ in range(burst_calls):
                fn(*args, c)
            enq[name].append((clock() - t0) / burst_calls * 1e6)
            sync()
    lat: dict[str, list[float]] = {n: [] for n in fns}
    order = list(fns)
    rnd = random.Random(seed)
    for _ in range(rounds):
        rnd.shuffle(order)
        for name in order:
            fn, c = fns[name], outs[name]
            sync()
            t0 = clock()
            fn(*args, c)
            sync()
            lat[name].append((clock() - t0) * 1e6)
    return ({n: statistics.median(v) for n, v in enq.items()},
            {n: statistics.median(v) for n, v in lat.items()})
