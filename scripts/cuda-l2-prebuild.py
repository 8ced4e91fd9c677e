#!/usr/bin/env python3
"""Build CUDA-L2's published kernels for a shape set as torch extensions, in parallel processes
at low CPU priority (so that a GPU job beside it keeps its cores), and pack the built modules
into a build-cache archive that a later device call carries: there `gemmrl bench --impl
cuda-l2:DIR` imports each prebuilt module instead of compiling it again (gemmrl/baselines/cuda_l2.py).

    python3 scripts/cuda-l2-prebuild.py --dir .ext/carry/cuda_l2_subset \
        --shapes results/shapes/subset-every3rd.txt --jobs 10 --out $OUT/gcache-cudal2.txz

The archive holds cuda_l2/<module>/<module>.so relative to $GEMMRL_CACHE, the layout
scripts/device-common.sh's unpack_caches restores from .ext/carry/gcache*.txz. A module is only
valid under the torch it was built with: build and use on the same machine image.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="CUDA-L2 kernel files, <M>_<N>_<K>.cu")
    ap.add_argument("--shapes", required=True, help="shape set (gemmrl's --shapes syntax)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--out", required=True, help="the archive to write (.txz)")
    ap.add_argument("--nice", type=int, default=19, help="CPU priority increment for the builds")
    args = ap.parse_args(argv)

    from gemmrl.baselines.cuda_l2 import CudaL2Impl, module_name, prebuild
    from gemmrl.build.nvcc import cache_root
    from gemmrl.core.shapes import resolve

    problems = resolve(args.shapes)
    impl = CudaL2Impl(args.dir)
    paths = sorted({str(impl.path_for(p)) for p in problems if impl.supports(p)})
    missing = len({(p.M, p.N, p.K) for p in problems}) - len(paths)
    root = cache_root() / "cuda_l2"
    print(f"building {len(paths)} CUDA-L2 kernels with {args.jobs} processes ({missing} shapes have no file)",
          flush=True)
    if args.nice:
        os.nice(args.nice)
    t0 = time.monotonic()
    built = []

    def done(path, err):
        name = module_name(path)
        so = root / name / f"{name}.so"
        if err or not so.exists():
            print(f"not built: {Path(path).name}: {(err or 'no module')[-300:]}", flush=True)
        else:
            built.append(so)
            print(f"built {Path(path).name} ({time.monotonic() - t0:.0f} s)", flush=True)

    # SIGTERM (the device call's time is up): pack what is built so far, leave the rest
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    stopped = False
    try:
        prebuild(paths, str(root), args.jobs, on_done=done)
    except KeyboardInterrupt:
        stopped = True
        print(f"stopped after {time.monotonic() - t0:.0f} s: packing the {len(built)} built", flush=True)
    with tarfile.open(args.out, "w:xz", preset=1) as tar:
        for so in built:
            tar.add(so, arcname=str(so.relative_to(cache_root())))
    print(f"built {len(built)} of {len(paths)} in {time.monotonic() - t0:.0f} s; "
          f"{args.out}: {Path(args.out).stat().st_size / 1e6:.1f} MB", flush=True)
    if stopped:  # the builds still running would hold the interpreter's exit: leave them
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
