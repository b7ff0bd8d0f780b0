"""Triton kernels, imported as ``minillm.kernels`` (one file per kernel, added by chapter 05).

Each module holds a Triton kernel, its Python wrapper (inputs checked before launch) and a
plain-torch reference:

- teaching kernels (Appendix A2): ``vector_add``, ``softmax``, ``rmsnorm``, ``rope``, ``matmul``;
- ``flash_attention``: dense and varlen FlashAttention forward, returning (out, lse);
- ``paged_attention``: split-KV decode and chunked prefill over the paged KV cache
  [num_blocks, block_size, Hkv, D] (the serving engine's layout);
- ``merge_attention``: merge two (out, lse) states (cascade / shared-prefix attention).

Call :func:`minillm.device.setup_triton` before importing a kernel module when there is no GPU.
Nothing is compiled or autotuned at import; autotuning happens on a GPU only, at first call.
"""

if __name__ != "minillm.kernels":
    # Imported as a top-level ``kernels``: ``python -m``/``python -c`` run from the repository root
    # put the root on sys.path, and this folder then shadows the PyPI package ``kernels`` that
    # transformers (>= 5.25 depends on it) imports. Load that package in our place; with none
    # installed, stay as we are (transformers then finds no version and leaves us alone).
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _path)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _module
        _spec.loader.exec_module(_module)
