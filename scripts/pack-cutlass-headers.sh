#!/usr/bin/env bash
# The CUTLASS/CuTe headers gemmrl compiles against, packed small for the device tool's carry:
#   scripts/pack-cutlass-headers.sh [OUT.txz]     # default .ext/carry/cutlass-headers-<version>.txz
# The nvidia-cutlass wheel is 6.4 MB (zip, with the Python DSL, examples and tools); its include/
# and tools/util/include/ alone, tarred with xz, are about 1.1 MB: 5 MB more of the 64 MiB a call
# carries for build caches. scripts/device-common.sh's install_cutlass unpacks it on the device
# machine and points GEMMRL_CUTLASS_DIR at it; build keys name the headers by version and place
# in the CUTLASS tree, so caches built here against the wheel are found there.
# The headers are found as gemmrl finds them (GEMMRL_CUTLASS_DIR, else the installed wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
read -r inc util version < <(python3 -c "
from gemmrl.build.cutlass import cutlass_include_dirs, cutlass_version
inc, util = cutlass_include_dirs()
print(inc, util, cutlass_version(inc))") \
  || { echo "no CUTLASS headers found (the error above): pip install nvidia-cutlass, or set GEMMRL_CUTLASS_DIR" >&2; exit 1; }
out=${1:-.ext/carry/cutlass-headers-$version.txz}
root=$(dirname "$inc")
[ "$util" = "$root/tools/util/include" ] || { echo "unexpected CUTLASS layout: $inc, $util" >&2; exit 1; }
stage=$(mktemp -d); trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/cutlass-$version/tools/util"
cp -r "$inc" "$stage/cutlass-$version/include"
cp -r "$util" "$stage/cutlass-$version/tools/util/include"
mkdir -p "$(dirname "$out")"
tar -C "$stage" -cf - "cutlass-$version" | xz -9 -T0 > "$out.part"
mv "$out.part" "$out"
echo "CUTLASS $version headers: $(find "$stage" -type f | wc -l) files, $(du -k "$out" | cut -f1) KB in $out"
