#!/usr/bin/env bash
# One step of a GPU session on the lent machine, everything it writes packed under OUT:
#   GEMMRL_COMMIT=<hash> scripts/device-session.sh OUT STEP [BUDGET_S]
# Carry .ext/carry (the nvidia-cutlass wheel; CUDA-L2 kernels under .ext/carry/cuda_l2 if wanted).
# STEP:
#   tests      every GPU test (scripts/gpu-tests.sh)
#   subset     kernel mode on the 100-shape subset: baselines, exhaustive cuBLASLt, torch.compile,
#              gemmrl's own families (ours)
#   hostmodes  offline and server modes on the grid, baselines (protocol v2: more samples)
#   bench      gemmrl bench with the arguments in $BENCH_ARGS (shapes, modes, impls, --retime), the
#              carried CUTLASS build cache unpacked first, so tuned winners load without nvcc
#   tune       gemmrl tune on $TUNE_SHAPES (default subset), $TUNE_CANDIDATES (8) per shape, CUTLASS
#              kernels only from the carried build cache (.ext/carry/gcache.tgz or .txz: tar of
#              $GEMMRL_CACHE/builds made by `gemmrl build` on any machine with nvcc); $TUNE_MATCH, if
#              set, limits the search to kernel names matching that regular expression; $TUNE_ACC
#              (fp32 or fp16) the accumulator (default fp32); $TUNE_GPUS (default 1) tunes on that many
#              GPUs of the machine at once (gemmrl tune --gpus); $TUNE_FAMILY (say cutlass_sm90) searches
#              that family alone, and then no raw kernel is compiled ahead
# Each step resumes from results/gemmrl.sqlite (unpacked from the committed .xz), and stops starting new shapes after BUDGET_S
# seconds (default 500), so a 10-minute device call always returns its store. TOTAL_S (default 560)
# caps the whole step: the tune is cut at that point, whatever it is doing, so the store is copied.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1; step=$2; budget=${3:-500}; total=${TOTAL_S:-560}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 GEMMRL_CACHE=${GEMMRL_CACHE:-/tmp/gemmrl-cache}
. scripts/device-common.sh
install_cutlass  # the carried headers tarball or nvidia-cutlass wheel
export PYTHONPATH=$PWD:/tmp/site
[ -d .ext/carry/cuda_l2 ] && export GEMMRL_CUDA_L2_DIR=$PWD/.ext/carry/cuda_l2
db=results/gemmrl.sqlite
unpack_cache() {  # every .ext/carry/gcache*.tgz / .txz, gzip or xz (scripts/pack-build-cache.sh): a
  # filtered cache (gcache-fp16.txz, say) can be carried when the whole one would pass the
  # device tool's 64 MiB limit together with the working tree
  # once per machine: a second step in the same call finds the marker and skips the unpacking
  for g in .ext/carry/gcache*.tgz .ext/carry/gcache*.txz; do
    [ -f "$g" ] || continue
    mark="$GEMMRL_CACHE/.unpacked-$(basename "$g")-$(stat -c %s "$g")"
    [ -f "$mark" ] && continue
    mkdir -p "$GEMMRL_CACHE" && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1], 'r:*').extractall(sys.argv[2])" "$g" "$GEMMRL_CACHE" && touch "$mark"
  done
}
cap_at() {  # seconds a step may run: $1, or less when the whole call's TOTAL_S is nearer
  local left=$(( total - SECONDS )); echo $(( $1 < left ? $1 : left ))
}
case "$step" in
  tests) scripts/gpu-tests.sh "$out"; rc=$? ;;
  subset) timeout $((budget + 80)) python3 -m gemmrl.cli bench --db "$db" --out "$out/results" --shapes subset \
            --mode kernel --impl baselines --impl exhaustive --impl torch.compile --impl ours \
            --subject gemmrl-cutlass_sm90+raw --budget-s "$budget" 2>&1 | tee "$out/bench.log"; rc=${PIPESTATUS[0]} ;;
  hostmodes) timeout $((budget + 80)) python3 -m gemmrl.cli bench --db "$db" --out "$out/results" --shapes grid \
            --mode offline,server --quick --impl baselines --budget-s "$budget" 2>&1 | tee "$out/bench.log"; rc=${PIPESTATUS[0]} ;;
  bench) unpack_cache
        cap=$(cap_at $((budget + 200)))
        echo "bench $BENCH_ARGS: budget ${budget}s, cut at ${cap}s" | tee "$out/bench.log"
        timeout "$cap" python3 -m gemmrl.cli bench --db "$db" --out "$out/results" $BENCH_ARGS \
            --budget-s "$budget" 2>&1 | tee -a "$out/bench.log"; rc=${PIPESTATUS[0]} ;;
  tune) # CUTLASS builds from the carried cache (gemmrl build, made without a GPU: .ext/carry/gcache.tgz);
        # raw kernels compile here, in parallel, before the search
        shapes=${TUNE_SHAPES:-subset}
        unpack_cache
        # raw kernels only for the shapes this call can reach (those with fewer than the asked
        # candidates tried, TUNE_PREBUILD_SHAPES of them): over the grid, all 3000 would take 5 minutes
        case "${TUNE_FAMILY:-raw}" in
          *raw*) python3 -m gemmrl.cli build --family raw --top 3 --shapes "$shapes" --jobs "$(nproc)" ${TUNE_ACC:+--acc "$TUNE_ACC"} \
                   --pending-in "$db" --candidates "${TUNE_CANDIDATES:-8}" \
                   --max-shapes "${TUNE_PREBUILD_SHAPES:-120}" 2>&1 | tail -3 | tee "$out/build.log" ;;
        esac
        # no report here: over the grid it takes minutes of this machine's time, and `gemmrl report`
        # writes the same from the returned store on any machine
        cap=$(cap_at $((budget + 300)))
        echo "tune: search budget ${budget}s, cut at ${cap}s" | tee "$out/tune.log"
        timeout "$cap" python3 -m gemmrl.cli tune --db "$db" --out "$out/results" --shapes "$shapes" ${TUNE_ACC:+--acc "$TUNE_ACC"} \
            --candidates "${TUNE_CANDIDATES:-8}" --built-only ${TUNE_MATCH:+--match "$TUNE_MATCH"} --wall-s "$budget" \
            --gpus "${TUNE_GPUS:-1}" ${TUNE_FAMILY:+--family "$TUNE_FAMILY"} --no-report 2>&1 | tee -a "$out/tune.log"; rc=${PIPESTATUS[0]} ;;
  *) echo "unknown step $step: tests | subset | hostmodes | bench | tune" >&2; exit 2 ;;
esac
# the store comes back as git keeps it, xz-compressed (files come back at most 16 MiB each; the plain
# store is over 40 MB): here, `cp OUT/gemmrl.sqlite.xz results/ && rm results/gemmrl.sqlite`, and the
# next command unpacks it. `gemmrl store --compress` folds in the -wal file a tune cut by `timeout` leaves.
python3 -m gemmrl.cli store --db "$db" --compress >/dev/null && cp "$db.xz" "$out/gemmrl.sqlite.xz"
[ -d "$out/results" ] && tar czf "$out/results.tgz" -C "$out" results && rm -rf "$out/results"
exit "$rc"
