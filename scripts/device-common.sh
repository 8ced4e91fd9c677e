# Sourced by scripts/device-rebuild.sh, device-steps.sh, device-bench.sh and device-session.sh (the
# repository root is the working directory): the set-up and the hand-back every device call of theirs shares.

# the carried CUTLASS headers: a headers-only tarball (.ext/carry/cutlass-headers-*.txz, from
# scripts/pack-cutlass-headers.sh: 1.1 MB where the wheel is 6.4) unpacked into /tmp/cutlass-headers
# and named by GEMMRL_CUTLASS_DIR; else the nvidia-cutlass wheel, installed once into /tmp/site.
# A GEMMRL_CUTLASS_DIR set by the caller that holds no headers (a warm machine's /tmp/cutlass-headers
# named in a call that found the machine fresh: 2026-12-01, three calls built no CUTLASS kernel) is
# said and dropped; the headers in use, or their absence, are printed where the call's output shows.
install_cutlass() {
  local t
  if [ -n "${GEMMRL_CUTLASS_DIR:-}" ] && [ ! -f "$GEMMRL_CUTLASS_DIR/include/cutlass/cutlass.h" ]; then
    echo "install_cutlass: GEMMRL_CUTLASS_DIR=$GEMMRL_CUTLASS_DIR holds no CUTLASS headers (a fresh machine?);" \
         "looking for carried ones" >&2
    unset GEMMRL_CUTLASS_DIR
  fi
  for t in .ext/carry/cutlass-headers-*.txz; do
    [ -f "$t" ] || continue
    [ -n "${GEMMRL_CUTLASS_DIR:-}" ] && break
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1], 'r:*').extractall(sys.argv[2])" "$t" /tmp/cutlass-headers
    t=$(basename "$t" .txz)
    export GEMMRL_CUTLASS_DIR=/tmp/cutlass-headers/cutlass-${t#cutlass-headers-}
    break
  done
  if [ -z "${GEMMRL_CUTLASS_DIR:-}" ] && ls .ext/carry/nvidia_cutlass-*.whl >/dev/null 2>&1 \
      && [ ! -d /tmp/site/cutlass_library ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .ext/carry/nvidia_cutlass-*.whl
  fi
  PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site python3 -c "
from gemmrl.build.cutlass import cutlass_include_dirs
print('CUTLASS headers:', cutlass_include_dirs()[0])" >&2 2>/dev/null \
    || echo "install_cutlass: NO CUTLASS HEADERS on this machine: carry .ext/carry/cutlass-headers-*.txz" \
            "(scripts/pack-cutlass-headers.sh); tune refuses CUTLASS families, bench stops at a CUTLASS kernel" >&2
  return 0
}

# every carried build cache (.ext/carry/gcache*.txz) unpacked into DIR
unpack_caches() {
  local dir=$1 g
  mkdir -p "$dir"
  for g in .ext/carry/gcache*.txz; do
    [ -f "$g" ] && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1], 'r:*').extractall(sys.argv[2])" "$g" "$dir"
  done
}

# the store DB, compressed, as OUT/gemmrl.sqlite.xz; never the .xz the call started from (if the
# compression fails, say so and send nothing: a stale store read as the call's result loses work).
# With a third argument N (the last run id before the call): only the runs after N, as
# OUT/gemmrl-delta.sqlite.xz (`gemmrl store --merge` it here): a few MB and seconds, where the
# whole store takes a minute or more to compress.
send_store_back() {
  local out=$1 db=$2 since=${3:-} delta=/tmp/gemmrl-delta.sqlite
  if [ -n "$since" ]; then
    rm -f "$delta" "$delta.xz"
    if python3 -m gemmrl.cli store --db "$delta" --merge "$db" --since-run "$since" --compress \
        > "$out/logs/store-after.txt" 2>&1; then
      tail -2 "$out/logs/store-after.txt"; mv "$delta.xz" "$out/gemmrl-delta.sqlite.xz"; return
    fi
    echo "ERROR: the runs after $since could not be sent back (logs/store-after.txt); trying the whole store" >&2
  fi
  rm -f "$db.xz"
  if python3 -m gemmrl.cli store --db "$db" --compress > "$out/logs/store-after.txt" 2>&1; then
    tail -2 "$out/logs/store-after.txt"; mv "$db.xz" "$out/gemmrl.sqlite.xz"
  else
    echo "ERROR: the store could not be compressed (logs/store-after.txt); nothing of it comes back" >&2
    tail -3 "$out/logs/store-after.txt" >&2
  fi
}
