"""Benchmarks (``python -m minillm bench ...``): :mod:`.common` (machine facts, the timer, the
engines' runners, JSON, the table formatter) and one module per benchmark: :mod:`.decode`
(batch-1 prefill and decode vs HF and llama.cpp), :mod:`.throughput` (the engine on many
requests), :mod:`.quant` (every quantization format), :mod:`.spec` (speculative decoding, with
:mod:`.spec_load`: speculation under load). Plots are in :mod:`minillm.viz.bench`.
"""
