#!/usr/bin/env bash
# Tuning on one GPU, then on every GPU of the machine through Ray, same shapes, fresh stores:
#   scripts/device-ray.sh OUT SHAPES [CANDIDATES]
# Carry .ext/carry (the nvidia-cutlass wheel) and .ext/raycarry (a Ray wheel and the packages
# the GPU image lacks, unpacked into /tmp/site). Raw kernels only: they compile in seconds, so
# the wall time is the search's, not CUTLASS's compile time. Prints the two search wall times.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1; shapes=$2; cands=${3:-8}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 GEMMRL_CACHE=/tmp/gemmrl-cache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .ext/carry/nvidia_cutlass-*.whl
for w in .ext/raycarry/*; do python3 -m zipfile -e "$w" /tmp/site; done
chmod -R u+x /tmp/site/ray/core  # zipfile drops the executable bits of raylet and gcs_server
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import ray, torch; print('ray', ray.__version__, 'gpus', torch.cuda.device_count())"
common=(--shapes "$shapes" --candidates "$cands" --batch 8 --family raw --no-report)
[ -z "${SKIP_ONE:-}" ] && CUDA_VISIBLE_DEVICES=0 python3 -m gemmrl.cli tune --db "$out/one-gpu.sqlite" --out "$out/one" "${common[@]}" 2>&1 | tee "$out/tune-one-gpu.log"
python3 -m gemmrl.cli tune --db "$out/ray.sqlite" --out "$out/ray" --ray local "${common[@]}" 2>&1 | tee "$out/tune-ray.log"
grep -h "wall time" "$out"/tune-*.log
