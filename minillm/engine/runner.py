"""The model runner: the only device-aware part of the engine.

Each step it performs the scheduler's block moves, packs the scheduled tokens of every sequence
into one flat batch (token ids, positions, slot mapping, block tables), runs the model once over
it through the paged KV pool, and returns what the caller asked for: the logits at each
completing sequence's last row (or at every row of chosen sequences: a verification), and on
request the hidden states of chosen layers, all from the one forward pass.
"""
from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from ..attention.paged import (
    DIRECT_BACKENDS,
    StepBuffers,
    batch_order,
    build_metadata,
    get_paged_backend,
)
from ..cache.offload import LayerwiseLoad, LoadTiming
from ..cache.pool import PagedBatch, PagedKVPool
from ..model.packed import can_pack_linears, pack_linears
from ..model.transformer import Transformer
from .cpu_forward import CpuForward
from .scheduler import ScheduledSeq, SchedulerOutput


@dataclass
class StepResult:
    """What one forward pass produced.

    scheduled: the sequences' work in the order it ran. logits: [R, vocab] (fp32, or the
    model's dtype if wider), the rows asked for; ``logit_rows[seq_id]`` is the slice of them
    that belongs to a sequence (empty when it asked for none: a prompt chunk that does not
    reach the end). ``rows[seq_id]``: the
    sequence's rows of the flat batch [N, ...]. ``hidden[layer]``: [N, D], the residual stream
    after that layer (-1: the final normed states that feed the output head).
    ``move_seconds``: time spent on the block moves (swap, copy-on-write) before the forward.
    """

    scheduled: list[ScheduledSeq]
    logits: torch.Tensor
    logit_rows: dict[int, slice]
    rows: dict[int, slice]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    move_seconds: float = 0.0


