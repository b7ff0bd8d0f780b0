"""Triton kernels, imported as ``minillm.kernels`` (one file per kernel, added by chapter 05).

Each module holds a Triton kernel, its Python wrapper (inputs checked before launch) and a
plain-torch reference:

- teaching kernels (Appendix B): ``vector_add``, ``softmax``, ``rmsnorm``, ``rope``, ``matmul``;
- ``flash_attention``: dense and varlen FlashAttention forward, returning (out, lse);
- ``paged_attention``: split-KV decode and chunked prefill over the paged KV cache
  [num_blocks, block_size, Hkv, D] (the serving engine's layout);
- ``merge_attention``: merge two (out, lse) states (cascade / shared-prefix attention).

Call :func:`minillm.device.setup_triton` before importing a kernel module when there is no GPU.
Nothing is compiled or autotuned at import; autotuning happens on a GPU only, at first call.
"""
