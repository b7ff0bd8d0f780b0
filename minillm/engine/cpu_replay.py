"""A decode step's C++ calls, recorded once and replayed: the CPU's CUDA graph.

At batch 1 the CPU fast path (:mod:`.cpu_forward`) makes nine C++ calls a layer, 271 a step
of SmolLM2, and most of them are short: a norm over 576 numbers takes about a microsecond.
The Python that prepares each call (a fresh output tensor, the pointers and strides of its
arguments, a view or two) costs several times that, a third of the step. Yet when every call
of a step is C++ (each matmul's ``one_call``: bfloat16 weights at the rows the
matrix-vector kernel takes, :class:`minillm.model.packed.CpuWeight`; quantized ones at the rows the
integer kernels take, :meth:`minillm.quant.linear.QuantGroup.one_call`) and every sequence goes
to the paged kernel, two steps of the same :class:`StepShape` (sequences, rows, tree masks or
not, hidden states kept) make the same calls with the same sizes; only the values in a few
tensors differ: the new tokens' embeddings, RoPE's cos and sin, the slots, lengths, block
tables and mask bits. A plain decode step of n sequences is one shape (n rows); a speculative
verify step of one sequence with k drafted tokens another (k + 1 rows, a tree's masks as bits).
So, as :mod:`.graphs` captures a CUDA graph, :class:`RecordedDecode` runs one such step with
every tensor it touches in :class:`Buffers` it keeps (the KV pool and the weights stay where
they are), recording each C++ call with its arguments
(:func:`minillm.kernels.cpu_build.recording_calls`); each later step of that shape copies its
inputs into the same buffers and replays the list: the same arithmetic, one Python loop.
``python benchmarks/cpu_forward_bench.py`` measures it against the step it records.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch

from ..attention.paged import PagedMetadata
from ..cache.pool import PagedBatch


class Buffers:
    """Tensors allocated once by name, so they keep their addresses from one step to the next:
    what a recording's pointers name. ``frozen`` (once recorded): a buffer asked for at
    another shape is an error, not a new tensor."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.frozen = False

    def empty(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The buffer ``name`` of ``shape`` and ``dtype`` (allocated on first use)."""
        buf = self.tensors.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            if self.frozen:
                raise RuntimeError(f"buffer {name!r} of a recorded step asked for at "
                                   f"{shape} {dtype}")
            buf = self.tensors[name] = torch.empty(shape, dtype=dtype)
        return buf

    def put(self, name: str, value: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """Copy ``value`` into the buffer ``name`` and return the buffer. ``width``: a 2-D
        value goes into the first columns of a buffer that many columns wide (the rest
        zero), as block tables of any width go into one of the widest."""
        if width is None:
            return self.empty(name, tuple(value.shape), value.dtype).copy_(value)
        buf = self.empty(name, (value.shape[0], width), value.dtype)
        buf[:, value.shape[1]:] = 0
        buf[:, :value.shape[1]].copy_(value)
        return buf


class StepShape(NamedTuple):
    """What makes two steps' C++ calls the same: ``seqs`` sequences, ``rows`` new tokens in
    all, tree masks (as bits) or not, and the layers whose hidden states it keeps."""

    seqs: int
    rows: int
    masked: bool = False
    keep: tuple[int, ...] = ()

    @classmethod
    def decode(cls, n: int) -> StepShape:
        """A plain decode step of ``n`` sequences: one new token each."""
        return cls(n, n)


LayersFn = Callable[..., tuple[torch.Tensor, dict]]


RopeFn = Callable[[torch.Tensor, Buffers, torch.dtype], object]


class RecordedDecode:
    """One :class:`StepShape`'s step through the CPU fast path, recorded on its first
    :meth:`run` and replayed after. ``batch``: the pool and backend the steps read (a step
    through another pool needs another recording: :meth:`serves`); ``max_blocks``: the widest
    block table a sequence can have; ``keep``: the layers whose hidden states it returns.
    ``replays`` counts the steps replayed. (It holds no
    reference to the forward that owns it: :meth:`run` is handed its functions, so dropping
    the engine frees the model at once, with no cycle for the garbage collector to find.)"""

    def __init__(self, batch: PagedBatch, max_blocks: int, keep: tuple[int, ...] = ()) -> None:
        self.pool, self.attn, self.max_blocks = batch.pool, batch.attn, max_blocks
        self.keep = keep
        self.buffers = Buffers()
        self.calls: list | None = None
        self.out: torch.Tensor | None = None
        self.kept: dict[int, torch.Tensor] = {}
        self.replays = 0

    def serves(self, batch: PagedBatch) -> bool:
        """Whether ``batch`` reads the pool and backend recorded (its shape checked by the
        caller, :meth:`.cpu_forward.CpuForward._recording`)."""
        return batch.pool is self.pool and batch.attn is self.attn \
            and batch.meta.block_tables.shape[1] <= self.max_blocks

    def _metadata(self, meta: PagedMetadata) -> PagedMetadata:
        """``meta``'s tensors copied into the buffers (block tables at their widest)."""
        b = self.buffers
        return replace(meta, slot_mapping=b.put("slot_mapping", meta.slot_mapping),
                       block_tables=b.put("block_tables", meta.block_tables, self.max_blocks),
                       seq_lens=b.put("seq_lens", meta.seq_lens),
                       cu_seqlens_q=b.put("cu_seqlens_q", meta.cu_seqlens_q),
                       direct=b.put("direct", meta.direct),
                       row_bits=None if meta.row_bits is None else b.put("row_bits", meta.row_bits),
                       mask_from=None if meta.mask_from is None
                       else b.put("mask_from", meta.mask_from))

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata,
            layers: LayersFn, rope: RopeFn) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The step from the new tokens' embeddings x [N, D] -> (final normed hidden states
        [N, D], {layer: residual stream after it [N, D]} for the layers kept), new tensors;
        writes each token's K/V at its slot, as the eager call does. ``layers``:
        :meth:`.cpu_forward.CpuForward.layers` (x, positions, batch, keep, buffers=...), run to
        record; ``rope``: its cos/sin tables into the buffers (positions, buffers, dtype), run
        before each replay."""
        from ..kernels.cpu_build import recording_calls, replay_calls

        b = self.buffers
        x = b.put("x", x)
        static = self._metadata(meta)
        if self.calls is None:
            with recording_calls() as calls:
                self.out, self.kept = layers(x, positions,
                                             PagedBatch(self.pool, static, self.attn),
                                             self.keep, buffers=b)
            self.calls, b.frozen = calls, True
        else:
            rope(positions, b, x.dtype)
            replay_calls(self.calls)
            self.replays += 1
        return self.out.clone(), {i: h.clone() for i, h in self.kept.items()}
