"""CUDA graphs of the engine's decode steps: captured once per batch size, then replayed.

On a GPU an eager decode step of a small model is mostly launch overhead: a few hundred small
kernels, each launched from Python, while the GPU waits between them (the batch-32 decode
step's profile, eager and replayed: ``benchmarks/results/engine_gpu.json``). A step in
which every sequence brings exactly one new token launches the same kernels with the same
shapes for a given batch size; only the values in its input tensors change. So, as nano-vllm's
``ModelRunner.capture_cudagraph`` and vLLM do, :class:`DecodeGraphs` records that step once
per batch size in a set (1, 2, 4, then every multiple of 8: :func:`capture_sizes`) as a CUDA
graph, and each later decode step copies its inputs into the same tensors and replays the
graph: one launch instead of hundreds.

- Static inputs: the graphs read token ids, positions, slot mapping, block tables and lengths
  from the runner's :class:`~minillm.attention.paged.StepBuffers` (allocated once, so at the
  addresses that were captured); :func:`~minillm.attention.paged.build_metadata` writes them
  there. Block tables keep the buffers' full width (``max_blocks``), so no shape depends on
  the step's sequences.
- Padding: a batch of n sequences runs in the graph of the smallest captured size >= n. Each
  padding row is a one-token sequence (token 0 at position 0) whose only block is the
  *scratch block*, a pool block the block manager never hands out: it writes its K/V there,
  attends to that one key, and its hidden state is dropped. No real sequence's block is
  written.
- What stays eager (the runner decides, :meth:`~.runner.ModelRunner.forward`): prefill and
  mixed steps (a sequence with more than one new token), tree drafts, steps whose hidden
  states a drafter reads, steps with a KV connector (its per-layer waits run on the host),
  batches larger than the largest captured size, block tables wider than the buffers.
- Only an attention backend whose decode call reads the metadata tensors alone, with no host
  value that changes from step to step, can be captured (:func:`capturable`: the package's
  Triton backend, which launches its split-KV decode kernel with a grid from the batch size
  and the tables' static width). Its autotuning and JIT compiling happen in a warm-up run of
  each size, before that size is captured. A mixture of experts is not captured either (its
  routing counts go to the host every step).
- ``capture=False`` replays *eagerly*: the same padding, the same static buffers, the same
  metadata and forward function, re-run instead of a graph replay (with any backend: one
  that is not capturable gets its groups built as usual). It runs on the CPU, where the tests
  check the padded path, the Triton one included (in Triton's interpreter).

The graph's output is the final normed hidden states [size, D]; the runner applies the output
head to the rows it wants (as nano-vllm computes logits outside its graphs).
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import torch

from ..attention.paged import (
    PAGED_BACKENDS,
    PagedAttentionBackend,
    PagedMetadata,
    StepBuffers,
    build_metadata,
)
from ..cache.pool import PagedBatch, PagedKVPool
from ..model.transformer import Transformer


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM's batch sizes to capture, capped at ``max_batch``: 1, 2, 4, then every multiple
    of 8, and ``max_batch`` itself."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch]
    return sizes + list(range(8, max_batch + 1, 8)) + \
        ([max_batch] if max_batch > 4 and max_batch % 8 else [])


def capturable(attn: PagedAttentionBackend, model: Transformer | None = None) -> bool:
    """Whether a decode step through ``attn`` (of ``model``, if given) can be captured: the
    package's Triton backend (its decode path reads only ``block_tables``, ``seq_lens`` and
    shapes) and a model without experts (a mixture of experts copies its routing counts to
    the host every step). Other backends, a student's or a recorder included, may read host
    values of the metadata that change from step to step, and run eagerly."""
    return attn is PAGED_BACKENDS["triton"] and (model is None or not model.cfg.n_experts)


class DecodeGraphs:
    """Decode steps of a paged model padded to captured batch sizes, replayed as CUDA graphs
    (``capture=True``, CUDA only) or re-run eagerly on the same buffers (``capture=False``).

    ``model``, ``pool``, ``attn``, ``block_size``: the runner's. ``buffers``: its
    :class:`StepBuffers`, which every step's inputs are copied into. ``scratch_block``: a
    block of ``pool`` that no sequence owns (the runner's pool has one past the block
    manager's). ``sizes``: the batch sizes to capture, each at most the buffers' sequences
    and rows (None: :func:`capture_sizes` of that). With ``capture`` every size is captured
    now, largest first, into one shared memory pool.

    ``steps[size]`` counts the steps run at each padded size; ``capture_seconds``: the time
    capturing took (warm-up runs included).
    """

    def __init__(self, model: Transformer, pool: PagedKVPool, attn: PagedAttentionBackend,
                 buffers: StepBuffers, block_size: int, scratch_block: int,
                 sizes: Sequence[int] | None = None, capture: bool = True) -> None:
        limit = min(buffers.seq_lens.shape[0], buffers.input_ids.shape[0])
        sizes = capture_sizes(limit) if sizes is None else sizes
        if not sizes or any(not 1 <= s <= limit for s in sizes):
            raise ValueError(f"sizes must be batch sizes in [1, {limit}] (the static buffers' "
                             f"sequences and rows), got {list(sizes)}")
        if not 0 <= scratch_block < pool.k.shape[1]:
            raise ValueError(f"scratch_block must be a block of the pool, in "
                             f"[0, {pool.k.shape[1]}), got {scratch_block}")
        if capture and (model.device.type != "cuda" or not capturable(attn, model)):
            raise ValueError(f"capture=True needs a model without experts on CUDA and the "
                             f"triton attention backend, got {model.device}, "
                             f"{model.cfg.n_experts} experts and {attn.name!r}")
        self.model, self.pool, self.attn, self.buffers = model, pool, attn, buffers
        self.block_size, self.scratch_block = block_size, scratch_block
        self.sizes = sorted(set(sizes))
        self.capture = capture
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps: Counter[int] = Counter()
        self.capture_seconds = 0.0
        if capture:
            self._capture_all()

    def padded_size(self, n: int) -> int | None:
        """The batch size a step of ``n`` sequences runs at: the smallest captured size
        >= n, or None when n is larger than all of them."""
        return min((s for s in self.sizes if s >= n), default=None)

    def fits(self, tables: Sequence[Sequence[int]], q_lens: Sequence[int]) -> bool:
        """Whether a step of sequences with these block tables and new tokens can run here:
        exactly one new token each, a captured size holds them all, and every block table
        fits the buffers' width."""
        return bool(q_lens) and all(n == 1 for n in q_lens) \
            and self.padded_size(len(q_lens)) is not None \
            and max(map(len, tables)) <= self.buffers.block_tables.shape[1]

    def run(self, input_ids: list[int], positions: list[int], tables: list[list[int]],
            ctx_lens: list[int]) -> torch.Tensor:
        """One decode step of n sequences (``fits`` must hold): their new token ids and
        positions, block tables (each with the block of its new token) and cached tokens
        before this step, in the order of the flat batch. Writes each new token's K/V at its
        slot, and padding rows' at the scratch block. Returns the final normed hidden states
        [size, D] (size: :meth:`padded_size` of n; rows n.. are padding), which stay valid
        until the next call."""
        size = self.padded_size(len(input_ids))
        if size is None or len(positions) != len(input_ids) or len(tables) != len(input_ids) \
                or len(ctx_lens) != len(input_ids):
            raise ValueError(f"run needs one position, block table and cached length per "
                             f"token, for at most {self.sizes[-1]} sequences; got "
                             f"{len(input_ids)}, {len(positions)}, {len(tables)}, "
                             f"{len(ctx_lens)}")
        meta = self._fill(size, input_ids, positions, tables, ctx_lens)
        self.steps[size] += 1
        if not self.capture:
            return self._forward(size, meta)
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden

    def _fill(self, size: int, input_ids: list[int], positions: list[int],
              tables: list[list[int]], ctx_lens: list[int]) -> PagedMetadata:
        """Pad the step to ``size`` rows and copy it into the static buffers; returns its
        metadata (for a capturable backend only the per-sequence tensors, all of them buffer
        views, whether it is then captured or re-run)."""
        pad = size - len(input_ids)
        cfg = self.model.cfg
        meta = build_metadata(tables + [[self.scratch_block]] * pad, ctx_lens + [0] * pad,
                              [1] * size, self.block_size, self.model.device,
                              q_per_kv=cfg.n_heads // cfg.n_kv_heads, buffers=self.buffers,
                              direct=self.attn.reads_direct, groups=not capturable(self.attn))
        inputs = self.buffers.fill(input_ids=input_ids + [0] * pad,
                                   positions=positions + [0] * pad)
        if inputs is None or meta.block_tables.data_ptr() != \
                self.buffers.block_tables.data_ptr():
            raise RuntimeError(f"a decode step of {size} rows did not fit the static buffers "
                               f"(fits() should have refused it)")
        return meta

    def _forward(self, size: int, meta: PagedMetadata) -> torch.Tensor:
        """The step on rows 0..size-1 of the buffers -> final normed hidden states [size, D]:
        what a graph records and what an eager replay re-runs."""
        buf = self.buffers
        batch = PagedBatch(self.pool, meta, self.attn)
        h, _ = self.model.forward_layers(buf.input_ids[:size][None], batch,
                                         buf.positions[:size])
        return h[0]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture every size, largest first (the shared memory pool is sized by it), each on
        a step of padding rows only: nothing but the scratch block is written."""
        start = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            meta = self._fill(size, [], [], [], [])
            self.graphs[size] = self._capture(size, meta, mempool)
        torch.cuda.synchronize(self.model.device)
        self.capture_seconds = time.perf_counter() - start

    def _capture(self, size: int, meta: PagedMetadata, mempool
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (Triton compiles and autotunes, cuBLAS sets up: none of
        that may happen during capture), then record one step of ``size`` rows."""
        current = torch.cuda.current_stream(self.model.device)
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._forward(size, meta)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool):
            hidden = self._forward(size, meta)
        return graph, hidden
