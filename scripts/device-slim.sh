#!/usr/bin/env bash
# Keep what a device call sends under the device tool's 64 MiB (tracked files, untracked ones git does
# not ignore, and the carried paths). The checkout passed it on 2026-11-30i: 58.9 MiB tracked, with a
# 4 MiB carry, and the call was refused. The device steps read the store, the packs and the reports of
# the GPU they run on; they do not read the other GPU's packs and reports, the logs or the
# sample-efficiency studies. This takes those out of the working tree for the device calls and puts
# them back after, from git:
#   scripts/device-slim.sh hide h200    # before the calls: h200's calls need no results/h100, packs/h100-*
#   scripts/device-slim.sh restore      # after the last call (git checkout of what hide took out)
#   scripts/device-slim.sh size         # the MiB that would travel now, without carry
# hide refuses if one of those paths has a change git does not hold (it would be lost), and it says
# what it took out and what is left. Nothing it takes out must be committed as deleted: add paths by
# name, and restore before `git status` is trusted again. The list of what hide took out is kept in
# .git/device-slim-hidden, so that restore puts back exactly that, also in a later shell.
set -euo pipefail
cd "$(dirname "$0")/.."
state=.git/device-slim-hidden
gpus=(h100 h200)

size() {  # MiB of tracked files present plus untracked files git does not ignore
  { git ls-files -z; git ls-files -z -o --exclude-standard; } | while IFS= read -r -d '' f; do
    [ -f "$f" ] && printf '%s\0' "$f"; done | xargs -0 -r stat -c %s | awk '{s += $1} END {printf "%.1f\n", s / 1048576}'
}

case "${1:-}" in
  hide)
    gpu=${2:?"usage: $0 hide GPU (one of: ${gpus[*]}), the GPU the device calls run on"}
    gpu=${gpu,,}
    [[ " ${gpus[*]} " == *" $gpu "* ]] || { echo "unknown GPU '$2': one of ${gpus[*]}" >&2; exit 2; }
    [ -s "$state" ] && { echo "already hidden ($state): run '$0 restore' first" >&2; exit 2; }
    paths=(results/logs)
    for g in "${gpus[@]}"; do
      [ "$g" = "$gpu" ] && continue
      paths+=("results/$g")
      for p in packs/"$g"-*; do [ -e "$p" ] && paths+=("$p"); done
    done
    for p in results/"$gpu"/sample-efficiency*; do [ -e "$p" ] && paths+=("$p"); done
    present=()
    for p in "${paths[@]}"; do [ -e "$p" ] && present+=("$p"); done
    [ ${#present[@]} -gt 0 ] || { echo "nothing to hide"; exit 0; }
    dirty=$(git status --porcelain --untracked-files=all -- "${present[@]}")
    if [ -n "$dirty" ]; then
      echo "refusing: these paths have changes git does not hold, which hiding would lose:" >&2
      echo "$dirty" >&2
      exit 1
    fi
    before=$(size)
    printf '%s\n' "${present[@]}" > "$state"
    rm -rf -- "${present[@]}"
    echo "hid ${present[*]} (restore: $0 restore); ${before} -> $(size) MiB would travel, carry not counted"
    ;;
  restore)
    [ -s "$state" ] || { echo "nothing hidden ($state is absent)"; exit 0; }
    mapfile -t hidden < "$state"
    git checkout -- "${hidden[@]}"
    rm -f "$state"
    echo "restored ${hidden[*]}; $(size) MiB would travel, carry not counted"
    ;;
  size)
    echo "$(size) MiB would travel, carry not counted"
    ;;
  *)
    echo "usage: $0 hide GPU | restore | size" >&2
    exit 2
    ;;
esac
