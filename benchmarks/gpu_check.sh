#!/usr/bin/env bash
# Every GPU check and benchmark of the project, in one run of under 8 minutes on an H200.
# Writes JSON (device, date, git commit) into benchmarks/results/ (and $OUT when set, for the
# device tool). Needs torch, triton and transformers. The package is installed from this
# checkout first (editable, no dependencies); should that fail, it still imports from the
# checkout (PYTHONPATH), where minillm.kernels is the checkout's kernels/ folder.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . \
    || echo "gpu_check: pip install failed; running from the checkout"
python3 -c "import minillm.kernels, minillm.engine" || exit 1
res=benchmarks/results
mkdir -p "$res"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
status=0
# 1. the model at real shapes: parity with HF transformers, prefill/decode against HF (bf16)
timeout 200 python3 benchmarks/gpu_check.py --out "$res/gpu_model_check.json" || status=1
# 2. chapter 05 kernels: correctness compiled, FlashAttention vs SDPA, paged decode bandwidth
timeout 240 python3 benchmarks/kernels_bench.py --out "$res/kernels_gpu.json" || status=1
# 3. appendix A2: copy bandwidth by size, matmul rates per dtype, divergence, occupancy
timeout 150 python3 benchmarks/a2_gpu_check.py --out "$res/a2_gpu.json" || status=1
# 4. the engine: every path (chunked prefill, swap, n > 1, beams) with the Triton and sdpa
#    backends == each request alone, at SmolLM2 and Llama-3.2-1B shapes; throughput vs HF
timeout 200 python3 benchmarks/gpu_engine_check.py --out "$res/engine_gpu.json" || status=1
# 5. speculative decoding: every method (part I and the block drafters) == the plain engine
#    (Triton backend), forward cost vs tokens, n-gram speedup at batch 1, speedup vs batch size
#    1..64 at SmolLM2 and Llama-3.2-1B shapes (random weights: acceptance needs the real
#    model; the sweep starts no run after 120 s)
timeout 150 python3 benchmarks/gpu_spec_check.py --out "$res/spec_gpu.json" --budget-s 120 \
    || status=1
# 6. chapter 08: the tiered KV store's CUDA paths (pinned staging, side-stream layer-by-layer
#    loads, disk tier, restart) == a cold engine; CacheBlend ratio 1 == full prefill, timings
timeout 120 python3 benchmarks/gpu_offload_check.py --out "$res/offload_gpu.json" || status=1
# 7. appendix C: CUDA graphs and torch.compile of the decode step == the generate loop,
#    batch-1 decode eager / compiled / captured, decode step by batch size, profile
timeout 200 python3 benchmarks/gpu_runtime_check.py --out "$res/runtime_gpu.json" || status=1
if [ -n "${OUT:-}" ]; then cp "$res"/*.json "$OUT"/ 2>/dev/null || true; fi
exit $status