class ModelRunner:
    def __init__(self, model: Transformer, num_blocks: int, block_size: int,
                 num_cpu_blocks: int = 0, attention_backend: str = "sdpa",
                 pack: bool | None = None, max_rows: int = 4096, max_seqs: int = 256,
                 static_buffers: bool | None = None) -> None:
        """``static_buffers`` (None: on CUDA) copies every step's inputs and metadata into
        tensors allocated once (:class:`~minillm.attention.paged.StepBuffers`, ``max_rows``
        tokens of ``max_seqs`` sequences), so that a decode step can be captured as a CUDA
        graph."""
        self.model, self.block_size = model, block_size
        if pack or (pack is None and can_pack_linears(model.device, model.dtype)):
            pack_linears(model)
        self.pool = PagedKVPool(model.cfg, num_blocks, block_size, model.device, model.dtype,
                                num_cpu_blocks)
        self.attention_backend = attention_backend
        self.attn = get_paged_backend(attention_backend)
        if static_buffers is None:
            static_buffers = model.device.type == "cuda"
        blocks_per_seq = -(-model.cfg.max_seq_len // block_size)
        self.buffers = StepBuffers(max_rows, max_seqs, blocks_per_seq, model.device) \
            if static_buffers else None
        self.layerwise_loads = False        # stored KV loads overlap the forward (chapter 08)
        self.fuse_ops = True                # the CPU fast path where it applies (fused_path)
        self.cpu_forward = CpuForward(model)
        self.load_timing = LoadTiming()

    def fused_path(self, meta, layers: Collection[int]) -> bool:
        """Whether this step runs :class:`~.cpu_forward.CpuForward` (the C++ small ops): when
        ``fuse_ops`` allows, it supports the model (:func:`~.cpu_forward.supports`), every
        sequence goes to the paged kernel (no tree masks), and ``self.attn`` is that backend
        itself (one wrapped to record its inputs, as chapter 04 does, is called eagerly)."""
        return self.fuse_ops and self.attn is get_paged_backend("cpu") \
            and meta.direct is not None \
            and meta.direct.numel() == len(meta.q_lens) \
            and all(0 <= i < self.model.cfg.n_layers for i in layers) \
            and self.cpu_forward.applies()

    @torch.inference_mode()
    def warmup(self, num_tokens: int) -> float:
        """Run the model once over ``num_tokens`` dummy tokens and once over a batch of eight
        single tokens, without the KV cache; returns the seconds taken. The packed linears
        build their oneDNN weights and oneDNN generates its kernels now instead of in the
        first request's step (about a second on 2 cores), as vLLM's workers do with their
        dummy runs at start."""
        start = time.perf_counter()
        dev = self.model.device
        self.model(torch.zeros(1, num_tokens, dtype=torch.long, device=dev))
        self.model(torch.zeros(8, 1, dtype=torch.long, device=dev))
        self.cpu_forward.applies()             # its model walk and weight lookup, once
        return time.perf_counter() - start

    def start_loads(self, plan: SchedulerOutput, tables: Mapping[int, list[int]]
                    ) -> LayerwiseLoad | None:
        """Copy the plan's stored KV into its blocks: now, or (``layerwise_loads``) layer by
        layer during the forward pass, returning the load to finish after it."""
        if not plan.loads:
            return None
        dev = self.pool.k.device
        loads = [(torch.tensor(tables[x.seq_id][x.first:x.first + x.kv.shape[2]
                                               // self.block_size], device=dev), x)
                 for x in plan.loads]
        if self.layerwise_loads:
            return LayerwiseLoad(self.pool, loads, self.model.layers, self.load_timing)
        start = time.perf_counter()
        for blocks, x in loads:
            self.pool.write_blocks(blocks, x.kv)
        spent = time.perf_counter() - start
        self.load_timing.loads += 1
        self.load_timing.load_seconds += spent
        self.load_timing.exposed_seconds += spent
        return None

    def move_blocks(self, plan: SchedulerOutput) -> float:
        """Swap out, swap in, copy-on-write, in that order; returns the seconds taken."""
        start = time.perf_counter()
        self.pool.swap_out(plan.swap_out)
        self.pool.swap_in(plan.swap_in)
        self.pool.copy_blocks(plan.copies)
        return time.perf_counter() - start

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, tables: Mapping[int, list[int]],
                all_logits: Collection[int] = (), hidden_layers: Collection[int] = (),
                masks: Mapping[int, torch.Tensor] | None = None,
                positions: Mapping[int, list[int]] | None = None) -> StepResult:
        """Run one step. ``all_logits``: seq ids that want logits at every new row;
        ``hidden_layers``: layers whose outputs to return; ``masks[seq_id]``: a tree mask
        [n, n] over that sequence's new tokens; ``positions[seq_id]``: their RoPE positions
        (default: their indices in the sequence)."""
        moved = self.move_blocks(plan)
        masks, positions = masks or {}, positions or {}
        work = plan.seqs
        order = batch_order([w.seq.num_computed for w in work], [w.num_tokens for w in work],
                            [w.seq.seq_id in masks for w in work])
        work = [work[i] for i in order]
        ids, pos, rows = [], [], {}
        for w in work:
            s, start = w.seq, w.seq.num_computed
            rows[s.seq_id] = slice(len(ids), len(ids) + w.num_tokens)
            ids += s.token_ids[start:start + w.num_tokens]
            pos += positions.get(s.seq_id, range(start, start + w.num_tokens))
        dev = self.model.device
        cfg = self.model.cfg
        meta = build_metadata([tables[w.seq.seq_id] for w in work],
                              [w.seq.num_computed for w in work], [w.num_tokens for w in work],
                              self.block_size, dev, [masks.get(w.seq.seq_id) for w in work],
                              q_per_kv=cfg.n_heads // cfg.n_kv_heads, buffers=self.buffers,
                              direct=self.attention_backend in DIRECT_BACKENDS)
        inputs = self.buffers.fill(input_ids=ids, positions=pos) if self.buffers else None
        if inputs is None:
            inputs = {"input_ids": torch.tensor(ids, device=dev),
                      "positions": torch.tensor(pos, device=dev)}
        layers = sorted(set(hidden_layers) - {-1})
        loading = self.start_loads(plan, tables)
        batch = PagedBatch(self.pool, meta, self.attn)
        try:
            if loading is None and self.fused_path(meta, layers):
                h, hidden = self.cpu_forward(inputs["input_ids"], inputs["positions"], batch,
                                             layers)
                h, hidden = h[None], {i: x[None] for i, x in hidden.items()}
            else:
                h, hidden = self.model.forward_layers(inputs["input_ids"][None], batch,
                                                      inputs["positions"], layers)
        finally:
            if loading is not None:
                loading.finish()
        hidden = {i: x[0] for i, x in hidden.items()}
        if -1 in hidden_layers:
            hidden[-1] = h[0]
        pick, logit_rows = [], {}
        for w in work:
            r = rows[w.seq.seq_id]
            want = range(r.start, r.stop) if w.seq.seq_id in all_logits else \
                [r.stop - 1] if w.completes else []
            logit_rows[w.seq.seq_id] = slice(len(pick), len(pick) + len(want))
            pick += want
        logits = self.model.lm_head(h[0, torch.tensor(pick, device=dev, dtype=torch.long)])
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return StepResult(work, logits, logit_rows, rows, hidden, moved)
