#!/usr/bin/env bash
# A device call made of several gemmrl commands run in turn on one store, for a session's last
# minutes where tunes and benches of different shape sets must share one call:
#   GEMMRL_COMMIT=<hash> STEPS="tune --shapes A ...; bench --shapes B ..." scripts/device-steps.sh OUT
# A step's words split as a shell would split them, quotes grouping words (pytest -k 'a or b'), with
# no expansion; steps split on ';' first, so a step holds none, quoted or not.
# A step may also be "pytest ARGS" (python3 -m pytest ARGS), "scripts/NAME.py ARGS" (python3
# scripts/NAME.py ARGS) or "scripts/NAME.sh ARGS" (bash scripts/NAME.sh ARGS: "scripts/gpu-tests.sh"
# runs the GPU tests with the carried headers and caches, its logs under OUT/logs/gpu-tests; run
# outside device-steps.sh it found no headers, 2026-11-29j); those get no --db or --out, and find
# OUT in their environment; so does
# "build ARGS" (gemmrl build, e.g. --tuned-in results/gemmrl.sqlite --variants epi: kernels the next
# steps race, compiled on the device's cores into the cache they read).
# STEPS run on GPU 0; on a machine with G GPUs, STEPS_1 .. STEPS_<G-1> run on the others at once
# (each lane's steps in turn, all writing the one store). A step with --gpus N, N > 1 (bench --gpus 4),
# sees every GPU, so give it a lane of its own with no other lane's steps beside it (--gpus 1: its lane's). PRE="build ...; ..." runs first, alone
# (its logs step-pre.N-VERB.log), e.g. the kernels every lane will time compiled on all cores.
# A step "wait" (or "@N wait": at most N s) is a barrier between lanes: its lane goes on once every
# other lane has reached its own wait of the same number (its first, second, ...) or has no steps
# left, e.g. STEPS="tune --shapes A ...; wait; pack ..." STEPS_1="tune --shapes B ...": the pack
# reads the store after both tunes (the fiftieth session's call 5 exported while lane 1 still tuned).
# Carry the CUTLASS headers (.ext/carry/cutlass-headers-*.txz from scripts/pack-cutlass-headers.sh, or
# the nvidia_cutlass wheel) and the build caches the steps need (.ext/carry/gcache*.txz,
# unpacked into the one cache every step reads). Each step gets --db (and --out for tune and
# bench, under OUT/logs) and whatever is left of TOTAL_S (default 560) less 60 s as its timeout,
# or less: a step written "@SECONDS tune ..." is cut after that many seconds (SIGTERM: it stops
# cleanly, keeping what it measured; one still running 30 s later is killed, so the store still
# comes back; a tune step without --wall-s, --finish-s or --search-only gets --finish-s 20 s under its
# timeout, so that the final timing ends inside it, 2026-11-30f); a step's failure does not stop the next. OUT gets logs.tgz (a log per step) and the store,
# compressed, as OUT/gemmrl.sqlite.xz: only this call's runs, as OUT/gemmrl-delta.sqlite.xz, unless
# FULL_STORE=1 (scripts/device-common.sh).
# CACHE_BACK=FILE: the builds a step listed in FILE (`build ... --entries FILE`) come back packed as
# OUT/gcache-back.txz (carry it in a later call, as .ext/carry/gcache-NAME.txz, instead of
# compiling them again). A call carrying a partial cache times what it holds and no more:
#   STEPS="scripts/stale-shapes.py --device H200 --mode offline ... --built-in /tmp/gemmrl-cache --out rest.txt
#   --lanes 2; wait; bench --shapes rest-l0.txt ..." STEPS_1="wait; bench --shapes rest-l1.txt ..."
# (a step, not the outer command: the headers the keys need are set up for the steps alone; rest-unbuilt.txt
# lists the shapes left for a later call).
# Carry the deltas of this session's earlier calls as .ext/carry/delta*.sqlite.xz: they are merged into
# the call's store before any step (a `pack` on the device otherwise exports from the committed store).
# BG="command" runs beside the steps at the lowest CPU priority (CPU work for a later call, such
# as scripts/cuda-l2-prebuild.py), its output in OUT/bg.log; the call waits for it until TOTAL_S
# less 30 s, then stops it (SIGTERM, and up to 15 s for its own clean-up).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT}; total=${TOTAL_S:-560}
: "${STEPS:?STEPS: ';'-separated gemmrl commands}"
mkdir -p "$out/logs"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site GEMMRL_CACHE=${GEMMRL_CACHE:-/tmp/gemmrl-cache}
. scripts/device-common.sh
install_cutlass
unpack_caches "$GEMMRL_CACHE"
db=results/gemmrl.sqlite
# the committed store and the carried deltas, nothing more: a warm machine's store from earlier calls is
# kept only while it holds no run that is neither committed nor carried (scripts/device-store.py)
carried=()
for d in .ext/carry/delta*.sqlite .ext/carry/delta*.sqlite.xz; do [ -f "$d" ] && carried+=("$d"); done
python3 scripts/device-store.py "$db" ${carried[@]+"${carried[@]}"} 2>&1 | tee "$out/logs/store-before.txt"
python3 -m gemmrl.cli store --db "$db" >> "$out/logs/store-before.txt" 2>&1  # unpacked once, before the lanes
# carried deltas (.ext/carry/delta*.sqlite[.xz]: what earlier calls sent back, merged where the session
# runs but not yet committed) go into the store first, in name order, so that a step reading the
# store (pack, scripts/stale-shapes.py) sees them; merging one twice adds nothing, and the call
# sends back only its own runs
for d in .ext/carry/delta*.sqlite .ext/carry/delta*.sqlite.xz; do
  [ -f "$d" ] || continue
  if python3 -m gemmrl.cli store --db "$db" --merge "$d" >> "$out/logs/store-before.txt" 2>&1; then
    echo "merged $d" | tee -a "$out/logs/steps.txt"
  else
    echo "could not merge $d (store-before.txt)" | tee -a "$out/logs/steps.txt"
  fi
