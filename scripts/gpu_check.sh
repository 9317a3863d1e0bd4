#!/usr/bin/env bash
# GPU check: megazero on one CUDA device, in under 8 minutes on an H200, with no network.
#
#   bash scripts/gpu_check.sh [bench_gpu.py arguments...]
#
# 1. prints the device (nvidia-smi) and the torch / CUDA / NCCL versions;
# 2. runs the GPU tests: python -m pytest -q -m gpu tests/gpu/test_gpu.py ... (bf16 training at ZeRO
#    stages 0-3 through NCCL, fp32 parity with CPU, 16-bit save, export, generation, the CUDA
#    flash block kernel of ring attention, with and without dropout);
# 3. benchmarks GPT-2 124M and 355M, the Llama-style 1B and the Mixtral-style MoE (0.93B, grouped GEMM)
#    in bf16 without recomputation: python scripts/bench_gpu.py
#    (tokens/s, TFLOP/s, MFU), beside the Hugging Face GPT-2 of each shape trained the plain way
#    (eager and torch.compile) and megazero's ratio to each; `--profile` adds the kernel-time
#    breakdown by kind and the host syncs per step;
# 4. Muon's step overhead: GPT-2 355M eager with optim.name muon against AdamW in the same run.
#
# Nothing is installed from the internet: torch with CUDA and the repository's dependencies
# must already be there; megazero itself is used from this checkout (PYTHONPATH), or
# installed with `pip install -e . --no-deps` if it cannot be imported that way. Every part
# runs under `timeout`; without a usable CUDA device the script stops after the versions,
# otherwise a failed part does not stop the later ones. The exit status is non-zero when
# any part failed. Arguments are passed on to bench_gpu.py (after this script's defaults, so
# they win). The interpreter is $PYTHON, else `python`, else `python3` (images that ship only it).
set -euo pipefail

cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
failed=()

# part NAME SECONDS COMMAND...: run COMMAND under a time limit and record a failure by name.
part() {
    local name=$1 limit=$2 rc=0
    shift 2
    printf '\n=== %s (limit %ss) ===\n' "$name" "$limit"
    local start=$SECONDS
    timeout --kill-after=15 "$limit" "$@" || rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "--- $name: TIMED OUT after ${limit}s"
        failed+=("$name (timeout)")
    elif [ "$rc" -ne 0 ]; then
        echo "--- $name: FAILED (exit $rc)"
        failed+=("$name (exit $rc)")
    else
        echo "--- $name: ok in $((SECONDS - start))s"
    fi
    return "$rc"
}

versions() {
    "$PYTHON" - <<'EOF'
import torch
print(f"torch {torch.__version__} | CUDA {torch.version.cuda} | cuDNN {torch.backends.cudnn.version()} | "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else 'n/a'}")
if not torch.cuda.is_available():
    raise SystemExit("gpu_check: torch sees no CUDA device (torch.cuda.is_available() is False); "
                     "install a CUDA build of torch or check the driver (nvidia-smi)")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} | {p.total_memory / 2**30:.0f} GiB | sm {p.major}.{p.minor} | {p.multi_processor_count} SMs")
EOF
}

ensure_megazero() {
    if "$PYTHON" -c "import megazero.train.trainer" 2>/dev/null; then
        return 0
    fi
    echo "megazero is not importable from $PWD; installing it without dependencies (no network needed)"
    "$PYTHON" -m pip install --no-deps --no-build-isolation -e .
    "$PYTHON" -c "import megazero.train.trainer"
}

export PYTHON
export -f versions ensure_megazero  # `timeout` runs programs: the functions go through bash -c

# Worst case 10 + 20 + 30 + 130 + 330 + 60 s = 9.7 min (run it with a 600 s limit). The benchmark with both peers and --profile
# measured about 4 minutes on an H200 for the GPT-2 rows alone (the Llama and MoE rows are not measured yet) (torch.compile of each Hugging Face model ~45 s; of
# megazero's blocks, which share one graph, ~15 s); without --profile it is shorter. Its
# `run s` column shows where the time goes.
part "device" 10 nvidia-smi || true  # informational: "versions" decides whether there is a usable GPU
part "versions" 20 bash -c versions || { echo "gpu_check: no usable CUDA device; stopping"; exit 1; }
part "import" 30 bash -c ensure_megazero || true
part "gpu tests" 130 "$PYTHON" -m pytest -q -rs -p no:cacheprovider -m gpu tests/gpu/test_gpu.py tests/parallel/test_cross_entropy.py \
    tests/parallel/test_context_parallel.py \
    || true
# No recomputation for the MFU figure: both models fit an H200 without it (pass --train.recompute
# selective to measure it). Fewer iterations than bench_gpu.py's defaults, so that both models,
# eager and compiled, and their two peers fit the limit (later arguments win: --peers none,
# --megazero eager, --iters 30, ...).
part "benchmark" 330 "$PYTHON" scripts/bench_gpu.py --train.recompute none --iters 12 --warmup 4 --peer-iters 10 \
    "$@" || true

# Muon against AdamW on 355M (eager, no peers): the two "megazero" rows' tokens/s give the overhead.
muon_overhead() {
    for optim in adamw muon; do
        echo "--- optim.name $optim"
        "$PYTHON" scripts/bench_gpu.py --models gpt2-355m --megazero eager --peers none --iters 8 --warmup 3 \
            --train.recompute none --optim.name "$optim" || return 1
    done
}
export -f muon_overhead
part "muon overhead" 60 bash -c muon_overhead || true

echo
if [ "${#failed[@]}" -gt 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check: all parts passed in ${SECONDS}s"
