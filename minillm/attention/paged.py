"""Attention over a paged KV cache for a whole engine step (selective batching, chapter 04).

One step packs the new tokens of every scheduled sequence into one flat batch of N rows: the
token-wise work (linears, norms, FFN) runs on all N rows at once, and attention is done per
sequence through the metadata below (Orca's *selective batching*). A sequence brings
``q_len`` new tokens on top of ``ctx_len`` cached ones: a decode (1 new token), a verification
of a few drafted tokens, a prompt chunk, a whole prompt. The cache layout is the kernels'
(``minillm.kernels.paged_attention``): k_cache, v_cache [num_blocks, block_size, Hkv, D] per
layer. A sequence may bring a *tree mask* [q_len, q_len] over its new tokens (True: node i sees
node j); it always sees its whole cached prefix. Without one, the new tokens are causal. A
mask may also be wider, [q_len, w], over the last w keys: cached tokens too (a drafter growing
a tree level by level keeps the earlier levels in its cache and shows each new node only its
ancestors among them); the keys before those it sees.

Backends take q [N, Hq, D], the new tokens' k, v [N, Hkv, D] (already written into the cache),
the layer's caches and the :class:`PagedMetadata`, and return [N, Hq, D]:

- ``sdpa``: sequences with a cached prefix and at most ``SHORT_QUERY`` new tokens (decodes,
  verifications) and every sequence with a tree mask are attended in groups of up to
  ``QUERY_GROUP``: their blocks gathered whole into a padded [B, Hkv, L, D] batch, their queries
  padded to the group's longest, one masked SDPA call. A sequence with nothing cached runs causal
  SDPA over its own new keys (no gather); a long chunk over a cached prefix gathers its own keys.
  Runs anywhere; the CPU fallback.
- ``cpu``: every sequence without a tree mask (decodes, verifications, prompts and chunks) goes
  to a C++ kernel that reads its blocks in place (``minillm.kernels.cpu_paged_attention``): no
  gather, no padding, no GQA copy of K/V; a tree mask over at most 64 keys is read as bits
  per row (``meta.row_bits``), a wider one goes to a group as with ``sdpa``. The
  CPU default where a C++ compiler built the kernel (float32 and bfloat16 models); its speed
  against these SDPA paths: ``benchmarks/cpu_attention_bench.py``.
- ``triton``: the paged kernels of chapter 05 read the blocks in place: split-KV decode when every
  sequence has one new token, otherwise one paged prefill kernel over the mixed batch
  (Pensieve-style). Tree masks are not in the kernels: a step with one falls back to ``sdpa``.

Everything a backend needs is built once per step on the host (Python lists and tensors made
from them), so the forward pass makes no host synchronisation.

These three are the named implementations of :class:`PagedAttentionBackend`, the contract the
engine calls; ``EngineConfig(attention_backend=...)`` takes a name or any object implementing it
(a student's backend, a wrapper that records what it is given).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from .kv_quant import Int8Blocks, read_blocks, store
from .sdpa import sdpa_attention

KVCache = torch.Tensor | Int8Blocks     # one layer's cache: see minillm.attention.kv_quant

QUERY_GROUP = 16     # sequences per padded group
SHORT_QUERY = 64     # new tokens over a cached prefix that still go to a padded group


@dataclass
class QueryGroup:
    """Sequences [first, last) of the step, rows [start, end) of the flat batch, attended as one
    padded batch of B sequences x Q query slots over W blocks each.

    pad_rows: int64 [B * Q], the flat row behind each query slot (padding repeats a real row);
    real: int64 [end - start], the query slot of each real row, in flat order;
    blocks: int64 [B * W], each sequence's block table padded with block 0;
    mask: bool [B, 1, G * Q, W * block_size], which keys each query slot sees, repeated for the
    G query heads that share a KV head (they are folded into the query axis).
    """

    first: int
    last: int
    start: int
    end: int
    q_slots: int
    pad_rows: torch.Tensor
    real: torch.Tensor
    blocks: torch.Tensor
    mask: torch.Tensor


@dataclass
class PagedMetadata:
    """Where each row of a step's flat batch lives. S sequences, N rows.

    slot_mapping: int64 [N], cache slot (block * block_size + offset) of each new token.
    block_tables: int32 [S, max_blocks]; seq_lens: int32 [S], tokens in the cache after this step.
    cu_seqlens_q: int32 [S + 1], row ranges of each sequence. Python lists (no device reads):
    q_lens (new tokens), ctx_lens (tokens cached before this step), starts (first row of each
    sequence). ``groups``: the padded groups (:class:`QueryGroup`); ``singles``: the other
    sequences, attended one by one. ``has_masks``: some sequence brought a tree mask.
    ``direct``: int32 [M], sequences left to a kernel that reads the blocks in place (built
    with ``direct=True``: every one without a tree mask, and those whose mask spans at most
    64 keys), else None; for the masked ones among them ``row_bits`` int64 [N] (per row, bit
    j: it sees key ``mask_from[s] + j``; -1: no mask) and ``mask_from`` int32 [S], else None.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    q_lens: list[int]
    ctx_lens: list[int]
    starts: list[int]
    block_size: int
    groups: list[QueryGroup] = field(default_factory=list)
    singles: list[int] = field(default_factory=list)
    has_masks: bool = False
    direct: torch.Tensor | None = None
    row_bits: torch.Tensor | None = None
    mask_from: torch.Tensor | None = None

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens)


