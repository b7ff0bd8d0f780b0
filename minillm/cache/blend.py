"""CacheBlend: reuse the KV of every retrieved chunk, recompute a few tokens to restore quality.

Yao et al., "CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge
Fusion" (EuroSys 2025). A RAG prompt is ``[chunk_1, ..., chunk_n, suffix]``; each chunk's KV is
precomputed *alone*, as if the chunk opened a prompt (:func:`precompute_chunk`).

- Prefix caching (:func:`prefix_prefill`) can reuse only chunk_1: the KV of chunk_i > 1 depends
  on the chunks before it.
- Full KV reuse (:func:`full_reuse`) concatenates every chunk's KV. RoPE is relative, so K
  computed at position p and rotated by delta equals K computed at p + delta from the same
  hidden input (:func:`reposition`); but the hidden inputs differ from layer 1 on, since a chunk
  computed alone never attended to the chunks before it: the cross-attention is lost.
- CacheBlend (:func:`blend_prefill`) starts from the reused KV and, layer by layer, recomputes
  only the tokens whose KV deviates most from what a full prefill would give (the paper's
  "HKVD" tokens). The first ``check_layers`` layers recompute every token (layer 0's KV is exact
  anyway: its input is the embedding). At layer ``check_layers`` the K/V projections of all
  tokens are compared with the reused ones, deviation = ||K_new - K_old||^2 + ||V_new - V_old||^2
  per token (summed over heads and dims), and the top tokens (:func:`select_tokens`) go on;
  with ``gradual`` (the paper's "gradual filtering") the next layers each keep the
  highest-deviation subset of the previous selection, 2r -> 5r/3 -> 4r/3 -> r of the reused
  tokens (:func:`selection_schedule`), then the selection stays. The suffix has no cached KV
  and is always recomputed. A recomputed token's fresh K/V overwrite the reused ones at that
  layer; its query attends over the whole blended KV, causally by position.

The paper reports 2.2-3.3x lower time-to-first-token than full recompute while recomputing
about 15% of the tokens, with quality (F1, Rouge-L) close to full recompute and far above full
reuse. Every prefill here returns a :class:`BlendResult` (logits, a decodable :class:`KVCache`,
the recomputed tokens per layer, wall time) so a benchmark can compare TTFT and quality.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import AttentionFn
from ..config import ModelConfig
from ..device import sync
from ..model.layers import apply_rope, rope_cos_sin
from .base import Cache
from .contiguous import KVCache

#: layers of gradual filtering after the first selection: fractions 2r, 5r/3, 4r/3, then r
GRADUAL_STEPS = 3


@dataclass
class ChunkKV:
    """One chunk's KV computed alone: k, v [n_layers, H_kv, T, hd], K rotated at 0..T-1."""

    token_ids: list[int]
    k: torch.Tensor
    v: torch.Tensor

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V together (what a KV store keeps for this chunk)."""
        return (self.k.numel() + self.v.numel()) * self.k.element_size()


@dataclass
class BlendResult:
    """A prefill's outcome.

    ``logits`` [vocab] after the last prompt token (fp32; fp64 for a fp64 model). ``cache``
    (batch 1) holds the KV of all L prompt tokens, ``cache.seen == L``, with room for
    ``max_new_tokens`` more: ``model(ids, cache=cache)`` decodes on from position L.
    ``selected``: layer -> the prompt positions computed at that layer (LongTensor, ascending,
    suffix included). ``recomputed_fraction``: computed (token, layer) pairs among the chunk
    tokens over (chunk tokens x layers); 1.0 for a full prefill. ``seconds``: wall time.
    """

    logits: torch.Tensor
    cache: KVCache
    selected: dict[int, torch.Tensor]
    recomputed_fraction: float
    seconds: float

    @property
    def length(self) -> int:
        """Prompt tokens in the cache."""
        return self.cache.seen


def _check_ids(name: str, ids: list[int], cfg: ModelConfig) -> None:
    if len(ids) == 0:
        raise ValueError(f"{name} must hold at least one token id")
    bad = [i for i in ids if not 0 <= int(i) < cfg.vocab_size]
    if bad:
        raise ValueError(f"{name}: token ids must be in [0, {cfg.vocab_size}), got {bad[:5]}")


def _check_length(name: str, length: int, cfg: ModelConfig) -> None:
    if length > cfg.max_seq_len:
        raise ValueError(f"{name}: {length} tokens exceed the context window "
                         f"max_seq_len={cfg.max_seq_len}")


@torch.no_grad()
def precompute_chunk(model, token_ids: list[int]) -> ChunkKV:
    """The chunk's KV computed alone from position 0 (one cached forward): what a KV store keeps."""
    _check_ids("token_ids", token_ids, model.cfg)
    _check_length("token_ids", len(token_ids), model.cfg)
    cache = KVCache(model.cfg, 1, len(token_ids), model.device, model.dtype)
    model.hidden_states(torch.tensor([list(token_ids)], device=model.device), cache)
    return ChunkKV(list(token_ids), cache.k[:, 0].clone(), cache.v[:, 0].clone())