done
since=$(python3 -c "import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute('SELECT COALESCE(MAX(id), 0) FROM runs').fetchone()[0])" "$db")
# the set-up (headers, caches, store, deltas) counts against TOTAL_S: say what it left the steps (a
# fresh call of the forty-ninth session with TOTAL_S=125 left its one step 41 s, which measured nothing)
echo "set-up took $SECONDS s; the steps have $(( total - SECONDS - 60 )) s of TOTAL_S=$total (60 s kept for the store)" \
  | tee -a "$out/logs/steps.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv > "$out/logs/gpu.txt"
bgpid=""
if [ -n "${BG:-}" ]; then
  OUT=$out nice -n 19 bash -c "$BG" > "$out/bg.log" 2>&1 &
  bgpid=$!
  echo "background: $BG" | tee -a "$out/logs/steps.txt"
fi
# a step's words into argv as a shell would split them (quotes kept together: pytest -k 'a or b'),
# with no expansion of any kind; a step may not hold a ';' even in quotes (steps split on it first)
split_words() {
  local f
  f=$(mktemp)
  if python3 -c 'import shlex, sys; sys.stdout.write("\0".join(shlex.split(sys.argv[1])))' "$1" > "$f" 2>/dev/null; then
    mapfile -d '' -t argv < "$f"
    rm -f "$f"
    return 0
  fi
  rm -f "$f"
  return 1
}
# the call's runs so far, sent back as OUT/gemmrl-delta.sqlite.xz after each step and every SNAP_S
# seconds (default 120): a call killed from outside (the device tool's limit is below TOTAL_S where
# little device time is left: the thirty-ninth session lost a settle's five runs and a tune so)
# still brings back what it measured; the end of the call replaces it with the whole delta.
# Written beside and renamed, so OUT never holds half a file; one at a time (flock).
snapshot() {
  [ -n "${FULL_STORE:-}" ] && return 0
  (
    command -v flock > /dev/null && { flock -n 9 || exit 0; }
    [ -e "/tmp/gemmrl-snap-done-$$" ] && exit 0  # the whole delta is being written
    d=/tmp/gemmrl-snap-$$.sqlite
    rm -f "$d" "$d.xz"
    python3 -m gemmrl.cli store --db "$d" --merge "$db" --since-run "$since" --compress > /dev/null 2>&1 \
      && mv "$d.xz" "$out/.gemmrl-delta.part" && mv "$out/.gemmrl-delta.part" "$out/gemmrl-delta.sqlite.xz"
    rm -f "$d" "$d.xz"
  ) 9> /tmp/gemmrl-snap.lock
}
snaps() {  # its sleep is killed at the end of the call, which ends the loop
  while sleep "${SNAP_S:-120}"; do snapshot; done
}
# the lanes' barrier (a step "wait"): lane g marks its n-th wait in $sync, then waits until every
# other running lane has marked its n-th wait or its end (lane_done), at most CAP s and never into
# the 60 s kept for the store; PRE (tag pre) has no other lane to wait for
sync=$(mktemp -d /tmp/gemmrl-lanes.XXXXXX)
lanes_running=()
barrier() {  # barrier LANE N CAP TAG: the lane's N-th wait
  local g=$1 n=$2 cap=${3:-} tag=${4:-} h waited=0 limit
  [ -n "$tag" ] && { echo "wait (step of $tag): no lanes run beside it, skipped" | tee -a "$out/logs/steps.txt"; return 0; }
  touch "$sync/$g.wait-$n"
  limit=$(( total - SECONDS - 60 ))
  [ -n "$cap" ] && [ "$cap" -lt "$limit" ] && limit=$cap
  echo "== lane $g: wait $n for lanes ${lanes_running[*]} (at most ${limit} s)" | tee -a "$out/logs/steps.txt"
  while :; do
    local pending=()
    for h in "${lanes_running[@]}"; do
      [ "$h" = "$g" ] && continue
      [ -e "$sync/$h.wait-$n" ] || [ -e "$sync/$h.done" ] || pending+=("$h")
    done
    [ "${#pending[@]}" -eq 0 ] && break
    if [ "$waited" -ge "$limit" ]; then
      echo "lane $g: wait $n gave up after $waited s (lanes ${pending[*]} still running)" | tee -a "$out/logs/steps.txt"
      return 0
    fi
    sleep 1; waited=$(( waited + 1 ))
  done
  echo "lane $g: wait $n over after $waited s (at $SECONDS s)" | tee -a "$out/logs/steps.txt"
}
lane_done() { touch "$sync/$1.done"; }
# lane g: its steps in turn on GPU g (STEPS is lane 0, STEPS_1 lane 1, ...); the lanes at once
lane() {
  local g=$1 spec=$2 tag=${3:-} i args argv cap verb extra budget log vis fin own_re nwait=0
  IFS=';' read -ra steps <<< "$spec"
  for i in "${!steps[@]}"; do
    if ! split_words "${steps[$i]}"; then
      echo "step $i: its words do not split (an unbalanced quote?), skipped: ${steps[$i]}" | tee -a "$out/logs/steps.txt"
      continue
    fi
    [ "${#argv[@]}" -gt 0 ] || continue
    cap=""
    if [[ ${argv[0]} =~ ^@([0-9]+)$ ]]; then cap=${BASH_REMATCH[1]}; argv=("${argv[@]:1}"); fi
    if [ "${#argv[@]}" -eq 1 ] && [ "${argv[0]}" = wait ]; then
      nwait=$(( nwait + 1 )); barrier "$g" "$nwait" "$cap" "$tag"
      continue
    fi
    verb=${argv[0]}; extra=(--db "$db"); cmd=(python3 -m gemmrl.cli); label=gemmrl
    if [ -n "$tag" ]; then id=$tag.$i; elif [ "$g" = 0 ]; then id=$i; else id=$g.$i; fi
    case "$verb" in
      tune|bench) extra+=(--out "$out/logs/results-$id");;
      build) extra=();;  # kernels for later steps, into the one cache (build --tuned-in results/gemmrl.sqlite ...)
      pytest) cmd=(python3 -m); extra=(); label="python3 -m";;         # the GPU tests, say
      scripts/*.py) cmd=(python3); extra=(); label=python3; verb=$(basename "$verb" .py);;  # a diagnostic
      scripts/*.sh) cmd=(bash); extra=(); label=bash; verb=$(basename "$verb" .sh);;  # scripts/gpu-tests.sh, say
    esac
    budget=$(( total - SECONDS - 60 ))
    if [ "$budget" -lt 20 ]; then echo "step $id ($verb): no time left, skipped" | tee -a "$out/logs/steps.txt"; continue; fi
    [ -n "$cap" ] && [ "$cap" -lt "$budget" ] && budget=$cap
    # a tune step finishes its final timing inside the step's timeout (2026-11-30f: a cap and no
    # --wall-s cut two tunes' final timing after 2 of 7 shapes): --finish-s, unless it bounds itself
    fin=""
    own_re=' --(wall-s|finish-s|search-only)( |=)'
    if [ "$verb" = tune ] && ! [[ " ${argv[*]} " =~ $own_re ]]; then
      fin=$(( budget > 80 ? budget - 20 : budget * 3 / 4 ))
      extra+=(--finish-s "$fin")
      fin="; --finish-s $fin"
    fi
    log=$out/logs/step-$id-$verb.log
    echo "== step $id: $label ${argv[*]} (timeout ${budget} s$fin)" | tee -a "$out/logs/steps.txt"
    # a step that spreads itself over GPUs (bench --gpus N, N > 1) sees every GPU of the machine, not
    # its lane's; with --gpus 1 it keeps its lane's (two lanes' --gpus 1 steps both ran on GPU 0, runs 551-556)
    vis=${LANE_GPUS[$g]}
    gpus_re=' --gpus ([0-9]+) '
    [[ " ${argv[*]} " =~ $gpus_re ]] && [ "${BASH_REMATCH[1]}" -gt 1 ] && vis=$(IFS=,; echo "${LANE_GPUS[*]}")
    CUDA_VISIBLE_DEVICES=$vis OUT=$out GEMMRL_TEST_OUT=$out/logs timeout -k 30 "$budget" "${cmd[@]}" "${argv[@]}" "${extra[@]}" > "$log" 2>&1
    echo "exit $? after $SECONDS s (step $id)" | tee -a "$out/logs/steps.txt"
    grep -E "^tuned|^the winners|^measured|deadline" "$log" | tail -3
    snapshot
  done
}
ngpu=${STEPS_GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}; [ "$ngpu" -gt 0 ] || ngpu=1
for var in ${!STEPS_*}; do
  [[ $var =~ ^STEPS_([0-9]+)$ ]] && [ "${BASH_REMATCH[1]}" -ge "$ngpu" ] && [ -n "${!var}" ] \
    && echo "warning: $var is set but this machine has $ngpu GPU(s): its steps do not run" | tee -a "$out/logs/steps.txt"
done
LANE_GPUS=($(seq 0 $((ngpu - 1))))
# PRE: steps run in turn before any lane starts (GPU 0 visible), e.g. a build on every core whose
# kernels the lanes' host-timed steps then load, with no compiler beside their timing
[ -n "${PRE:-}" ] && lane 0 "$PRE" pre
snaps > /dev/null 2>&1 & snappid=$!
pids=()
lanes_running=(0)
for g in $(seq 1 $((ngpu - 1))); do
  var=STEPS_$g
  [ -n "${!var:-}" ] && lanes_running+=("$g")
done
for g in "${lanes_running[@]}"; do
  if [ "$g" = 0 ]; then spec=$STEPS; else var=STEPS_$g; spec=${!var}; fi
  { lane "$g" "$spec"; lane_done "$g"; } & pids+=($!)
done
wait "${pids[@]}"
rm -rf "$sync"
if [ -n "$bgpid" ]; then
  while kill -0 "$bgpid" 2>/dev/null && [ "$SECONDS" -lt $(( total - 30 )) ]; do sleep 2; done
  if kill -0 "$bgpid" 2>/dev/null; then
    pkill -TERM -P "$bgpid"
    for _ in $(seq 15); do kill -0 "$bgpid" 2>/dev/null || break; sleep 1; done  # its own clean-up
    kill -TERM "$bgpid" 2>/dev/null
    echo "background: stopped after $SECONDS s" | tee -a "$out/logs/steps.txt"
  else
    wait "$bgpid"; echo "background: exit $? after $SECONDS s" | tee -a "$out/logs/steps.txt"
  fi
fi
if [ -n "${CACHE_BACK:-}" ]; then
  if [ -s "$CACHE_BACK" ]; then
    XZ_OPT=-T0 scripts/pack-build-cache.sh "$GEMMRL_CACHE" "$out/gcache-back.txz" "@$CACHE_BACK" 2>&1 | tee -a "$out/logs/steps.txt"
  else
    echo "CACHE_BACK: $CACHE_BACK lists no builds" | tee -a "$out/logs/steps.txt"
  fi
fi
pkill -TERM -P "$snappid" 2> /dev/null; kill "$snappid" 2> /dev/null; wait "$snappid" 2> /dev/null
# a snapshot under way finishes before the whole delta is written (flock), and none starts after
( command -v flock > /dev/null && flock 9; touch "/tmp/gemmrl-snap-done-$$" ) 9> /tmp/gemmrl-snap.lock
[ -n "${FULL_STORE:-}" ] && since=""
send_store_back "$out" "$db" "$since"
rm -rf "$out"/logs/results-*
tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$out/logs"
