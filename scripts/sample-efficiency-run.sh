#!/usr/bin/env bash
# The device half of the sample-efficiency study (scripts/sample-efficiency.py reads what it leaves):
# on a machine whose build cache holds the study's candidate set (carried as
# .ext/carry/gcache-*.txz, e.g. `gemmrl build --shapes subset --top 2 --family cutlass_sm90`), time
# every built candidate on each subset shape (the exhaustive sweep) and then the model-free
# policy's first MF_N, each search in its own copy of the baselines store BASE, on all GPUs:
#   BASE=.ext/carry/se/base.sqlite [MF_N=16] [SHAPES=subset] scripts/sample-efficiency-run.sh OUT
# OUT gets sweep.sqlite.xz, mf.sqlite.xz and a log of each. The searches are --search-only: no
# race, no final timing, so the two stores hold the trials alone (the study's samples).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT}
: "${BASE:?BASE: the baselines store both searches start from (bench --impl baselines --shapes SHAPES)}"
[ -f "$BASE" ] || { echo "no baselines store at $BASE" >&2; exit 2; }
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site GEMMRL_CACHE=${GEMMRL_CACHE:-/tmp/gemmrl-cache}
. scripts/device-common.sh
install_cutlass
unpack_caches "$GEMMRL_CACHE"
gpus=$(nvidia-smi -L | wc -l)
F=(--shapes "${SHAPES:-subset}" --family cutlass_sm90 --built-only --search-only --gpus "$gpus" --no-report)
rc=0
for what in "sweep --policy exhaustive --candidates 10000" "mf --policy model-free --candidates ${MF_N:-16}"; do
  set -- $what
  name=$1; shift
  cp "$BASE" "/tmp/$name.sqlite"
  echo "== $name: gemmrl tune ${F[*]} $* ($(date -u +%T))" | tee -a "$out/study.txt"
  python3 -m gemmrl.cli tune "${F[@]}" "$@" --db "/tmp/$name.sqlite" > "$out/$name.log" 2>&1
  r=$?
  # each GPU's worker says "[gpuN] tuned S shapes with C new candidates ..."
  echo "exit $r ($(date -u +%T)); $(grep -E '^(\[gpu[0-9]+\] )?tuned ' "$out/$name.log" | tr '\n' ' ')" \
    | tee -a "$out/study.txt"
  [ "$r" = 0 ] || rc=$r
  xz -9 -c "/tmp/$name.sqlite" > "$out/$name.sqlite.xz"
done
exit $rc
