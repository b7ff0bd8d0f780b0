"""Appendix A3's comparison of inference runtimes and servers, as data, with the sources read.

Every cell states what the system's own documentation (the ``sources`` URLs) says it does, or,
for minillm, what this package does; no performance numbers (those we did not measure are not
ours to quote here). :func:`comparison_markdown` renders the table for the notebook.
"""
from __future__ import annotations

COLUMNS = ("what", "scheduling / batching", "KV cache", "kernels / graphs", "quantization",
           "hardware", "API")

SYSTEMS: dict[str, dict] = {
    "TensorRT-LLM": {
        "what": "engine library (build engines / PyTorch runtime), runs behind Triton or its "
                "own server",
        "scheduling / batching": "in-flight (continuous) batching of context and generation "
                                 "phases; engine limits max_batch_size, max_num_tokens",
        "KV cache": "paged KV cache, KV cache reuse",
        "kernels / graphs": "custom fused attention kernels, CUDA graphs",
        "quantization": "FP8, FP4, INT4 AWQ, INT8 SmoothQuant",
        "hardware": "NVIDIA GPUs",
        "API": "Python LLM API; Triton backend",
        "sources": ["https://nvidia.github.io/TensorRT-LLM/features/"
                    "paged-attention-ifb-scheduler.html",
                    "https://www.mintlify.com/NVIDIA/TensorRT-LLM",
                    "https://raw.githubusercontent.com/NVIDIA/TensorRT-LLM/v0.13.0/docs/source/"
                    "performance/perf-best-practices.md"],
    },
    "Triton Inference Server": {
        "what": "server (front end): model repository, per-model schedulers, pluggable "
                "backends",
        "scheduling / batching": "per-model scheduler; dynamic batching of whole requests "
                                 "(LLM token-level batching comes from the backend)",
        "KV cache": "none of its own (the backend's)",
        "kernels / graphs": "the backend's (TensorRT, ONNX Runtime, PyTorch, Python, ...)",
        "quantization": "the backend's",
        "hardware": "NVIDIA GPUs, x86 and ARM CPUs, AWS Inferentia",
        "API": "HTTP/REST and gRPC (KServe protocol), C API; health and metrics endpoints",
        "sources": ["https://docs.nvidia.com/deeplearning/triton-inference-server/archives/"
                    "triton-inference-server-2670/user-guide/docs/user_guide/architecture.html",
                    "https://docs.nvidia.com/deeplearning/sdk/triton-inference-server-guide/docs",
                    "https://github.com/triton-inference-server/server/blob/r22.03/README.md"],
    },
    "vLLM": {
        "what": "engine and server in one (the scheduler and the API server together)",
        "scheduling / batching": "continuous batching, a scheduling decision every step; "
                                 "chunked prefill",
        "KV cache": "PagedAttention (blocks), automatic prefix caching",
        "kernels / graphs": "CUDA/HIP graphs (padded to captured sizes), FlashAttention and "
                            "FlashInfer",
        "quantization": "GPTQ, AWQ, INT4, INT8, FP8",
        "hardware": "NVIDIA and AMD GPUs, x86 / ARM / PowerPC CPUs, TPU, Gaudi, Trainium",
        "API": "OpenAI-compatible HTTP server; offline LLM class",
        "sources": ["https://docs.vllm.ai/en/v0.6.4/index.html",
                    "https://docs.vllm.ai/en/v0.7.3/_sources/index.md",
                    "https://docs.vllm.ai/en/v0.21.0/api/vllm/v1/worker/gpu/cudagraph_utils/"],
    },
    "SGLang": {
        "what": "engine and server in one (runtime SRT with HTTP server, scheduler, "
                "tokenizer and detokenizer processes) plus a front-end language",
        "scheduling / batching": "continuous batching, a low-overhead CPU scheduler",
        "KV cache": "RadixAttention (radix-tree prefix cache)",
        "kernels / graphs": "CUDA graphs for decode (--cuda-graph-max-bs, --cuda-graph-bs), "
                            "optional torch.compile, selectable attention backends",
        "quantization": "FP8 weights (--quantization fp8) and FP8 KV cache (--kv-cache-dtype); "
                        "GGUF and bitsandbytes loading",
        "hardware": "NVIDIA and AMD GPUs (see its docs for others)",
        "API": "OpenAI-compatible HTTP server; Python engine; structured generation",
        "sources": ["https://mintlify.com/sgl-project/sglang",
                    "https://www.mintlify.com/sgl-project/sglang/developer/"
                    "architecture-overview",
                    "https://build.nvidia.com/playbooks/sglang.md",
                    "https://docs.sglang.io/advanced_features/server_arguments.html",
                    "https://www.mintlify.com/sgl-project/sglang/api/server-args"],
    },
    "llama.cpp": {
        "what": "engine (C/C++, GGUF files) with its own HTTP server (llama-server)",
        "scheduling / batching": "parallel decoding slots with continuous batching "
                                 "(llama-server); one request at a time in our benchmark's "
                                 "llama-cpp-python server",
        "KV cache": "a context of --ctx-size tokens shared by the parallel slots",
        "kernels / graphs": "hand-written CPU SIMD and GPU kernels (ggml)",
        "quantization": "F16 and quantized GGUF models (our benchmark: Q4_1)",
        "hardware": "CPUs and GPUs",
        "API": "OpenAI-compatible chat completions, embeddings; monitoring endpoints",
        "sources": ["https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md"],
    },
    "minillm": {
        "what": "engine and server in one process (this package)",
        "scheduling / batching": "continuous batching, chunked prefill, FCFS or priority "
                                 "(chapter 04)",
        "KV cache": "paged blocks, hash and radix prefix caches, CPU/disk tiers (chapters 04, "
                    "08)",
        "kernels / graphs": "SDPA, Triton kernels (chapter 05); torch.compile and CUDA graphs "
                            "for a static decode step (this chapter)",
        "quantization": "int8/int4 group-wise, GPTQ, AWQ, HQQ, GGUF (appendix A)",
        "hardware": "CPU and CUDA GPUs",
        "API": "OpenAI-compatible HTTP server with SSE and Prometheus metrics; minillm.LLM",
        "sources": [],
    },
}


def comparison_markdown(systems: dict[str, dict] = SYSTEMS) -> str:
    """The table as markdown: one row per system, the :data:`COLUMNS`."""
    head = "| system | " + " | ".join(COLUMNS) + " |"
    rule = "|---" * (len(COLUMNS) + 1) + "|"
    rows = [f"| **{name}** | " + " | ".join(s[c] for c in COLUMNS) + " |"
            for name, s in systems.items()]
    return "\n".join([head, rule, *rows])


def sources_markdown(systems: dict[str, dict] = SYSTEMS) -> str:
    """The documentation each row was taken from, as a markdown list."""
    return "\n".join(f"- {name}: " + ", ".join(f"<{u}>" for u in s["sources"])
                     for name, s in systems.items() if s["sources"])


__all__ = ["COLUMNS", "SYSTEMS", "comparison_markdown", "sources_markdown"]