MASK_BITS = 64          # the widest tree mask a direct kernel takes (one int64 of bits a row)


def grouped(ctx_len: int, q_len: int, has_mask: bool) -> bool:
    """Does a sequence go to a padded group (else it is attended on its own)?"""
    return has_mask or (ctx_len > 0 and q_len <= SHORT_QUERY)


def batch_order(ctx_lens: Sequence[int], q_lens: Sequence[int],
                has_mask: Sequence[bool] | None = None) -> list[int]:
    """An order of the step's sequences for :func:`build_metadata`: grouped ones first, by new
    tokens then total length (so a group pads little), then the rest as given."""
    has_mask = has_mask or [False] * len(q_lens)
    key = [(not grouped(c, q, m), q, c + q) if grouped(c, q, m) else (True, 0, 0)
           for c, q, m in zip(ctx_lens, q_lens, has_mask)]
    return sorted(range(len(q_lens)), key=lambda i: key[i])


class StepBuffers:
    """Device tensors that a step's inputs and metadata are copied into, allocated once, so
    they sit at the same addresses every step: what replaying a captured CUDA graph of the
    decode step needs (it reads input ids, positions, slots, block tables and lengths from
    here). Sized for ``max_rows`` new tokens of ``max_seqs`` sequences of up to ``max_blocks``
    blocks; :meth:`fill` returns None when a step does not fit (it then uses fresh tensors)."""

    def __init__(self, max_rows: int, max_seqs: int, max_blocks: int,
                 device: torch.device) -> None:
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids, self.positions, self.slot_mapping = (zeros(max_rows) for _ in range(3))
        self.block_tables = zeros(max_seqs, max_blocks, dtype=torch.int32)
        self.seq_lens = zeros(max_seqs, dtype=torch.int32)
        self.cu_seqlens_q = zeros(max_seqs + 1, dtype=torch.int32)

    def fill(self, **values: list) -> dict[str, torch.Tensor] | None:
        """Copy each list into the buffer of that name; returns the filled views (block tables:
        [S, max_blocks], zero-padded), or None if something is too large."""
        out = {}
        for name, rows in values.items():
            buf = getattr(self, name)
            data = torch.tensor(rows, dtype=buf.dtype)
            if data.shape[0] > buf.shape[0] or (data.dim() == 2 and data.shape[1] > buf.shape[1]):
                return None
            view = buf[:data.shape[0]]
            if data.dim() == 2:
                view.zero_()
                view[:, :data.shape[1]].copy_(data, non_blocking=True)
            else:
                view.copy_(data, non_blocking=True)
            out[name] = view
        return out


