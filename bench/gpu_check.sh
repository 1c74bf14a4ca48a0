#!/usr/bin/env bash
# GPU check, for a fresh offline CUDA machine (python3, torch, Triton and cuda-bindings preinstalled;
# nothing is downloaded). Run from anywhere: bash bench/gpu_check.sh [OUT.json]
#   0. preconditions, loudly: python3, torch with a visible GPU, Triton, cuda.bindings, then
#      `pip install --no-deps --no-build-isolation -e .` (exit 1 if any is missing: no figures possible)
#   1. figures first, each part under its own time limit, merged into one JSON as they come:
#      kernel GB/s vs torch's D2D copy at >= 1 GiB (wide rows, narrow rows, bf16->fp32 cast), the
#      delta codec's change detection (Triton vs torch, ms per GB), then
#      the cross-process refit of >= 8 GiB on one GPU vs D2D with the slowest pull's time
#   2. the CUDA-marked tests (compiled kernels, CUDA transport), after the figures
#   3. `vllm serve` refitted under a completion load (bench/vllm_serve_bench.py: stall per refit with and
#      without the background pull, latency p50/p99, vLLM's reload_weights), only if `import vllm` works
#      (vLLM's CUDA build is often not installed: then a line says the step was skipped)
# A failing step is reported and the script goes on; the exit status says whether everything passed.
# Worst case about 13.5 minutes (limits: 180 + 90 + 210 + 150 + 300 s, plus install).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_JSON="${1:-gpu_check.json}"
status=0

fail() { echo "gpu_check.sh: FAIL: $*" >&2; exit 1; }
step() { echo "== $*"; }

step "preconditions"
command -v python3 >/dev/null || fail "python3 not found"
python3 - <<'EOF' || fail "torch / Triton / cuda.bindings missing, or no CUDA device visible to torch"
import sys
import torch, triton
from cuda.bindings import driver  # noqa: F401  (what tritonreshard's CUDA transport imports)
if not torch.cuda.is_available():
    sys.exit("torch.cuda.is_available() is False")
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name(0)}, "
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -m pip install --quiet --no-deps --no-build-isolation -e . \
    || fail "pip install --no-deps --no-build-isolation -e . failed"
python3 -c "import tritonreshard" || fail "tritonreshard does not import after install"
rm -f "$OUT_JSON"
python3 -c "import json, datetime, torch; json.dump({'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'), 'gpu': torch.cuda.get_device_name(0)}, open('$OUT_JSON', 'w'))"

step "kernel bandwidth vs torch D2D (>= 1 GiB per case)"
timeout -k 10 180 python3 bench/gpu_kernels.py --part kernels --size "${SIZE:-1GiB}" --json "$OUT_JSON" \
    || { echo "gpu_check.sh: kernel figures: exit $?" >&2; status=1; }

step "delta codec: Triton compare-and-compact vs torch (ms per GB, >= 1 GiB bf16)"
timeout -k 10 90 python3 bench/gpu_kernels.py --part delta --size "${SIZE:-1GiB}" --json "$OUT_JSON" \
    || { echo "gpu_check.sh: delta figures: exit $?" >&2; status=1; }

step "cross-process refit on one GPU (>= 8 GiB) vs torch D2D"
timeout -k 10 210 python3 bench/gpu_kernels.py --part refit --refit-size "${REFIT_SIZE:-8GiB}" \
    --deadline 180 --json "$OUT_JSON" \
    || { echo "gpu_check.sh: refit figures: exit $?" >&2; status=1; }

step "figures ($OUT_JSON)"
cat "$OUT_JSON" || status=1

step "CUDA tests"
timeout -k 10 150 python3 -m pytest -m cuda tests/ -q -p no:cacheprovider -x \
    || { echo "gpu_check.sh: CUDA tests: exit $?" >&2; status=1; }

step "vllm serve under load, refitted (bench/vllm_serve_bench.py, TP=1)"
if python3 -c "import vllm" 2>/dev/null; then
    timeout -k 10 300 python3 bench/vllm_serve_bench.py --model small-qwen3-moe --tp 1 --refits 4 --window 10 \
        --cuda-graphs --json | tee vllm_serve_bench.log \
        || { echo "gpu_check.sh: vllm serve bench: exit $?" >&2; status=1; }
else
    echo "gpu_check.sh: SKIPPED the vllm serve bench: 'import vllm' fails (vLLM's CUDA build not installed)"
fi

echo "gpu_check.sh: $([ $status -eq 0 ] && echo ok || echo 'FAILED (see above)'); figures in $OUT_JSON"
exit $status
