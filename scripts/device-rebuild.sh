#!/usr/bin/env bash
# One device call that compiles on all cores while the GPUs work, for after a change to the
# CUTLASS template (which changes every build's hash) or before a search that needs new builds:
#   GEMMRL_COMMIT=<hash> scripts/device-rebuild.sh OUT
# Carry .ext/carry/nvidia_cutlass-*.whl, and the earlier build caches (.ext/carry/gcache*.txz:
# unpacked beside, not into, the new cache; the host-cost comparison loads its old builds from
# there, and a bench on the side finds its kernels there). On a machine with G GPUs and C cores,
# at once:
#   - BUILDS: `gemmrl build` argument sets separated by ';', compiled in turn into a fresh cache
#     (default, the seventh session's: every stored winner, then the fp16-accumulator grid's
#     top-2 CUTLASS candidates);
#   - the GPU test suite on GPU 0, less its timing test (which wants a quiet machine), compiling
#     its own kernels into the same cache (TESTS=0 skips it);
#   - SIDE_BENCH: `gemmrl bench` arguments run on GPUs 1..G-1 with --gpus G-1 (default: the
#     fp16-accumulator baselines over the grid in kernel mode; empty: none);
# then TUNE_AFTER, `gemmrl tune` argument sets separated by ';', the i-th on GPU i mod G, with the
# builds made and carried (empty: none; for a search whose candidates were compiled ahead), scripts/cutlass-host-cost.py on GPU 0 for
# HOST_COST_SHAPES (empty: skipped), and, unless PACK_NEW=0, the new cache packed for the next
# call in archives of at most 180 builds, OUT/gcache-new-N.txz, beside
# OUT/logs.tgz, OUT/host-cost.json and the store as OUT/gemmrl.sqlite.xz. TOTAL_S (default 560)
# cuts whatever is still running.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT}; total=${TOTAL_S:-560}
mkdir -p "$out/logs"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
. scripts/device-common.sh
install_cutlass
old=/tmp/gc-old; new=/tmp/gc-new
mkdir -p "$new"
unpack_caches "$old"
export GEMMRL_CACHE=$new
db=results/gemmrl.sqlite
python3 -m gemmrl.cli store --db "$db" > "$out/logs/store-before.txt" 2>&1
left() { echo $(( total - SECONDS )); }
ngpu=$(nvidia-smi -L | wc -l); cores=$(nproc)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv > "$out/logs/gpu.txt"
side=${SIDE_BENCH-"--shapes grid --acc fp16 --mode kernel --impl baselines"}
bench_pid=""
# the side bench and the tunes read kernels from the old caches (copied in; not packed again)
# and from the new one as it fills
cp -r "$old/builds" "$new/" 2>/dev/null; find "$new/builds" -maxdepth 1 -mindepth 1 -type d > /tmp/gc-carried.txt
if [ "$ngpu" -gt 1 ] && [ -n "$side" ]; then
  others=$(seq -s, 1 $((ngpu - 1)))
  CUDA_VISIBLE_DEVICES=$others timeout "$(( $(left) - 90 ))" python3 -m gemmrl.cli bench --gpus $((ngpu - 1)) \
    --db "$db" $side --budget-s "$(( $(left) - 150 ))" --no-report > "$out/logs/side-bench.log" 2>&1 &
  bench_pid=$!
fi
tests_pid=""
if [ "${TESTS:-1}" = 1 ]; then
  timing=tests/test_gpu_harness.py::test_timing_modes_agree_and_catch_wrong_outputs
  ( CUDA_VISIBLE_DEVICES=0 GEMMRL_TEST_OUT=$out/logs timeout "$(( $(left) - 200 ))" python3 -m pytest -m gpu -v -s \
      -p no:cacheprovider -n 4 --dist loadfile --deselect "$timing" tests > "$out/logs/gpu-tests.log" 2>&1;
    echo "gpu tests exit $?" >> "$out/logs/gpu-tests.log" ) &
  tests_pid=$!
fi
jobs_n=$(( cores > 24 ? cores - 12 : cores ))
builds=${BUILDS-"--tuned-in $db; --shapes grid --acc fp16 --top 2 --family cutlass_sm90"}
IFS=';' read -ra sets <<< "$builds"
for args in "${sets[@]}"; do
  [ -n "${args// }" ] || continue
  echo "== gemmrl build $args" >> "$out/logs/build.log"
  timeout "$(( $(left) - 150 ))" python3 -m gemmrl.cli build $args --jobs "$jobs_n" >> "$out/logs/build.log" 2>&1
  echo "exit $?" >> "$out/logs/build.log"
done
grep -E "^==|distinct|^exit|FAIL" "$out/logs/build.log" | head -30
[ -n "$tests_pid" ] && { wait "$tests_pid"; tail -3 "$out/logs/gpu-tests.log"; }
if [ -n "${TUNE_AFTER:-}" ]; then
  # the i-th ';'-separated set on GPU i mod G; the sets of one GPU in turn, the GPUs at once
  IFS=';' read -ra tsets <<< "$TUNE_AFTER"
  tpids=()
  for g in $(seq 0 $((ngpu - 1))); do
    ( for i in "${!tsets[@]}"; do
        args=${tsets[$i]}
        [ $((i % ngpu)) = "$g" ] && [ -n "${args// }" ] || continue
        log=$out/logs/tune-after-$i.log
        CUDA_VISIBLE_DEVICES=$g timeout "$(( $(left) - 80 ))" python3 -m gemmrl.cli tune --db "$db" \
          --out "$out/logs/tune-results-$i" $args --wall-s "$(( $(left) - 100 ))" --no-report > "$log" 2>&1
        echo "tune exit $?" >> "$log"
      done ) &
    tpids+=($!)
  done
  wait "${tpids[@]}"
  for f in "$out"/logs/tune-after-*.log; do echo "== $f"; grep -E "^tuned|^the winners|exit" "$f"; done
fi
shapes=${HOST_COST_SHAPES-"128x2048x256,4096x128x64,64x64x2048,12288x128x64,2048x2048x12288"}
if [ -n "$shapes" ]; then
  CUDA_VISIBLE_DEVICES=0 timeout "$(( $(left) - 60 ))" python3 scripts/cutlass-host-cost.py --db "$db" --old-cache "$old" \
    --shapes "$shapes" --out "$out/host-cost.json" 2>&1 | tee "$out/logs/host-cost.log"
fi
[ -n "$bench_pid" ] && { wait "$bench_pid"; tail -4 "$out/logs/side-bench.log"; }
# the new builds only (not those copied in for the side bench), 180 to an archive (16 MiB a file)
[ "${PACK_NEW:-1}" = 1 ] && ( cd "$new" && find builds -mindepth 1 -maxdepth 1 -type d ! -name '.*' ! -name '*.failed' \
    | { if [ -f /tmp/gc-carried.txt ]; then grep -v -x -F -f <(sed "s|^$new/||" /tmp/gc-carried.txt); else cat; fi; } \
    | sort | split -l 180 - /tmp/gc-part-
  n=0; for part in /tmp/gc-part-*; do [ -s "$part" ] || continue; n=$((n + 1))
    tar cf - -T "$part" | xz -T0 -6 > "$out/gcache-new-$n.txz"; done )
rm -f /tmp/gc-part-*
ls -la "$out"
send_store_back "$out" "$db"
tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$out/logs"