def build_metadata(block_tables: list[list[int]], ctx_lens: list[int], q_lens: list[int],
                   block_size: int, device: torch.device,
                   masks: Sequence[torch.Tensor | None] | None = None,
                   q_per_kv: int = 1, buffers: StepBuffers | None = None,
                   direct: bool = False, groups: bool = True) -> PagedMetadata:
    """Metadata for S sequences from their block tables and token counts (Python lists), in
    the order given (see :func:`batch_order`). ``masks[i]``: bool [q_lens[i], w] or None
    (causal), over the sequence's last w keys (q_lens[i] <= w <= its length; w = q_lens[i]:
    its new tokens); ``q_per_kv``: query heads per KV head (GQA); ``buffers``: write the tensors
    into these (:class:`StepBuffers`) instead of fresh ones; ``direct``: list every sequence
    without a tree mask, and every one whose mask the kernel takes (:func:`bits_fit`: as
    bits, ``meta.row_bits``), in ``meta.direct`` (for a kernel that reads the blocks in place)
    instead of padding it into a group or attending it on its own. ``groups`` False: stop
    after the per-sequence tensors (``groups``, ``singles`` empty, ``direct`` None), for a
    backend that reads those alone, such as the Triton decode kernel of a captured decode
    step (:mod:`minillm.engine.graphs`), and no host work on groups; no tree masks then."""
    masks = list(masks) if masks is not None else [None] * len(q_lens)
    if not groups and any(m is not None for m in masks):
        raise ValueError("masks need groups=True: a tree mask is attended in a padded group")
    for i, (m, n, c) in enumerate(zip(masks, q_lens, ctx_lens)):
        if m is not None and not (m.dim() == 2 and m.shape[0] == n and n <= m.shape[1] <= c + n):
            raise ValueError(f"masks[{i}] must be [q_len, w] = [{n}, w] with {n} <= w <= "
                             f"{c + n}, got {tuple(m.shape)}")
    slots = []
    for table, start, n in zip(block_tables, ctx_lens, q_lens):
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(start, start + n)]
    width = max(len(t) for t in block_tables)
    tables = [t + [0] * (width - len(t)) for t in block_tables]
    lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    filled = buffers.fill(slot_mapping=slots, block_tables=tables, seq_lens=lens,
                          cu_seqlens_q=starts) if buffers is not None else None
    if filled is None:
        filled = {"slot_mapping": torch.tensor(slots, dtype=torch.long, device=device),
                  "block_tables": torch.tensor(tables, dtype=torch.int32, device=device),
                  "seq_lens": torch.tensor(lens, dtype=torch.int32, device=device),
                  "cu_seqlens_q": torch.tensor(starts, dtype=torch.int32, device=device)}
    meta = PagedMetadata(**filled, q_lens=list(q_lens), ctx_lens=list(ctx_lens),
                         starts=starts[:-1], block_size=block_size,
                         has_masks=any(m is not None for m in masks))
    if not groups:
        return meta
    pending: list[int] = []
    direct_seqs: list[int] = []
    for i, (c, n, m) in enumerate(zip(ctx_lens, q_lens, masks)):
        if direct and (m is None or bits_fit(m)):
            direct_seqs.append(i)
            continue
        if not grouped(c, n, m is not None):
            meta.singles.append(i)
            continue
        if pending and (pending[-1] != i - 1 or len(pending) == QUERY_GROUP):
            meta.groups.append(_group(pending, meta, block_tables, masks, q_per_kv, device))
            pending = []
        pending.append(i)
    if pending:
        meta.groups.append(_group(pending, meta, block_tables, masks, q_per_kv, device))
    if direct:
        meta.direct = torch.tensor(direct_seqs, dtype=torch.int32, device=device)
        if any(masks[i] is not None for i in direct_seqs):
            meta.row_bits, meta.mask_from = mask_bits(masks, direct_seqs, meta, device)
    return meta


def bits_fit(mask: torch.Tensor) -> bool:
    """Whether a direct kernel takes ``mask`` [n, w] as bits: at most MASK_BITS keys wide, and
    within the causal rule (row t sees no key after its own, as a tree's node sees only
    ancestors; a bidirectional block does not fit)."""
    n, w = mask.shape
    return w <= MASK_BITS and not mask.triu(diagonal=w - n + 1).any()