def reposition(k: torch.Tensor, offset: int, cfg: ModelConfig) -> torch.Tensor:
    """K [..., T, hd] rotated at positions 0..T-1 -> the same K at offset..offset+T-1.

    RoPE rotates each (i, i + hd/2) pair by position x theta^(-2i/hd); rotations add, so every
    token is rotated once more by offset's angle (float32 math at least, k's dtype out).
    """
    work = torch.promote_types(k.dtype, torch.float32)
    pos = torch.full((k.shape[-2],), offset, device=k.device)
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, work)
    return apply_rope(k.to(work), cos, sin).to(k.dtype)


def select_tokens(deviation: torch.Tensor, num: int,
                  always: torch.Tensor | None = None) -> torch.Tensor:
    """Indices to recompute: every index in ``always`` plus the ``num`` other indices of
    largest ``deviation`` [T]; ties go to the lower index (stable sort). ``num`` is clipped to
    [0, what is left]. Returns a LongTensor sorted ascending."""
    if deviation.dim() != 1:
        raise ValueError(f"deviation must be 1-D [T], got shape {tuple(deviation.shape)}")
    n = deviation.shape[0]
    free = torch.ones(n, dtype=torch.bool, device=deviation.device)
    if always is not None:
        free[always.long()] = False
    candidates = free.nonzero().flatten()
    order = torch.sort(deviation[candidates], descending=True, stable=True).indices
    picked = candidates[order[:max(0, min(int(num), candidates.numel()))]]
    return torch.cat([(~free).nonzero().flatten(), picked]).sort().values


def selection_schedule(n_layers: int, recompute_ratio: float, check_layers: int = 1,
                       gradual: bool = True) -> dict[int, float]:
    """{layer: fraction of the chunk tokens kept from that layer on}; layers before
    ``check_layers`` recompute everything (fraction 1), layers not named keep the selection."""
    steps = GRADUAL_STEPS if gradual else 0
    fractions = {check_layers + s: min(1.0, recompute_ratio * (2 - s / steps))
                 for s in range(steps)}
    fractions[check_layers + steps] = recompute_ratio
    return {layer: f for layer, f in fractions.items() if layer < n_layers}


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      rows: torch.Tensor) -> torch.Tensor:
    """q [1, H, T, hd] at positions ``rows`` [T], k/v [1, H_kv, L, hd] at 0..L-1 -> [1, H, T, hd]:
    query i sees key j when j <= rows[i] (GQA folded into the query axis as in sdpa.py)."""
    b, h, t, hd = q.shape
    group = h // k.shape[1]
    mask = torch.arange(k.shape[2], device=q.device)[None, :] <= rows[:, None]
    out = F.scaled_dot_product_attention(q.reshape(b, k.shape[1], group * t, hd), k, v,
                                         attn_mask=mask.repeat(group, 1))
    return out.reshape(b, h, t, hd)


