"""A compile-once decode step: static shapes, then ``torch.compile`` or CUDA-graph capture.

Eager PyTorch launches every kernel of a decode step from Python, one by one; at batch 1 on a
small model the launches cost more than the arithmetic. Runtimes build the step once for fixed
shapes and then only run it: TensorRT builds an engine, CUDA graphs record the launches and
replay them, ``torch.compile`` (Dynamo traces the Python into a graph, Inductor fuses it and
emits C++ or Triton). All three need the step's shapes and buffers to stay the same, hence
:class:`~minillm.cache.static.StaticKVCache` and, for graphs, inputs copied into tensors
allocated once. A batch of b sequences runs in the graph of the smallest captured size >= b
(:func:`pad_to_captured`); the padded rows compute and are thrown away, as in vLLM.

    dec = StaticDecoder(model, max_len=512, compile=True)
    ids = dec.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=64))

Greedy output equals :func:`minillm.generate.generate` (tested), compiled or not.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..cache.static import StaticKVCache
from ..config import SamplingParams
from ..device import sync
from ..model.transformer import Transformer
from ..sampling import make_generator, sample

#: Dynamo's per-function recompile limit while compiled decoders exist (its default, 8, is
#: reached by a few decoders of a benchmark: past it a step silently runs eagerly)
RECOMPILE_LIMIT = 64


def pad_to_captured(n: int, sizes: Sequence[int]) -> int:
    """The smallest size in ``sizes`` that holds a batch of ``n`` (ValueError if none)."""
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    fits = [s for s in sizes if s >= n]
    if not fits:
        raise ValueError(f"batch size {n} exceeds the largest captured size {max(sizes)}")
    return min(fits)


def padding_waste(batch_sizes: Sequence[int], sizes: Sequence[int]) -> float:
    """The share of the rows computed that are padding when each decode step of the given
    ``batch_sizes`` runs in the graph of :func:`pad_to_captured` over ``sizes``: padded rows /
    all rows computed (0 for no steps)."""
    run = sum(pad_to_captured(b, sizes) for b in batch_sizes)
    return (run - sum(batch_sizes)) / run if run else 0.0


class StaticDecoder:
    """Prefill (eager) and decode steps (eager, compiled or replayed) over a static KV cache.

    ``compile``: wrap the step in ``torch.compile`` (``compile_mode`` passed on); the first
    batch size compiles a static graph, a second one recompiles once with the batch
    dimension dynamic (Dynamo's automatic dynamic shapes), later sizes reuse it.
    ``cuda_graph_sizes``: batch sizes whose decode step is captured as a CUDA graph when the
    decoder is built (CUDA only; a compiled step is captured after compiling). Rows 0..b-1 of
    the cache hold the b sequences of the batch.
    """

    def __init__(self, model: Transformer, max_len: int | None = None, max_batch: int = 1,
                 compile: bool = False, compile_mode: str | None = None,
                 cuda_graph_sizes: Sequence[int] | None = None) -> None:
        cfg = model.cfg
        self.model, self.device = model, model.device
        self.max_len = max_len or cfg.max_seq_len
        if cuda_graph_sizes:
            if self.device.type != "cuda":
                raise ValueError("cuda_graph_sizes needs the model on a CUDA device, "
                                 f"got {self.device}")
            max_batch = max(max_batch, *cuda_graph_sizes)
        self.cache = StaticKVCache(cfg, max_batch, self.max_len, self.device, model.dtype)
        self.tokens = torch.zeros(max_batch, 1, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(max_batch, 1, dtype=torch.long, device=self.device)
        if compile:  # every decoder compiles the same code object: allow one entry per size
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        self.step_fn: Callable = torch.compile(self._forward, mode=compile_mode) \
            if compile else self._forward
        self.compiled, self.compile_seconds = compile, 0.0
        self._warm: set[int] = set()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        for size in sorted(cuda_graph_sizes or ()):
            self.graphs[size] = self._capture(size)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions [b, 1] -> logits [b, vocab] for batch rows 0..b-1."""
        self.cache.set_step(slice(0, tokens.shape[0]), positions)
        return self.model(tokens, cache=self.cache, positions=positions, last_only=True)[:, -1]

    @torch.inference_mode()
    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up (compiling, if asked) on a side stream, then record one step of ``size``
        rows. Runs before any prefill: the warm-up writes garbage at slot 0 of these rows."""
        tokens, positions = self.tokens[:size], self.positions[:size]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run_timed(size, tokens, positions)
            self.step_fn(tokens, positions)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.step_fn(tokens, positions)
        return graph, logits

    def _run_timed(self, size: int, tokens: torch.Tensor, positions: torch.Tensor
                   ) -> torch.Tensor:
        """One step; the first one of each size (where compiling happens) is timed."""
        if size in self._warm:
            return self.step_fn(tokens, positions)
        sync(self.device)
        start = time.perf_counter()
        out = self.step_fn(tokens, positions)
        sync(self.device)
        if self.compiled:
            self.compile_seconds += time.perf_counter() - start
        self._warm.add(size)
        return out

    @torch.inference_mode()
    def prefill(self, row: int, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Run a prompt (eager) into cache row ``row``; logits [vocab] at its last token."""
        self.model.cfg.check_prompt(list(prompt_ids))
        if not 0 <= row < self.cache.max_batch:
            raise ValueError(f"row must be in [0, {self.cache.max_batch}), got {row}")
        if len(prompt_ids) > self.max_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds max_len {self.max_len}")
        ids = torch.tensor([list(prompt_ids)], device=self.device)
        pos = torch.arange(len(prompt_ids), device=self.device)[None]
        self.cache.set_step(slice(row, row + 1), pos)
        return self.model(ids, cache=self.cache, positions=pos, last_only=True)[0, -1]

    def padded_size(self, b: int) -> int:
        """The rows a batch of ``b`` runs with: the next captured size, or b."""
        return pad_to_captured(b, list(self.graphs)) if self.graphs else b

    @torch.inference_mode()
    def decode(self, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """One decode step for rows 0..b-1: their new tokens at ``positions`` -> [b, vocab]."""
        b = len(tokens)
        if b != len(positions) or not 1 <= b <= self.cache.max_batch:
            raise ValueError(f"tokens and positions must have the same length in "
                             f"[1, {self.cache.max_batch}], got {b} and {len(positions)}")
        if max(positions) >= self.max_len:
            raise ValueError(f"position {max(positions)} is past max_len {self.max_len}")
        size = self.padded_size(b)
        self.tokens[:size].zero_()
        self.positions[:size].zero_()
        self.tokens[:b, 0] = torch.tensor(tokens, device=self.device)
        self.positions[:b, 0] = torch.tensor(positions, device=self.device)
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
        else:
            logits = self._run_timed(size, self.tokens[:size], self.positions[:size])
        return logits[:b]

    def generate_batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams
                       ) -> list[list[int]]:
        """New token ids for each prompt, decoded together (a static batch: a finished row
        keeps its slot until all are done; what it computes after that is discarded)."""
        if not 1 <= len(prompts) <= self.cache.max_batch:
            raise ValueError(f"prompts must number 1..{self.cache.max_batch}, got {len(prompts)}")
        gen = make_generator(params.seed, self.device)
        stop = set() if params.ignore_eos else {self.model.cfg.eos_token_id}
        outs: list[list[int]] = [[] for _ in prompts]
        budget = [min(params.max_tokens, self.max_len - len(p)) for p in prompts]
        if min(budget) < 1:
            raise ValueError(f"a prompt leaves no room under max_len {self.max_len}")
        last = torch.stack([self.prefill(i, p) for i, p in enumerate(prompts)])
        pos = [len(p) for p in prompts]
        live = set(range(len(prompts)))
        while True:
            nxt = sample(last, params, gen).tolist()
            for i in sorted(live):
                outs[i].append(nxt[i])
                if nxt[i] in stop or len(outs[i]) >= budget[i]:
                    live.discard(i)
            if not live:
                return outs
            last = self.decode(nxt, pos)
            pos = [min(p + 1, self.max_len - 1) for p in pos]

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """New token ids after one prompt (batch 1)."""
        return self.generate_batch([prompt_ids], params)[0]