def mask_bits(masks: list[torch.Tensor | None], seqs: list[int], meta: PagedMetadata,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree masks as a kernel reads them: row_bits int64 [N] (row t of a masked sequence:
    bit j set where it sees key mask_from + j; -1 elsewhere) and mask_from int32 [S] (the
    sequence's first masked key: its length minus the mask's width)."""
    bits = torch.full((sum(meta.q_lens),), -1, dtype=torch.long)
    start = [c + n for c, n in zip(meta.ctx_lens, meta.q_lens)]
    for i in seqs:
        m = masks[i]
        if m is not None:
            w = m.shape[1]
            weights = torch.ones(w, dtype=torch.long) << torch.arange(w)
            bits[meta.starts[i]:meta.starts[i] + meta.q_lens[i]] = \
                (m.to("cpu", torch.long) * weights).sum(1)
            start[i] -= w
    return bits.to(device), torch.tensor(start, dtype=torch.int32, device=device)


def _group(seqs: list[int], meta: PagedMetadata, block_tables: list[list[int]],
           masks: list[torch.Tensor | None], q_per_kv: int, device) -> QueryGroup:
    """The :class:`QueryGroup` of consecutive sequences ``seqs``."""
    first, last = seqs[0], seqs[-1] + 1
    q = max(meta.q_lens[first:last])
    w = max(len(block_tables[i]) for i in seqs)
    keys = torch.arange(w * meta.block_size)
    pad_rows, real, blocks, rows_mask = [], [], [], []
    for b, i in enumerate(seqs):
        ctx, n, start = meta.ctx_lens[i], meta.q_lens[i], meta.starts[i]
        pad_rows += [start + min(t, n - 1) for t in range(q)]
        real += [b * q + t for t in range(n)]
        blocks += block_tables[i] + [0] * (w - len(block_tables[i]))
        new = torch.tril(torch.ones(n, n, dtype=torch.bool)) if masks[i] is None \
            else masks[i].to("cpu", torch.bool)
        seen = (keys < ctx)[None].repeat(q, 1)                  # the cached prefix
        seen[:n, ctx + n - new.shape[1]:ctx + n] = new          # the last keys, as masked
        seen[n:, 0] = True                                      # padding: any one key
        rows_mask.append(seen)
    mask = torch.stack(rows_mask)[:, None].repeat(1, 1, q_per_kv, 1)    # [B, 1, G*Q, L]
    t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    end = meta.starts[last - 1] + meta.q_lens[last - 1]
    return QueryGroup(first, last, meta.starts[first], end, q, t(pad_rows), t(real), t(blocks),
                      mask.to(device))


def write_kv(k_cache: KVCache, v_cache: KVCache, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' k, v [N, Hkv, D] at their slots of the [blocks, bs, Hkv, D] caches
    (converted to the caches' format)."""
    store(k_cache, k, slot_mapping)
    store(v_cache, v, slot_mapping)


def sdpa_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: KVCache, v_cache: KVCache,
                         meta: PagedMetadata) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D] (see the module docstring)."""
    return attend_groups_and_singles(q, k, v, k_cache, v_cache, meta, torch.empty_like(q))


def attend_groups_and_singles(q: torch.Tensor, k: torch.Tensor | None,
                              v: torch.Tensor | None, k_cache: KVCache,
                              v_cache: KVCache, meta: PagedMetadata, out: torch.Tensor
                              ) -> torch.Tensor:
    """Write the rows of ``meta.groups`` and ``meta.singles`` into ``out`` [N, Hq, D]. ``k``,
    ``v`` (the new tokens' [N, Hkv, D]) are read only for a single without cached context in
    a cache of q's dtype (a narrower cache is read back, so that every query sees the keys as
    stored); None when there is none."""
    narrow = isinstance(k_cache, Int8Blocks) or k_cache.dtype != q.dtype
    for g in meta.groups:
        out[g.start:g.end] = _attend_group(q, k_cache, v_cache, g)
    for i in meta.singles:
        rows = slice(meta.starts[i], meta.starts[i] + meta.q_lens[i])
        if meta.ctx_lens[i] == 0 and not narrow:
            ki, vi = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            ki, vi = (_gather(c, meta, i, q.dtype) for c in (k_cache, v_cache))
        out[rows] = sdpa_attention(q[rows].transpose(0, 1)[None], ki[None], vi[None])[0] \
            .transpose(0, 1)
    return out


def _gather(cache: KVCache, meta: PagedMetadata, i: int, dtype: torch.dtype) -> torch.Tensor:
    """Sequence i's cached keys or values -> [Hkv, seq_len, D] in ``dtype``."""
    n = meta.ctx_lens[i] + meta.q_lens[i]
    blocks = meta.block_tables[i, :-(-n // meta.block_size)].long()
    return read_blocks(cache, blocks, dtype).flatten(0, 1)[:n].transpose(0, 1)


def _attend_group(q: torch.Tensor, k_cache: KVCache, v_cache: KVCache,
                  g: QueryGroup) -> torch.Tensor:
    """The group's rows of the output, [end - start, Hq, D]. Whole blocks are gathered (a few
    large copies, much faster than one per token); the query heads sharing a KV head are stacked
    on the query axis, so K/V are not copied per head."""
    hq, d = q.shape[1:]
    hkv = k_cache.shape[2]
    b, n_q, grp = g.last - g.first, g.q_slots, hq // hkv
    keys, values = (read_blocks(c, g.blocks, q.dtype).view(b, -1, hkv, d).transpose(1, 2)
                    for c in (k_cache, v_cache))                           # [B, Hkv, L, D]
    qg = q.index_select(0, g.pad_rows).view(b, n_q, hkv, grp, d).permute(0, 2, 3, 1, 4)
    out = F.scaled_dot_product_attention(qg.reshape(b, hkv, grp * n_q, d), keys, values,
                                         attn_mask=g.mask)
    out = out.view(b, hkv, grp, n_q, d).permute(0, 3, 1, 2, 4).reshape(b * n_q, hq, d)
    return out.index_select(0, g.real)


def triton_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: KVCache, v_cache: KVCache,
                           meta: PagedMetadata) -> torch.Tensor:
    """The same contract through the Triton paged kernels (compiled on CUDA, else interpreted);
    caches in q's dtype only."""
    if meta.has_masks:
        return sdpa_paged_attention(q, k, v, k_cache, v_cache, meta)
    from ..device import setup_triton

    setup_triton()  # before the kernel module is first imported
    from ..kernels.paged_attention import paged_decode_attention, paged_prefill_attention

    if meta.max_q_len == 1:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      check_values=False)[0]
    return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                   meta.seq_lens, max_seqlen_q=meta.max_q_len,
                                   check_values=False)[0]


