#!/usr/bin/env bash
# Pack a build cache made with `gemmrl build` (no GPU needed) for the GPU machine:
#   GEMMRL_CACHE=.ext/carry/gcache gemmrl build --shapes subset --top 2   # about 50 s per CUTLASS kernel per core
#   scripts/pack-build-cache.sh .ext/carry/gcache .ext/carry/gcache.tgz   # or .txz (xz)
# Then carry the .tgz; `scripts/device-session.sh OUT tune` unpacks it into $GEMMRL_CACHE there.
# Builds must use the same nvcc and CUTLASS version on both machines, or they are not found there
# (where the headers are installed does not matter: the key names them by version).
# A third argument, an extended regular expression, keeps only the builds whose directory name
# matches it (e.g. '_f16_f16-' for the fp16-accumulator kernels): a smaller carry; or @FILE, a list
# of cache directories (`gemmrl build ... --entries FILE`), keeps exactly those that were built.
set -euo pipefail
cache=${1:?cache dir}; out=${2:?output .tgz}; match=${3:-}
n=$(find "$cache/builds" -mindepth 1 -maxdepth 1 -type d ! -name '.*' ! -name '*.failed' | wc -l)
case "$out" in
  *.txz) comp=J ;;  # xz: 146 CUTLASS kernels in 5.4 MB, against about 50 MB with gzip (the carry is limited to 64 MiB)
  *) comp=z ;;
esac
if [ "${match:0:1}" = @ ]; then
  mapfile -t dirs < <(sort -u "${match:1}" | while read -r d; do [ -d "$cache/$d" ] && echo "$d"; done)
  [ "${#dirs[@]}" -gt 0 ] || { echo "none of the builds listed in ${match:1} is in $cache" >&2; exit 1; }
  echo "$(( $(sort -u "${match:1}" | wc -l) - ${#dirs[@]} )) listed builds not in $cache" >&2
  n=${#dirs[@]}
  tar c${comp}f "$out" -C "$cache" "${dirs[@]}"
elif [ -n "$match" ]; then
  mapfile -t dirs < <(cd "$cache" && find builds -mindepth 1 -maxdepth 1 -type d ! -name '.*' ! -name '*.failed' | grep -E "$match" || true)
  [ "${#dirs[@]}" -gt 0 ] || { echo "no build matches $match" >&2; exit 1; }
  n=${#dirs[@]}
  tar c${comp}f "$out" -C "$cache" "${dirs[@]}"
else
  tar c${comp}f "$out" -C "$cache" --exclude='builds/.*' --exclude='*.failed' builds
fi
echo "$n builds in $out ($(du -h "$out" | cut -f1))"
