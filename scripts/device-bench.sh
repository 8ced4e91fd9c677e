#!/usr/bin/env bash
# Run `gemmrl bench` on the lent GPU machine and pack what it wrote for the trip back:
#   GEMMRL_COMMIT=<hash> scripts/device-bench.sh OUT_DIR DB [gemmrl bench options...]
# (the device machine's copy of the tree has no .git: pass the commit being measured)
# OUT_DIR gets bench.log, the store (DB is copied there when it finishes) and results.tgz
# (results/<gpu>/: CSVs, summary.json, plots). Carried CUTLASS headers (a tarball or wheel) under
# .ext/carry/ is installed first, for CUDA-L2's kernels.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1; db=$2; shift 2
mkdir -p "$out"
if [ -z "${GEMMRL_COMMIT:-}" ] && ! git rev-parse HEAD >/dev/null 2>&1; then
  echo "warning: no .git here and GEMMRL_COMMIT unset: runs will record commit 'unknown'" >&2
fi
export PYTHONUNBUFFERED=1 GEMMRL_CACHE=${GEMMRL_CACHE:-/tmp/gemmrl-cache}
. scripts/device-common.sh
install_cutlass  # the carried headers tarball or nvidia-cutlass wheel
export PYTHONPATH=$PWD:/tmp/site
python3 -m gemmrl.cli bench --db "$db" --out "$out/results" "$@" 2>&1 | tee -a "$out/bench.log"
rc=${PIPESTATUS[0]}
cp "$db" "$out/" 2>/dev/null
[ -d "$out/results" ] && tar czf "$out/results.tgz" -C "$out" results && rm -rf "$out/results"
exit "$rc"