def cpu_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        k_cache: KVCache, v_cache: KVCache,
                        meta: PagedMetadata) -> torch.Tensor:
    """The same contract, ``meta.direct`` through the C++ kernel (metadata built with
    ``direct=True``), the rest as :func:`sdpa_paged_attention`."""
    from ..kernels import cpu_paged_attention as kernel

    out = torch.empty_like(q)
    if meta.direct is not None and meta.direct.numel():
        kernel.attend_in_place(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                               meta.cu_seqlens_q, meta.direct, out, row_bits=meta.row_bits,
                               mask_from=meta.mask_from)
    return attend_groups_and_singles(q, k, v, k_cache, v_cache, meta, out)


PagedAttentionFn = Callable[..., torch.Tensor]


class PagedAttentionBackend(Protocol):
    """The engine's paged attention: called once per layer per step over the whole flat batch,
    as ``backend(q, k, v, k_cache, v_cache, meta)``.

    - q: [N, Hq, D], the queries of the step's N new tokens (RoPE applied), sequence after
      sequence: sequence s owns rows ``meta.starts[s]`` .. ``+ meta.q_lens[s]``
      (``meta.cu_seqlens_q``).
    - k, v: [N, Hkv, D], the same tokens' keys and values, *already written* into the caches at
      ``meta.slot_mapping``. Hq is a multiple of Hkv: query head h reads KV head
      h // (Hq // Hkv).
    - k_cache, v_cache: [num_blocks, block_size, Hkv, D], this layer's pool. Position p of
      sequence s sits in block ``meta.block_tables[s, p // block_size]`` at offset
      ``p % block_size``; s has ``meta.seq_lens[s] = ctx_lens[s] + q_lens[s]`` positions.
      In q's dtype, unless the backend declares ``narrow_kv`` and the engine stores its KV
      narrower (``kv_cache_dtype``): then a tensor of a narrower float dtype, or an
      :class:`~minillm.attention.kv_quant.Int8Blocks` (``read_blocks`` reads either).
    - meta: :class:`PagedMetadata`.

    Returns [N, Hq, D] in q's dtype: row j of sequence s (position ``ctx_lens[s] + j``) is the
    softmax(q k^T / sqrt(D)) v of that query over positions 0 .. ctx_lens[s] + j of s (causal).
    A sequence with a tree mask (``meta.has_masks``; speculative decoding, chapter 06) sees its
    whole cached prefix and the new tokens its mask allows; its mask is only in its padded
    group (``meta.groups``), so a backend that does not read the groups hands such a step to
    :func:`sdpa_paged_attention`. The backend writes neither the caches nor its inputs.

    What it declares (plain attributes, which the runner reads every step):

    - ``name``: how the engine reports it (``runner.attention_backend``).
    - ``reads_direct``: True: the runner builds the metadata with ``direct=True``, so
      ``meta.direct`` lists every sequence without a tree mask and those sequences are in
      neither ``meta.groups`` nor ``meta.singles``: the backend attends them itself, reading
      the blocks in place. False: ``meta.direct`` is None and the groups and singles cover
      every sequence (a backend may ignore them and use the per-sequence fields alone).
    - ``cpu_fast_path``: True allows the runner to run a whole CPU step through the C++
      forward (:class:`~minillm.engine.cpu_forward.CpuForward`), which calls the C++ paged
      kernel itself instead of this backend: only for a backend that computes exactly that
      kernel's attention. A backend that must see every call (a recorder, a student's
      version) says False, and the step runs eagerly through it.
    - ``narrow_kv`` (optional, default False): it reads caches stored in another format than
      q's dtype (a narrower float or int8, above); ``kv_cache_dtype`` other than the model's
      needs such a backend.
    """

    name: str
    reads_direct: bool
    cpu_fast_path: bool

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: KVCache, v_cache: KVCache,
                 meta: PagedMetadata) -> torch.Tensor: ...


