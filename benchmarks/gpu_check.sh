#!/usr/bin/env bash
# Every GPU check and benchmark of the project. Writes JSON (device, date, git commit) into
# benchmarks/results/ (and $OUT when set, for the device tool, copied as each check ends so that
# a run cut short keeps what finished). Needs torch, triton and transformers. The package is
# installed from this checkout first (editable, no dependencies); should that fail, it still
# imports from the checkout (PYTHONPATH), where minillm.kernels is the checkout's kernels/ folder.
#
#     bash benchmarks/gpu_check.sh                  # every check, in the order below
#     bash benchmarks/gpu_check.sh runtime engine   # only these, in this order
# Names: model kernels a2 engine spec offload runtime.
#
# Time on an H200: runtime 200 s (cut at its limit in the profile, before its compiled
# correctness run was cut to one size), offload 70 s, engine 143 s, spec 132 s (2026-12-04,
# 564 s for the four); model, kernels and a2 together about 6 minutes (2026-11-30). All seven
# do not fit one device call of 10 minutes: run them as two, e.g. `runtime offload engine spec`
# and `model kernels a2`.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . \
    || echo "gpu_check: pip install failed; running from the checkout"
python3 -c "import minillm.kernels, minillm.engine" || exit 1
res=benchmarks/results
mkdir -p "$res"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true

check() {  # check NAME SECONDS SCRIPT JSON [ARGS...]: run one check under a time limit
    local name=$1 limit=$2 script=$3 json=$4
    shift 4
    echo "=== gpu_check: $name (at most ${limit} s)"
    local start=$SECONDS
    timeout "$limit" python3 "benchmarks/$script" --out "$res/$json" "$@" || status=1
    echo "=== gpu_check: $name took $((SECONDS - start)) s"
    if [ -n "${OUT:-}" ] && [ -f "$res/$json" ]; then cp "$res/$json" "$OUT"/; fi
}

run_named() {
    case $1 in
    # the model at real shapes: parity with HF transformers, prefill/decode against HF (bf16)
    model) check model 200 gpu_check.py gpu_model_check.json ;;
    # chapter 05 kernels: correctness compiled, FlashAttention vs SDPA, paged decode bandwidth
    kernels) check kernels 240 kernels_bench.py kernels_gpu.json ;;
    # appendix A2: copy bandwidth by size, matmul rates per dtype, divergence, occupancy
    a2) check a2 150 a2_gpu_check.py a2_gpu.json ;;
    # the engine: every path (chunked prefill, swap, n > 1, beams) with the Triton and sdpa
    # backends == each request alone, at SmolLM2 and Llama-3.2-1B shapes; throughput vs HF;
    # CUDA graphs of decode steps (cuda_graphs=True) == eager greedy tokens, and the batch-32
    # decode step's wall time and GPU idle time, eager vs replayed
    engine) check engine 200 gpu_engine_check.py engine_gpu.json ;;
    # speculative decoding: every method (part I and the block drafters) == the plain engine
    # (Triton backend), forward cost vs tokens, n-gram speedup at batch 1, speedup vs batch
    # size 1..64 at SmolLM2 and Llama-3.2-1B shapes (random weights: acceptance needs the real
    # model; the sweep starts no run after 120 s)
    spec) check spec 150 gpu_spec_check.py spec_gpu.json --budget-s 120 ;;
    # chapter 08: the tiered KV store's CUDA paths (pinned staging, side-stream layer-by-layer
    # loads, disk tier, restart) == a cold engine; CacheBlend ratio 1 == full prefill, timings
    offload) check offload 120 gpu_offload_check.py offload_gpu.json ;;
    # appendix C: CUDA graphs and torch.compile of the decode step == the generate loop,
    # batch-1 decode eager / compiled / captured, decode step by batch size, profile
    runtime) check runtime 240 gpu_runtime_check.py runtime_gpu.json ;;
    *) echo "gpu_check: unknown check '$1' (model kernels a2 engine spec offload runtime)"
       status=1 ;;
    esac
}

status=0
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(model kernels a2 engine spec offload runtime)
for name in "${names[@]}"; do run_named "$name"; done
exit $status