class BlendCache(Cache):
    """The cache of one selective pass. ``kv`` starts with the reused KV at every position;
    ``rows`` are the positions being computed (ascending). At a layer of ``fractions``,
    :meth:`attend` measures the deviation of the rows' fresh K/V from the reused, keeps the top
    ones (``keep``: local indices, None = all), writes the kept rows' K/V and attends their
    queries over the whole blended KV; the dropped rows' outputs are zeros."""

    def __init__(self, kv: KVCache, length: int, n_reused: int, fractions: dict[int, float]):
        self.kv, self.length, self.n_reused, self.fractions = kv, length, n_reused, fractions
        self.rows = torch.arange(length, device=kv.k.device)
        self.keep: torch.Tensor | None = None
        self.n_in = length  # rows the current layer was called with
        self.selected: dict[int, torch.Tensor] = {}

    def deviation(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[T]: ||K_new - K_reused||^2 + ||V_new - V_reused||^2 per row (fp32)."""
        old_k = self.kv.k[layer][:, :, self.rows].float()
        old_v = self.kv.v[layer][:, :, self.rows].float()
        return ((k.float() - old_k) ** 2 + (v.float() - old_v) ** 2).sum(dim=(0, 1, 3))

    def _narrow(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keep, self.n_in = None, len(self.rows)
        if layer in self.fractions:
            num = math.floor(self.fractions[layer] * self.n_reused + 0.5)
            always = (self.rows >= self.n_reused).nonzero().flatten()
            self.keep = select_tokens(self.deviation(layer, k, v), num, always)
            self.rows = self.rows[self.keep]
        self.selected[layer] = self.rows

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_fn: AttentionFn) -> torch.Tensor:
        self._narrow(layer, k, v)
        if self.keep is not None:
            q, k, v = q[:, :, self.keep], k[:, :, self.keep], v[:, :, self.keep]
        self.kv.k[layer].index_copy_(2, self.rows, k)
        self.kv.v[layer].index_copy_(2, self.rows, v)
        k_all, v_all = self.kv.k[layer, :, :, :self.length], self.kv.v[layer, :, :, :self.length]
        if len(self.rows) == self.length:  # every position: the model's own causal attention
            out = attn_fn(q, k_all, v_all)
        else:
            out = _masked_attention(q, k_all, v_all, self.rows)
        if self.keep is None:
            return out
        full = out.new_zeros(out.shape[0], out.shape[1], self.n_in, out.shape[3])
        return full.index_copy_(2, self.keep, out)

    def __len__(self) -> int:
        return self.length


def _prompt_ids(cfg: ModelConfig, chunks: list[ChunkKV], suffix_ids: list[int]) -> list[int]:
    """The RAG prompt's token ids [chunk_1 .. chunk_n, suffix]; ValueError naming the parameter
    for a bad one."""
    if len(chunks) == 0:
        raise ValueError("chunks must hold at least one ChunkKV")
    for i, c in enumerate(chunks):
        _check_ids(f"chunks[{i}].token_ids", c.token_ids, cfg)
        shape = (cfg.n_layers, cfg.n_kv_heads, len(c), cfg.head_dim)
        if tuple(c.k.shape) != shape or tuple(c.v.shape) != shape:
            raise ValueError(f"chunks[{i}]: k and v must have shape {shape} (n_layers, n_kv_heads,"
                             f" T, head_dim), got {tuple(c.k.shape)} and {tuple(c.v.shape)}")
    _check_ids("suffix_ids", suffix_ids, cfg)
    ids = [t for c in chunks for t in c.token_ids] + list(suffix_ids)
    _check_length("chunks + suffix_ids", len(ids), cfg)
    return ids


def _new_cache(model, length: int, max_new_tokens: int) -> KVCache:
    """A batch-1 KVCache for ``length`` prompt tokens plus room to decode (within the window)."""
    room = max(0, min(max_new_tokens, model.cfg.max_seq_len - length))
    return KVCache(model.cfg, 1, length + room, model.device, model.dtype)


def _place(cache: KVCache, chunks: list[ChunkKV], cfg: ModelConfig) -> int:
    """Write the chunks' KV one after another, K repositioned; return the tokens placed."""
    offset = 0
    for c in chunks:
        end = offset + len(c)
        cache.k[:, 0, :, offset:end] = reposition(c.k, offset, cfg) if offset else c.k
        cache.v[:, 0, :, offset:end] = c.v
        offset = end
    return offset


def _finish(model, cache: KVCache, logits: torch.Tensor, selected: dict[int, torch.Tensor],
            n_reused: int, t0: float) -> BlendResult:
    """Stop the clock and count the recomputed (chunk token, layer) pairs."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    sync(model.device)
    seconds = time.perf_counter() - t0
    pairs = sum(int((rows < n_reused).sum()) for rows in selected.values())
    return BlendResult(logits, cache, selected, pairs / (n_reused * model.cfg.n_layers), seconds)


def _run_layers(model, input_ids: torch.Tensor, cache: BlendCache) -> torch.Tensor:
    """Block.forward on the rows ``cache`` keeps: input_ids [1, L] -> normed hidden [1, 1, D] of
    the last position (the suffix's last token is always kept)."""
    cfg = model.cfg
    x = model.embed(input_ids)
    for block in model.layers:
        cos, sin = rope_cos_sin(cache.rows, cfg.head_dim, cfg.rope_theta, model.dtype)
        a = block.attn(block.attn_norm(x), cos[None, None], sin[None, None], cache)
        if cache.keep is not None:
            x, a = x[:, cache.keep], a[:, cache.keep]
        x = x + a
        x = x + block.ffn(block.ffn_norm(x))
    return model.norm(x[:, -1:])


@torch.no_grad()
def blend_prefill(model, chunks: list[ChunkKV], suffix_ids: list[int],
                  recompute_ratio: float = 0.15, check_layers: int = 1, gradual: bool = True,
                  max_new_tokens: int = 64) -> BlendResult:
    """CacheBlend prefill of [chunk_1 .. chunk_n, suffix] from the chunks' cached KV.

    Layers < ``check_layers`` recompute every token; from layer ``check_layers`` on only the
    suffix and the selected chunk tokens (:func:`selection_schedule`, ``recompute_ratio`` of
    the chunk tokens in the end). ``max_new_tokens``: decoding room left in the cache.
    """
    if not 0.0 <= recompute_ratio <= 1.0:
        raise ValueError(f"recompute_ratio must be in [0, 1], got {recompute_ratio}")
    if not 0 <= check_layers <= model.cfg.n_layers:
        raise ValueError(f"check_layers must be in [0, n_layers={model.cfg.n_layers}], "
                         f"got {check_layers}")
    ids = _prompt_ids(model.cfg, chunks, suffix_ids)
    length, t0 = len(ids), time.perf_counter()
    kv = _new_cache(model, length, max_new_tokens)
    n_reused = _place(kv, chunks, model.cfg)
    fractions = selection_schedule(model.cfg.n_layers, recompute_ratio, check_layers, gradual)
    cache = BlendCache(kv, length, n_reused, fractions)
    h = _run_layers(model, torch.tensor([ids], device=model.device), cache)
    kv.seen = length
    return _finish(model, kv, model.lm_head(h)[0, -1], cache.selected, n_reused, t0)


def full_reuse(model, chunks: list[ChunkKV], suffix_ids: list[int],
               max_new_tokens: int = 64) -> BlendResult:
    """Naive concatenation: every chunk's KV reused as is (K repositioned), only the suffix
    computed (a blend with recompute_ratio 0 and no check layer)."""
    return blend_prefill(model, chunks, suffix_ids, 0.0, check_layers=0, gradual=False,
                         max_new_tokens=max_new_tokens)


@torch.no_grad()
def prefix_prefill(model, chunks: list[ChunkKV], suffix_ids: list[int],
                   max_new_tokens: int = 64) -> BlendResult:
    """Prefix caching: chunk_1's KV reused (it is exact), the other chunks and the suffix
    computed in one cached forward."""
    ids = _prompt_ids(model.cfg, chunks, suffix_ids)
    length, t0 = len(ids), time.perf_counter()
    cache = _new_cache(model, length, max_new_tokens)
    cache.seen = n = _place(cache, chunks[:1], model.cfg)
    logits = model(torch.tensor([ids[n:]], device=model.device), cache=cache, last_only=True)
    rows = torch.arange(n, length, device=model.device)
    selected = {layer: rows for layer in range(model.cfg.n_layers)}
    return _finish(model, cache, logits[0, -1], selected, length - len(suffix_ids), t0)


@torch.no_grad()
def full_prefill(model, token_ids: list[int], max_new_tokens: int = 64) -> BlendResult:
    """The reference: the whole prompt [T] computed in one forward (recomputed_fraction 1)."""
    _check_ids("token_ids", token_ids, model.cfg)
    _check_length("token_ids", len(token_ids), model.cfg)
    t0 = time.perf_counter()
    cache = _new_cache(model, len(token_ids), max_new_tokens)
    logits = model(torch.tensor([list(token_ids)], device=model.device), cache=cache,
                   last_only=True)
    rows = torch.arange(len(token_ids), device=model.device)
    selected = {layer: rows for layer in range(model.cfg.n_layers)}
    return _finish(model, cache, logits[0, -1], selected, len(token_ids), t0)


def _fork(model, cache: KVCache, extra: int) -> KVCache:
    """A copy of ``cache``'s first ``seen`` positions with room for ``extra`` more."""
    n = cache.seen
    new = KVCache(model.cfg, 1, n + max(extra, 1), model.device, model.dtype)
    new.k[:, :, :, :n] = cache.k[:, :, :, :n]
    new.v[:, :, :, :n] = cache.v[:, :, :, :n]
    new.seen = n
    return new


@torch.no_grad()
def greedy_continue(model, result: BlendResult, max_tokens: int) -> list[int]:
    """``max_tokens`` greedy token ids after the prompt (no stop at EOS), decoded from a copy of
    the result's cache (the result is left as it was)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    _check_length("max_tokens", result.length + max_tokens - 1, model.cfg)
    cache = _fork(model, result.cache, max_tokens - 1)
    out = [int(result.logits.argmax())]
    for _ in range(max_tokens - 1):
        x = torch.tensor([[out[-1]]], device=model.device)
        out.append(int(model(x, cache=cache, last_only=True)[0, -1].argmax()))
    return out


@torch.no_grad()
def answer_logits(model, result: BlendResult, answer_ids: list[int]) -> torch.Tensor:
    """Logits [len(answer_ids), vocab] predicting each token of ``answer_ids`` (teacher-forced)
    after the prompt whose KV the result holds (the result is left as it was)."""
    _check_ids("answer_ids", answer_ids, model.cfg)
    _check_length("answer_ids", result.length + len(answer_ids) - 1, model.cfg)
    logits = result.logits[None]
    if len(answer_ids) > 1:
        cache = _fork(model, result.cache, len(answer_ids) - 1)
        rest = model(torch.tensor([answer_ids[:-1]], device=model.device), cache=cache)
        logits = torch.cat([logits, rest[0].to(logits.dtype)])
    return logits


def answer_nll(model, result: BlendResult, answer_ids: list[int]) -> float:
    """Mean negative log-likelihood (nats per token) of ``answer_ids`` following the prompt
    whose KV the result holds; exp() of it is the answer's perplexity."""
    logits = answer_logits(model, result, answer_ids)
    return float(F.cross_entropy(logits, torch.tensor(answer_ids, device=logits.device)))


def answer_match(model, result: BlendResult, answer_ids: list[int]) -> float:
    """Fraction of the answer's tokens that are the greedy choice (teacher-forced) after the
    result's KV: 1.0 for the KV that produced the answer greedily."""
    logits = answer_logits(model, result, answer_ids)
    return float((logits.argmax(-1).cpu() == torch.tensor(answer_ids)).float().mean())
