#!/usr/bin/env bash
# One device call after a change to the CUTLASS template, which changes every build's hash:
#   GEMMRL_COMMIT=<hash> scripts/device-rebuild.sh OUT
# Carry .ext/carry/nvidia_cutlass-*.whl and the earlier build cache (.ext/carry/gcache*.txz: the
# old builds the host-cost comparison loads). On a machine with G GPUs and C cores, at once:
#   - every stored winner (`gemmrl build --tuned-in`) and the fp16-accumulator grid candidates
#     (`gemmrl build --shapes grid --acc fp16 --top $FP16_TOP`) compiled into a fresh cache;
#   - the GPU test suite on GPU 0, less its timing test (which wants a quiet machine), compiling
#     its own kernels into the same cache;
#   - the fp16-accumulator baselines over the grid in kernel mode on GPUs 1..G-1 (bench --gpus);
# then scripts/cutlass-host-cost.py on GPU 0 (old builds against new, torch.matmul and cuBLASLt
# beside them), and the new cache packed for the next call: OUT/gcache-winners.txz (every build
# but the fp16-accumulator ones), OUT/gcache-f16.txz, OUT/logs.tgz, OUT/host-cost.json and the
# store as OUT/gemmrl.sqlite.xz. TOTAL_S (default 560) cuts whatever is still running.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT}; total=${TOTAL_S:-560}
mkdir -p "$out/logs"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
if [ ! -d /tmp/site/cutlass_library ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .ext/carry/nvidia_cutlass-*.whl
fi
old=/tmp/gc-old; new=/tmp/gc-new
mkdir -p "$old" "$new"
for g in .ext/carry/gcache*.txz; do
  [ -f "$g" ] && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1], 'r:*').extractall(sys.argv[2])" "$g" "$old"
done
export GEMMRL_CACHE=$new
db=results/gemmrl.sqlite
python3 -m gemmrl.cli store --db "$db" > "$out/logs/store-before.txt" 2>&1
left() { echo $(( total - SECONDS )); }
ngpu=$(nvidia-smi -L | wc -l); cores=$(nproc)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv > "$out/logs/gpu.txt"
bench_pid=""
if [ "$ngpu" -gt 1 ]; then
  others=$(seq -s, 1 $((ngpu - 1)))
  CUDA_VISIBLE_DEVICES=$others timeout "$(( $(left) - 90 ))" python3 -m gemmrl.cli bench --gpus $((ngpu - 1)) \
    --db "$db" --shapes grid --acc fp16 --mode kernel --impl baselines --budget-s "$(( $(left) - 150 ))" \
    --no-report > "$out/logs/fp16-baselines.log" 2>&1 &
  bench_pid=$!
fi
timing=tests/test_gpu_harness.py::test_timing_modes_agree_and_catch_wrong_outputs
( CUDA_VISIBLE_DEVICES=0 GEMMRL_TEST_OUT=$out/logs timeout "$(( $(left) - 200 ))" python3 -m pytest -m gpu -v -s \
    -p no:cacheprovider -n 4 --dist loadfile --deselect "$timing" tests > "$out/logs/gpu-tests.log" 2>&1;
  echo "gpu tests exit $?" >> "$out/logs/gpu-tests.log" ) &
tests_pid=$!
jobs_n=$(( cores > 24 ? cores - 12 : cores ))
{ timeout "$(( $(left) - 150 ))" python3 -m gemmrl.cli build --tuned-in "$db" --jobs "$jobs_n"
  echo "winners build exit $?"
  timeout "$(( $(left) - 150 ))" python3 -m gemmrl.cli build --shapes grid --acc fp16 --top "${FP16_TOP:-2}" \
    --family cutlass_sm90 --jobs "$jobs_n"
  echo "fp16 build exit $?"; } > "$out/logs/build.log" 2>&1
grep -E "distinct|exit|FAIL" "$out/logs/build.log" | head -20
wait "$tests_pid"
tail -3 "$out/logs/gpu-tests.log"
CUDA_VISIBLE_DEVICES=0 timeout "$(( $(left) - 60 ))" python3 scripts/cutlass-host-cost.py --db "$db" --old-cache "$old" \
  --shapes "${HOST_COST_SHAPES:-128x2048x256,4096x128x64,64x64x2048,12288x128x64,2048x2048x12288}" \
  --out "$out/host-cost.json" 2>&1 | tee "$out/logs/host-cost.log"
[ -n "$bench_pid" ] && { wait "$bench_pid"; tail -4 "$out/logs/fp16-baselines.log"; }
( cd "$new" && find builds -mindepth 1 -maxdepth 1 -type d ! -name '.*' ! -name '*.failed' | grep -v -- '_f16_f16-' \
    | tar cf - -T - | xz -T0 -6 > "$out/gcache-winners.txz"
  find builds -mindepth 1 -maxdepth 1 -type d -name '*_f16_f16-*' | tar cf - -T - | xz -T0 -6 > "$out/gcache-f16.txz" )
ls -la "$out"
python3 -m gemmrl.cli store --db "$db" --compress 2>&1 | tail -2
mv results/gemmrl.sqlite.xz "$out/gemmrl.sqlite.xz"
tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$out/logs"
