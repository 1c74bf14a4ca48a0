#!/usr/bin/env bash
# GPU check for the kernel layer: run on a CUDA machine from the repo root.
#   1. the CUDA-marked tests (compiled kernels, same cases as the CPU/interpreter tests)
#   2. gather-kernel GB/s vs torch's device-to-device copy (>= 1 GiB, seed pattern; goal ratio >= 0.85)
#   3. the cross-process refit on one GPU (trainer arenas exported through cuda-python, inference
#      ranks pulling with the compiled kernel) vs the device-to-device copy measured in the same run
#      (goal ratio >= 0.80), one JSON line per layout
# Fails loudly (exit 1) where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check.sh: FAIL: no CUDA device visible to torch (torch.cuda.is_available() is False)" >&2
    exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export TRITON_INTERPRET=0

echo "== CUDA tests"
python -m pytest -m cuda tests/ -q -p no:cacheprovider

echo "== bandwidth (JSON lines)"
python bench/gpu_kernels.py --device cuda --size "${SIZE:-1GiB}" ${CHECK:+--check}

echo "== cross-process refit on one GPU (JSON lines; memcpy = device-to-device copy of the same bytes)"
for layout in fsdp-tp cols-replicas; do
    timeout 300 tritonreshard bench --device cuda --size "${REFIT_SIZE:-1GiB}" --layout "$layout" \
        --methods memcpy,tritonreshard --repeats 10 --json | tail -n 1
done
