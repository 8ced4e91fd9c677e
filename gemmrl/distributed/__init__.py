"""Tuning across many GPUs and machines on Ray (an optional extra: pip install 'gemmrl[distributed]').

`ray_backend.ray_evaluator` is a drop-in for `search.run.isolated_evaluator`: a batch of
candidates is split across Ray actors, one per GPU (pinned by Ray's CUDA_VISIBLE_DEVICES), each
holding its own `bench.worker.Worker`, so a candidate that crashes, hangs or exhausts memory
kills only that worker process; the actor names the culprit from its heartbeat, the driver
quarantines it in the one store, and the run goes on. Only actors whose GPU model equals the
store's device name are used: timings are never compared across GPU models. `ray_prebuild`
compiles sources as CPU tasks. Nothing here imports Ray until it is called; `available()` says
whether it can be.
"""

from gemmrl.distributed.ray_backend import available, ray_evaluator, ray_prebuild

__all__ = ["available", "ray_evaluator", "ray_prebuild"]