@dataclass(frozen=True)
class FunctionBackend:
    """A paged attention function with what it declares: the package's named backends."""

    name: str
    fn: PagedAttentionFn
    reads_direct: bool = False
    cpu_fast_path: bool = False
    narrow_kv: bool = False

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: KVCache, v_cache: KVCache,
                 meta: PagedMetadata) -> torch.Tensor:
        return self.fn(q, k, v, k_cache, v_cache, meta)


PAGED_BACKENDS: dict[str, PagedAttentionBackend] = {
    "sdpa": FunctionBackend("sdpa", sdpa_paged_attention, narrow_kv=True),
    "triton": FunctionBackend("triton", triton_paged_attention),
    "cpu": FunctionBackend("cpu", cpu_paged_attention, reads_direct=True, cpu_fast_path=True,
                           narrow_kv=True),
}


def check_kv_format(backend: PagedAttentionBackend, kv_dtype: torch.dtype,
                    dtype: torch.dtype) -> None:
    """ValueError naming ``kv_cache_dtype`` unless ``backend`` reads a cache stored as
    ``kv_dtype`` for a model computing in ``dtype``."""
    if kv_dtype != dtype and not getattr(backend, "narrow_kv", False):
        readers = sorted(n for n, b in PAGED_BACKENDS.items() if b.narrow_kv)
        raise ValueError(f"kv_cache_dtype {str(kv_dtype).removeprefix('torch.')!r} differs from "
                         f"the model's {str(dtype).removeprefix('torch.')} and attention backend "
                         f"{backend.name!r} reads only caches in the model's dtype; use one of "
                         f"{readers} or kv_cache_dtype='auto'")


def default_paged_backend(device: torch.device, dtype: torch.dtype,
                          kv_dtype: torch.dtype | None = None) -> str:
    """triton on CUDA (sdpa for a KV cache stored narrower than ``dtype``, which the Triton
    kernels do not read); on the CPU the C++ kernel where it builds and takes ``dtype``, else
    sdpa."""
    if device.type == "cuda":
        return "triton" if kv_dtype in (None, dtype) else "sdpa"
    from ..kernels import cpu_paged_attention as kernel

    return "cpu" if device.type == "cpu" and dtype in kernel.DTYPES and kernel.available() \
        else "sdpa"


def check_paged_backend(backend: object) -> PagedAttentionBackend:
    """``backend`` if it implements :class:`PagedAttentionBackend`, else ValueError naming
    ``attention_backend`` and every member that is missing or of the wrong kind."""
    problems = [] if callable(backend) else \
        ["it must be callable as backend(q, k, v, k_cache, v_cache, meta)"]
    if not isinstance(getattr(backend, "name", None), str):
        problems.append("it needs a str attribute `name`")
    for flag in ("reads_direct", "cpu_fast_path"):
        if not isinstance(getattr(backend, flag, None), bool):
            problems.append(f"it needs a bool attribute `{flag}`")
    if problems:
        raise ValueError(f"attention_backend must be one of {sorted(PAGED_BACKENDS)} or an "
                         f"object implementing PagedAttentionBackend; the "
                         f"{type(backend).__name__} given does not: {'; '.join(problems)}")
    return backend                                  # type: ignore[return-value]


def get_paged_backend(backend: str | PagedAttentionBackend) -> PagedAttentionBackend:
    """The paged attention backend called ``backend`` (sdpa, triton: the names the model's dense
    backends use, :data:`minillm.attention.BACKENDS`; cpu), or ``backend`` itself once checked
    (:func:`check_paged_backend`)."""
    if not isinstance(backend, str):
        return check_paged_backend(backend)
    try:
        return PAGED_BACKENDS[backend]
    except KeyError:
        raise ValueError(f"attention_backend must be one of {sorted(PAGED_BACKENDS)} or an "
                         f"object implementing PagedAttentionBackend, got {backend!r}") from None
