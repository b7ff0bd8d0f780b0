"""KV caches that keep a bounded number of tokens: sliding window, attention sinks, H2O.

Each keeps at most ``capacity`` tokens per layer between forward passes. During a pass over T
new tokens the new queries attend over everything kept *plus* the T new tokens (causally), and
only then are tokens evicted. So in token-by-token decoding a query sees ``capacity + 1`` keys
(the kept ones and itself), and a prompt longer than the capacity is still prefilled in one
pass: it attends over all of itself, then the cache shrinks back to ``capacity``.

Positions. Keys keep the RoPE rotation of their *original* positions: a query at position p
sees a kept key from position j at relative distance p - j, exactly as in the full model, and
the tokens evicted in between leave a gap. A bounded cache is then just full attention with
some keys masked out, which is what the tests check. StreamingLLM (Xiao et al. 2023) instead
caches keys before RoPE and rotates them by their *slot* in the cache, so the model only ever
sees positions 0..window-1 and can stream past the context length it was trained on. The texts
of chapter 02 stay far inside SmolLM2's 8192-token context, so we keep the simpler choice.
"""
from __future__ import annotations

import torch

from ..attention import AttentionFn, reference_attention
from ..config import ModelConfig
from .base import Cache


class SlidingWindowCache(Cache):
    """Keeps the last ``window`` tokens in a ring buffer, one [B, H_kv, window, hd] per layer.

    The token at position p lives in slot ``p % window``; a new token overwrites the oldest
    one. Slot order does not matter to attention: every kept key is older than every new query,
    so all of them are visible. Buffers are allocated at the first ``attend`` with the batch
    size, dtype and device of the keys.
    """

    def __init__(self, cfg: ModelConfig, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.cfg = cfg
        self.window = window
        self.n_sink = 0  # slots [0, n_sink) are pinned to the first tokens (SinkCache)
        self.seen = 0
        self.k: list[torch.Tensor | None] = [None] * cfg.n_layers
        self.v: list[torch.Tensor | None] = [None] * cfg.n_layers
        self.slot_pos = torch.full((window,), -1, dtype=torch.long)  # position held by a slot
        self._plan: tuple[int, int, torch.Tensor, torch.Tensor] | None = None

    @property
    def capacity(self) -> int:
        """Most tokens kept between forward passes."""
        return self.window

    def _survivors(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For T new tokens: (indices [S] of those that stay, their slots [S]), S <= window.

        The first ``n_sink`` positions stay in their own slots; the others share a ring of
        ``window - n_sink`` slots, so only the last ``window - n_sink`` of them survive.
        """
        if self._plan is not None and self._plan[:2] == (self.seen, t):
            return self._plan[2], self._plan[3]
        ring = self.window - self.n_sink
        pos = torch.arange(self.seen, self.seen + t)
        keep = (pos < self.n_sink) | (pos >= self.seen + t - ring)
        src = keep.nonzero().flatten()
        kept = pos[src]
        slots = torch.where(kept < self.n_sink, kept, self.n_sink + (kept - self.n_sink) % ring)
        self._plan = (self.seen, t, src, slots)
        return src, slots

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """k, v [B, H_kv, T, hd] -> (kept + new) k, v [B, H_kv, min(seen, window) + T, hd].

        The new tokens that survive eviction are written into their ring slots.
        """
        if self.k[layer] is None:
            shape = (k.shape[0], k.shape[1], self.window, k.shape[3])
            self.k[layer] = k.new_zeros(shape)
            self.v[layer] = v.new_zeros(shape)
        k_buf, v_buf = self.k[layer], self.v[layer]
        if k.shape[0] != k_buf.shape[0]:
            raise ValueError(f"batch size {k.shape[0]} differs from the cache's {k_buf.shape[0]}")
        n_old = len(self)
        k_all = torch.cat([k_buf[:, :, :n_old], k], dim=2)
        v_all = torch.cat([v_buf[:, :, :n_old], v], dim=2)
        src, slots = self._survivors(k.shape[2])
        src, slots = src.to(k.device), slots.to(k.device)
        k_buf.index_copy_(2, slots, k.index_select(2, src))
        v_buf.index_copy_(2, slots, v.index_select(2, src))
        return k_all, v_all

    def advance(self, t: int) -> None:
        src, slots = self._survivors(t)
        self.slot_pos[slots] = self.seen + src
        self._plan = None
        super().advance(t)

    def __len__(self) -> int:
        return min(self.seen, self.window)

    def kept_positions(self, layer: int = 0) -> torch.Tensor:
        """Positions of the kept tokens, sorted: [B, H_kv, len] (the same for every layer/head)."""
        b = 1 if self.k[layer] is None else self.k[layer].shape[0]
        pos = self.slot_pos[: len(self)].sort().values
        return pos.expand(b, self.cfg.n_kv_heads, -1)

    def nbytes(self) -> int:
        return sum(2 * x.numel() * x.element_size() for x in self.k if x is not None)


class SinkCache(SlidingWindowCache):
    """StreamingLLM's cache: the first ``n_sink`` tokens plus the most recent ones, ``window``
    in total (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks").

    Models learn to park surplus attention on the first tokens (the "attention sinks");
    a plain sliding window evicts them and the softmax mass has nowhere to go. Pinning them
    keeps perplexity flat. Implementation: the sliding-window ring with slots [0, n_sink)
    reserved for positions [0, n_sink). Keys keep their original RoPE positions (see the
    module docstring for how StreamingLLM's re-rotation differs).
    """

    def __init__(self, cfg: ModelConfig, window: int, n_sink: int = 4) -> None:
        if not 0 <= n_sink < window:
            raise ValueError(f"n_sink must be in [0, window={window}), got {n_sink}")
        super().__init__(cfg, window)
        self.n_sink = n_sink


class H2OCache(Cache):
    """Heavy-Hitter Oracle (Zhang et al. 2023): keep the ``n_recent`` most recent tokens plus
    the ``budget - n_recent`` tokens that have received the most attention so far.

    Each kept token carries a score: the attention probability it received, summed over every
    query so far and over the query heads that share its KV head. Heads choose independently,
    so per layer the cache holds k, v [B, H_kv, L, hd], scores [B, H_kv, L] and positions
    [B, H_kv, L], L <= budget, each head's tokens in position order. Attention is computed
    explicitly (``reference_attention``) because the scores need the probabilities.
    Keys keep their original RoPE positions (see the module docstring).
    """

    def __init__(self, cfg: ModelConfig, budget: int, n_recent: int) -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        if not 0 <= n_recent <= budget:
            raise ValueError(f"n_recent must be in [0, budget={budget}], got {n_recent}")
        self.cfg = cfg
        self.budget = budget
        self.n_recent = n_recent
        self.seen = 0
        empty = [None] * cfg.n_layers
        self.k: list[torch.Tensor | None] = list(empty)
        self.v: list[torch.Tensor | None] = list(empty)
        self.score: list[torch.Tensor | None] = list(empty)
        self.pos: list[torch.Tensor | None] = list(empty)

    @property
    def capacity(self) -> int:
        """Most tokens kept between forward passes."""
        return self.budget

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_fn: AttentionFn | None = None) -> torch.Tensor:
        """q [B, H, T, hd], k/v [B, H_kv, T, hd] -> [B, H, T, hd]; then scores and eviction.

        ``attn_fn`` (the layer's backend) is ignored: H2O needs the attention probabilities,
        so it always uses ``reference_attention``.
        """
        b, h_kv, t, _ = k.shape
        new_pos = torch.arange(self.seen, self.seen + t, device=k.device).expand(b, h_kv, t)
        if self.k[layer] is None:
            k_all, v_all, pos = k, v, new_pos
            score = k.new_zeros((b, h_kv, t), dtype=torch.float32)
        else:
            k_all = torch.cat([self.k[layer], k], dim=2)
            v_all = torch.cat([self.v[layer], v], dim=2)
            pos = torch.cat([self.pos[layer], new_pos], dim=2)
            score = torch.cat([self.score[layer], self.score[layer].new_zeros((b, h_kv, t))], 2)
        out, probs = reference_attention(q, k_all, v_all, return_probs=True)
        score = score + received_attention(probs, h_kv)
        if k_all.shape[2] > self.budget:
            idx = self._keep(score, pos, self.seen + t)
            k_all = k_all.gather(2, idx[..., None].expand(-1, -1, -1, k.shape[3]))
            v_all = v_all.gather(2, idx[..., None].expand(-1, -1, -1, v.shape[3]))
            score, pos = score.gather(2, idx), pos.gather(2, idx)
        self.k[layer], self.v[layer], self.score[layer], self.pos[layer] = k_all, v_all, score, pos
        return out

    def _keep(self, score: torch.Tensor, pos: torch.Tensor, end: int) -> torch.Tensor:
        """Indices [B, H_kv, budget] (in position order) of the tokens that stay.

        score, pos [B, H_kv, L]; ``end`` is the position after the newest token.
        """
        recent = pos >= end - self.n_recent
        priority = score.masked_fill(recent, float("inf"))
        return priority.topk(self.budget, dim=-1).indices.sort(dim=-1).values

    def __len__(self) -> int:
        return min(self.seen, self.budget)

    def kept_positions(self, layer: int = 0) -> torch.Tensor:
        """Positions of the kept tokens, sorted per head: [B, H_kv, len]."""
        if self.pos[layer] is None:
            return torch.empty((1, self.cfg.n_kv_heads, 0), dtype=torch.long)
        return self.pos[layer]

    def nbytes(self) -> int:
        return sum(2 * x.numel() * x.element_size() for x in self.k if x is not None)


def received_attention(probs: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """probs [B, H, T, L] -> attention each key received [B, H_kv, L] (fp32).

    Summed over the T queries and over the H / H_kv query heads that share each KV head
    (query head h uses KV head h // group, as in ``repeat_interleave``).
    """
    b, h, _, l = probs.shape
    return probs.float().sum(dim=2).view(b, n_kv_heads, h // n_kv_heads, l).sum(dim=2)
