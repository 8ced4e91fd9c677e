#!/usr/bin/env bash
# The GPU half of the test suite, as run on the lent GPU machine:
#   scripts/gpu-tests.sh [LOG_DIR]
# Needs torch with CUDA and nvcc. If a CUDA-L2 kernel directory is given in GEMMRL_CUDA_L2_DIR
# (their kernels/h100_F32F16F16F32), one of its kernels is built and measured too (needs the
# nvidia-cutlass wheel installed, or GEMMRL_CUTLASS_DIR).
set -uo pipefail
cd "$(dirname "$0")/.."
log_dir=${1:-/tmp}
mkdir -p "$log_dir"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$log_dir/gpu.txt"
python3 -m pytest -m gpu -v -s -p no:cacheprovider tests 2>&1 | tee "$log_dir/gpu-tests.log"
exit "${PIPESTATUS[0]}"
