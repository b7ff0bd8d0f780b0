"""The model runner: the only device-aware part of the engine.

Each step it performs the scheduler's block moves, packs the scheduled sequences' new tokens into
one flat batch (token ids, positions, slot mapping, block tables), runs the model once over it
through the paged KV pool, and returns the logits at each sequence's last new token.
"""
from __future__ import annotations

import torch

from ..attention.paged import build_metadata, get_paged_backend
from ..cache.pool import PagedBatch, PagedKVPool
from ..model.packed import can_pack_linears, pack_linears
from ..model.transformer import Transformer
from .scheduler import SchedulerOutput
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: Transformer, num_blocks: int, block_size: int,
                 num_cpu_blocks: int = 0, attention_backend: str = "sdpa",
                 pack: bool | None = None) -> None:
        self.model, self.block_size = model, block_size
        if pack or (pack is None and can_pack_linears(model.device, model.dtype)):
            pack_linears(model)
        self.pool = PagedKVPool(model.cfg, num_blocks, block_size, model.device, model.dtype,
                                num_cpu_blocks)
        self.attention_backend = attention_backend
        self.attn = get_paged_backend(attention_backend)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, tables: dict[int, list[int]]
                ) -> tuple[list[Sequence], torch.Tensor]:
        """Run one step. Returns the scheduled sequences (decodes first) and their next-token
        logits [S, vocab] (fp32), row i for sequence i."""
        self.pool.swap_out(plan.swap_out)
        self.pool.swap_in(plan.swap_in)
        self.pool.copy_blocks(plan.copies)
        seqs = [s for r in plan.requests for s in r.seqs]
        # decodes first, by length, so that each decode group pads its keys to similar lengths
        seqs = sorted((s for s in seqs if s.num_uncomputed == 1), key=lambda s: s.num_tokens) + \
            [s for s in seqs if s.num_uncomputed > 1]
        num_decode = sum(s.num_uncomputed == 1 for s in seqs)
        ids, positions = [], []
        for s in seqs:
            ids += s.token_ids[s.num_computed:]
            positions += range(s.num_computed, s.num_tokens)
        dev = self.model.device
        meta = build_metadata([tables[s.seq_id] for s in seqs], [s.num_computed for s in seqs],
                              [s.num_uncomputed for s in seqs], num_decode, self.block_size, dev)
        h = self.model.hidden_states(torch.tensor([ids], device=dev), PagedBatch(self.pool, meta,
                                     self.attn), torch.tensor(positions, device=dev))
        last = meta.cu_seqlens_q[1:].long() - 1
        return seqs, self.model.lm_head(h[0, last]).float()
