"""KV handed between engines (chapter 07's disaggregation), through the engine's public API.

A prefill engine keeps a prompt's blocks past the end of its request (:meth:`KVHandoff.hold_kv`)
until the decode side has pulled them (:meth:`~KVHandoff.release_kv`); a decode engine
allocates blocks for a prompt computed elsewhere (:meth:`~KVHandoff.allocate_kv`), has the
KV written into them and adopts the request (:meth:`~KVHandoff.add_prefilled`). What moves the
bytes is a KV connector (:mod:`.connector`), which alone touches the device pool.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..cache.block_manager import blocks_for
from ..config import SamplingParams
from .sequence import Request, Sequence, Status, new_seq_id

if TYPE_CHECKING:
    from .engine import LLMEngine


class KVHandoff:
    """The :class:`~.engine.LLMEngine` methods for KV computed by, or for, another engine."""

    def can_adopt(self: LLMEngine, prompt_len: int) -> bool:
        """Room now for one more running sequence whose ``prompt_len`` tokens come computed
        (blocks above the watermark, one more decode slot, a free sequence slot)?"""
        live = sum(len(r.seqs) for r in self.scheduler.running)
        return live < self.config.max_num_seqs and self.blocks.can_allocate(prompt_len + 1)

    def allocate_kv(self: LLMEngine, num_tokens: int) -> int:
        """A new sequence id owning blocks for ``num_tokens`` tokens (check :meth:`can_adopt`
        first), for KV that arrives from elsewhere; give it to :meth:`add_prefilled` or
        :meth:`free_kv`."""
        seq_id = new_seq_id()
        self.blocks.allocate(seq_id, num_tokens)
        return seq_id

    def free_kv(self: LLMEngine, seq_id: int) -> None:
        """Free the blocks of a sequence from :meth:`allocate_kv` that was never adopted."""
        self.blocks.free(seq_id)

    def kv_blocks(self: LLMEngine, seq_id: int, num_tokens: int) -> list[int]:
        """The blocks holding the first ``num_tokens`` tokens of ``seq_id`` (live or held)."""
        table = self.blocks.tables.get(seq_id) or self.blocks.held_table(seq_id)
        if table is None:
            raise ValueError(f"seq_id {seq_id} has no blocks")
        return table[:blocks_for(num_tokens, self.blocks.block_size)]

    def hold_kv(self: LLMEngine, request_id: str) -> int:
        """Keep the blocks of ``request_id``'s sequence after the request ends, until
        :meth:`release_kv`; returns the sequence id (for :meth:`kv_blocks`)."""
        req = self.requests.get(request_id)
        if req is None or len(req.seqs) != 1:
            raise ValueError(f"request {request_id!r} must be live with one sequence")
        seq_id = req.seqs[0].seq_id
        self.blocks.hold(seq_id)
        return seq_id

    def release_kv(self: LLMEngine, seq_id: int) -> None:
        """Free what :meth:`hold_kv` kept."""
        self.blocks.release(seq_id)

    def add_prefilled(self: LLMEngine, prompt_ids: list[int], params: SamplingParams,
                      output_ids: list[int], seq_id: int, request_id: str | None = None,
                      arrival_time: float | None = None) -> str:
        """Adopt a request whose prompt was computed elsewhere (a disaggregated prefill worker):
        the prompt's K/V is already in the blocks of ``seq_id`` (:meth:`allocate_kv`), and
        ``output_ids`` (>= 1) were sampled so far. The request joins the running batch: the
        next step decodes after its last token (tokens between are computed first)."""
        ids, _ = self.validate(list(prompt_ids), params)
        if params.n > 1 or params.use_beam_search:
            raise ValueError("add_prefilled takes one sequence: n and beam_width must be 1")
        if params.structured_outputs is not None:
            raise ValueError("structured_outputs cannot be combined with add_prefilled: the "
                             "first token was sampled without the grammar's mask")
        table = self.blocks.tables.get(seq_id)
        if table is None or len(table) < blocks_for(len(ids), self.blocks.block_size):
            raise ValueError(f"seq_id {seq_id} must own blocks for the {len(ids)} prompt tokens")
        if not output_ids:
            raise ValueError("output_ids must hold at least the first sampled token")
        seq = Sequence(ids + [int(t) for t in output_ids], len(ids), seq_id=seq_id,
                       num_computed=len(ids))
        req = Request(self._new_id(request_id), ids, params, seqs=[seq])
        self._register(req, arrival_time)
        req.metrics.first_scheduled = req.metrics.first_token = time.perf_counter()
        req.status = Status.RUNNING
        self.scheduler.running.append(req)
        return req.request_id
