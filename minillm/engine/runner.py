"""The model runner: the only device-aware part of the engine.

``execute(plan)`` is one step's device work: the plan's KV moves, then :meth:`forward` (the
scheduled tokens of every sequence packed into one flat batch: token ids, positions, slot
mapping, block tables; the model run once over it through the paged KV pool; the logits at each
completing sequence's last row, or at every row of a drafted sequence or one collecting prompt
logprobs; the hidden states a drafter reads), then sampling and verification
(:class:`~.step_sampler.StepSampler`). It returns a :class:`~.plan.RunnerOutput` and writes no
sequence: :meth:`~.scheduler.Scheduler.update_from_output` applies it. A KV connector
(:mod:`.connector`) is called around the forward pass and around each of its layers. A pure
decode step may instead replay a CUDA graph (:mod:`.graphs`, ``cuda_graphs``).
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..attention.paged import (
    PagedAttentionBackend,
    StepBuffers,
    batch_order,
    build_metadata,
    check_kv_format,
    get_paged_backend,
)
from ..cache.pool import PagedBatch, PagedKVPool
from ..model.packed import can_pack_linears, pack_linears
from ..model.transformer import Transformer
from .connector import KVConnector
from .cpu_forward import CpuForward
from .graphs import DecodeGraphs, capturable
from .plan import RunnerOutput, ScheduledSeq, SchedulerOutput
from .speculation import Speculator
from .step_sampler import StepSampler, collects_prompt_logprobs


@dataclass
class StepResult:
    """What one forward pass produced.

    scheduled: the sequences' work in the order it ran. logits: [R, vocab] (fp32, or the
    model's dtype if wider), the rows asked for; ``logit_rows[seq_id]`` is the slice of them
    that belongs to a sequence (empty when it asked for none: a prompt chunk that does not
    reach the end). ``rows[seq_id]``: the
    sequence's rows of the flat batch [N, ...]. ``hidden[layer]``: [N, D], the residual stream
    after that layer (-1: the final normed states that feed the output head).
    """

    scheduled: list[ScheduledSeq]
    logits: torch.Tensor
    logit_rows: dict[int, slice]
    rows: dict[int, slice]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: Transformer, num_blocks: int, block_size: int,
                 num_cpu_blocks: int = 0,
                 attention_backend: str | PagedAttentionBackend = "sdpa",
                 pack: bool | None = None, max_rows: int = 4096, max_seqs: int = 256,
                 static_buffers: bool | None = None,
                 tables: Mapping[int, list[int]] | None = None,
                 connector: KVConnector | None = None, cuda_graphs: bool = False,
                 kv_dtype: torch.dtype | None = None) -> None:
        """``attention_backend``: a name or a
        :class:`~minillm.attention.paged.PagedAttentionBackend` (``self.attn``; its name is
        ``self.attention_backend``). ``tables``: the block manager's block tables (read, never
        written). ``connector``: the engine's KV connector, if any (its worker half).
        ``static_buffers`` (None: on CUDA) copies every step's inputs and metadata into
        tensors allocated once (:class:`~minillm.attention.paged.StepBuffers`, ``max_rows``
        tokens of ``max_seqs`` sequences), so that a decode step can be captured as a CUDA
        graph; the pool then has one block more than ``num_blocks``, ``scratch_block``, which
        no sequence owns (padding rows of a padded decode step write there).
        ``cuda_graphs``: on CUDA with the triton backend, a model without experts and no
        connector, capture the decode steps now and replay them (:meth:`use_decode_graphs`;
        static buffers on); ignored on other devices. ``kv_dtype``: how the pool stores K/V
        (default the model's dtype; see ``EngineConfig.kv_cache_dtype``)."""
        self.model, self.block_size = model, block_size
        if pack or (pack is None and can_pack_linears(model.device, model.dtype)):
            pack_linears(model)
        cuda_graphs = cuda_graphs and model.device.type == "cuda"
        if static_buffers is None:
            static_buffers = model.device.type == "cuda"
        static_buffers = static_buffers or cuda_graphs
        self.scratch_block: int | None = num_blocks if static_buffers else None
        self.attn: PagedAttentionBackend = get_paged_backend(attention_backend)
        check_kv_format(self.attn, kv_dtype or model.dtype, model.dtype)
        self.pool = PagedKVPool(model.cfg, num_blocks + int(static_buffers), block_size,
                                model.device, model.dtype, num_cpu_blocks, kv_dtype)
        self.attention_backend = self.attn.name
        blocks_per_seq = -(-model.cfg.max_seq_len // block_size)
        self.buffers = StepBuffers(max_rows, max_seqs, blocks_per_seq, model.device) \
            if static_buffers else None
        self.fuse_ops = True                # the CPU fast path where it applies (fused_path)
        self.cpu_forward = CpuForward(model)
        self.tables: Mapping[int, list[int]] = tables if tables is not None else {}
        self.connector = connector
        if connector is not None:
            connector.register_kv_pool(self.pool, self.tables)
        self.sampler = StepSampler()        # its .speculator verifies drafts
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and capturable(self.attn, model) and connector is None:
            self.use_decode_graphs()
        elif cuda_graphs:
            warnings.warn(f"cuda_graphs: nothing captured (they need the triton attention "
                          f"backend, a model without experts and no KV connector; got "
                          f"{self.attention_backend!r}, {model.cfg.n_experts} experts, "
                          f"{type(connector).__name__}); decode steps run eagerly",
                          stacklevel=2)

    def use_decode_graphs(self, sizes: Sequence[int] | None = None,
                          capture: bool | None = None) -> DecodeGraphs:
        """From now on run every pure decode step that fits (:meth:`graph_step`) padded to
        one of ``sizes`` (None: 1, 2, 4, then every multiple of 8 up to ``max_seqs``) through
        :class:`~.graphs.DecodeGraphs`: replayed as CUDA graphs, captured now (``capture``;
        None: on CUDA), or re-run eagerly on the same static buffers (the CPU's test of the
        path). Needs ``static_buffers``."""
        if self.buffers is None or self.scratch_block is None:
            raise ValueError("decode graphs need static_buffers=True (their inputs live there)")
        capture = self.model.device.type == "cuda" if capture is None else capture
        self.graphs = DecodeGraphs(self.model, self.pool, self.attn, self.buffers,
                                   self.block_size, self.scratch_block, sizes, capture)
        return self.graphs

    @property
    def speculator(self) -> Speculator | None:
        """The speculator whose rule verifies drafts and whose drafter reads hidden states."""
        return self.sampler.speculator

    @speculator.setter
    def speculator(self, speculator: Speculator | None) -> None:
        self.sampler.speculator = speculator

    def fused_path(self, batch: PagedBatch, layers: Collection[int]) -> bool:
        """Whether this step runs :class:`~.cpu_forward.CpuForward` (the C++ small ops): when
        ``fuse_ops`` allows, the hidden states asked for are of its layers, and it
        :meth:`~.cpu_forward.CpuForward.runs` the batch (it supports the model, every sequence
        goes to the paged kernel or is a tree draft after cached context, and ``self.attn``
        declares ``cpu_fast_path``: the C++ kernel's own backend does; one that records its
        inputs, as chapter 04's does, says False and is called eagerly)."""
        return self.fuse_ops and all(0 <= i < self.model.cfg.n_layers for i in layers) \
            and self.cpu_forward.runs(batch)

    def graph_step(self, tables: list[list[int]], q_lens: list[int],
                   masks: Mapping[int, torch.Tensor], positions: Mapping[int, list[int]],
                   hidden_layers: Collection[int]) -> bool:
        """Whether a forward pass goes through ``self.graphs``: a pure decode step (one new
        token per sequence; :meth:`~.graphs.DecodeGraphs.fits`) without tree masks or
        positions, without hidden states for a drafter, and without a KV connector (its
        per-layer waits run on the host)."""
        return self.graphs is not None and not masks and not positions \
            and not hidden_layers and self.connector is None \
            and self.graphs.fits(tables, q_lens)

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

    def move_blocks(self, plan: SchedulerOutput) -> float:
        """Swap out, swap in, copy-on-write, in that order; returns the seconds taken."""
        start = time.perf_counter()
        self.pool.swap_out(plan.swap_out)
        self.pool.swap_in(plan.swap_in)
        self.pool.copy_blocks(plan.copies)
        return time.perf_counter() - start

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """One step: the plan's KV moves and forward pass, then the tokens every completing
        sequence gains (drafts verified). Reads the plan's sequences, writes none of them."""
        want_all = {s.seq_id for r in plan.requests if collects_prompt_logprobs(r)
                    for s in r.seqs}
        masks, positions = {}, {}
        for w in plan.seqs:
            d = w.seq.draft
            if d is not None:
                want_all.add(w.seq.seq_id)
                if not d.is_chain:
                    root = w.seq.num_tokens - w.seq.num_draft - 1
                    mask, positions[w.seq.seq_id] = d.tree_inputs(root)
                    masks[w.seq.seq_id] = torch.tensor(mask)
        layers = self.speculator.hidden_layers if self.speculator is not None else ()
        moved = self.move_blocks(plan)
        short = self.connector.start_load(plan) if self.connector is not None else {}
        run = plan.without(short) if short else plan
        if not run.seqs:                    # nothing to compute (every sequence sat out)
            if self.connector is not None:
                self.connector.wait_for_save()
            return RunnerOutput(move_seconds=moved, short_loads=short)
        result = self.forward(run, self.tables, want_all, layers, masks, positions)
        if self.connector is not None:
            self.connector.wait_for_save()
        out = RunnerOutput(rows=result.rows, hidden=result.hidden, move_seconds=moved,
                           short_loads=short)
        self.sampler.sample(run, result.logits, result.logit_rows, out)
        self._compact_accepted(run, out)
        return out

    def _compact_accepted(self, plan: SchedulerOutput, out: RunnerOutput) -> None:
        """Copy the KV of each verified tree's accepted nodes into the positions right after
        its root (a chain's are there already), every layer."""
        bs = self.block_size
        src, dst = [], []
        for w in plan.seqs:
            sample = out.samples.get(w.seq.seq_id, [None])[0]
            if sample is None or sample.path is None or \
                    sample.path == list(range(1, len(sample.path) + 1)):
                continue
            table = self.tables[w.seq.seq_id]
            root = w.seq.num_tokens - w.seq.num_draft - 1
            for j, node in enumerate(sample.path):
                for pos, slots in ((root + node, src), (root + 1 + j, dst)):
                    slots.append(table[pos // bs] * bs + pos % bs)
        if src:
            self.pool.copy_slots(src, dst)

    @torch.inference_mode()
    def forward(self, plan: SchedulerOutput, tables: Mapping[int, list[int]],
                all_logits: Collection[int] = (), hidden_layers: Collection[int] = (),
                masks: Mapping[int, torch.Tensor] | None = None,
                positions: Mapping[int, list[int]] | None = None) -> StepResult:
        """The forward pass of ``plan.seqs`` (its block moves done, its loads started).
        ``all_logits``: seq ids that want logits at every new row;
        ``hidden_layers``: layers whose outputs to return; ``masks[seq_id]``: a tree mask
        [n, n] over that sequence's new tokens; ``positions[seq_id]``: their RoPE positions
        (default: their indices in the sequence)."""
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
        block_tables = [tables[w.seq.seq_id] for w in work]
        ctx_lens, q_lens = [w.seq.num_computed for w in work], [w.num_tokens for w in work]
        if self.graph_step(block_tables, q_lens, masks, positions, hidden_layers):
            h, hidden = self.graphs.run(ids, pos, block_tables, ctx_lens)[None], {}
        else:
            h, hidden = self._eager_forward(ids, pos, block_tables, ctx_lens, q_lens,
                                            [masks.get(w.seq.seq_id) for w in work],
                                            hidden_layers)
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
        return StepResult(work, logits, logit_rows, rows, hidden)

    def _eager_forward(self, ids: list[int], pos: list[int], block_tables: list[list[int]],
                       ctx_lens: list[int], q_lens: list[int],
                       masks: list[torch.Tensor | None], hidden_layers: Collection[int]
                       ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The model over the flat batch of N rows, launched op by op (the C++ forward where
        :meth:`fused_path` allows), the connector called around each layer: final normed
        hidden states [1, N, D] and ``{layer: [N, D]}`` for the layers in ``hidden_layers``."""
        dev = self.model.device
        cfg = self.model.cfg
        meta = build_metadata(block_tables, ctx_lens, q_lens, self.block_size, dev, masks,
                              q_per_kv=cfg.n_heads // cfg.n_kv_heads, buffers=self.buffers,
                              direct=self.attn.reads_direct)
        inputs = self.buffers.fill(input_ids=ids, positions=pos) if self.buffers else None
        if inputs is None:
            inputs = {"input_ids": torch.tensor(ids, device=dev),
                      "positions": torch.tensor(pos, device=dev)}
        layers = sorted(set(hidden_layers) - {-1})
        batch = PagedBatch(self.pool, meta, self.attn)
        c = self.connector
        around = (c.wait_for_layer, c.save_layer) if c is not None else (None, None)
        if self.fused_path(batch, layers):
            h, hidden = self.cpu_forward(inputs["input_ids"], inputs["positions"], batch,
                                         layers, *around)
            h, hidden = h[None], {i: x[None] for i, x in hidden.items()}
        else:
            h, hidden = self.model.forward_layers(inputs["input_ids"][None], batch,
                                                  inputs["positions"], layers, *around)
        return h, {i: x[0] for i, x in hidden.items()}
