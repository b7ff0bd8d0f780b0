"""The trained drafters of chapter 06, as plain modules (training: :mod:`.train`; serving: the
proposers in :mod:`.proposers`).

All of them borrow the target's token embedding and output head instead of keeping their own
(SmolLM2 ties the two, 49152 x 576): a drafter's head is the target's output matrix restricted
to a *draft vocabulary*, the ``Vd`` tokens the target emits most often in the training data
(EAGLE-3 and FR-Spec draft over a frequency-ranked sub-vocabulary for the same reason: a full
head would cost a quarter of a target forward per drafted token on this model). A drafted
token is always one of those ids; verification is unchanged, because a draft distribution that
is zero elsewhere is still a valid proposal.

- :class:`DraftLM` (``draft_model``): a small Llama (its own layers, the target's embedding),
  a language model in its own right; it keeps its own KV cache.
- :class:`FeatureDrafter` (``eagle``, ``eagle3``, ``mtp``): one decoder block over the target's
  last hidden state h_t joined with the embedding of the next token x_{t+1}; its output f_t is
  a guess of h_{t+1} and goes through the head to propose x_{t+2}. EAGLE (Li et al. 2024) joins
  them with one linear layer and trains f_t to regress h_{t+1} as well; DeepSeek-V3's MTP
  module (2024) normalises both inputs first (RMSNorm each, then the projection) and trains with
  cross-entropy only, chained for depth. EAGLE-3 (Li et al. 2025) reads, instead of h_t, the
  target's states after a low, a middle and a high layer fused by one linear layer (``fuse``),
  normalises both inputs like MTP, and trains with cross-entropy only, on its own outputs at
  every later step (training-time test, :mod:`.training.eagle3`).
- :class:`MedusaHeads` (``medusa``): K residual heads on the target's last hidden state, head i
  proposing the token i + 1 places after the next (Cai et al. 2024); no cache, no recurrence.
- :class:`BlockDrafter` (``dflash``, also serving ``ddtree`` and ``dspark``): DFlash's block
  drafter (Chen et al. 2026): a few decoder layers that fill a whole block [last token, MASK,
  ..., MASK] in one bidirectional pass, every layer attending to the target's hidden states from
  several layers (joined by one projection) as extra keys and values; plus DSpark's light heads
  (2026): a low-rank Markov term on the previous token and a per-token confidence.

Shapes: D = the target's width, Vd = the draft vocabulary, B batch, T positions.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..model.layers import RMSNorm, rope_cos_sin
from ..model.packed import CpuWeight, can_pack_linears
from ..model.transformer import Block, Transformer, _heads_axis

METHODS = ("draft_model", "eagle", "eagle3", "mtp", "medusa", "dflash")
OOV = -1                     # a target token outside the draft vocabulary


@dataclass(frozen=True)
class DrafterConfig:
    """A drafter's shape. ``layers`` decoder blocks of width ``d_model`` (the target's) with
    the target's heads and ``ffn_dim``; ``num_heads``: Medusa's heads; ``draft_vocab``: Vd.
    A block drafter: ``target_layers`` (the target layers it reads), ``block_size`` (the last
    token plus block_size - 1 drafted ones), ``markov_rank`` (DSpark's heads; 0: none)."""

    method: str
    d_model: int = 576
    layers: int = 1
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    ffn_dim: int = 1536
    rope_theta: float = 100000.0
    norm_eps: float = 1e-5
    num_heads: int = 0
    draft_vocab: int = 8192
    target_layers: tuple[int, ...] = ()
    block_size: int = 0
    markov_rank: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(self.target_layers))
        if self.method == "dflash" and (not self.target_layers or self.block_size < 2):
            raise ValueError("a dflash drafter needs target_layers and block_size >= 2")
        if self.method == "eagle3" and not self.target_layers:
            raise ValueError("an eagle3 drafter needs target_layers (its low, mid, high)")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.method == "medusa" and self.num_heads < 1:
            raise ValueError(f"medusa needs num_heads >= 1, got {self.num_heads}")
        if self.layers < 1 or self.draft_vocab < 1:
            raise ValueError("layers and draft_vocab must be >= 1")

    def block_config(self, vocab_size: int, max_seq_len: int) -> ModelConfig:
        return ModelConfig(name=f"{self.method}-drafter", vocab_size=vocab_size,
                           d_model=self.d_model, n_layers=self.layers, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                           ffn_dim=self.ffn_dim, rope_theta=self.rope_theta,
                           norm_eps=self.norm_eps, max_seq_len=max_seq_len)

    def to_dict(self) -> dict:
        return asdict(self)


class DraftHead(nn.Module):
    """The target's output matrix restricted to the draft vocabulary ``ids`` [Vd] (a buffer;
    the rows are read from the target at load time, not stored)."""

    def __init__(self, target_head: torch.Tensor, ids: torch.Tensor) -> None:
        super().__init__()
        self.vocab_size = target_head.shape[0]
        self.register_buffer("ids", ids.long(), persistent=False)
        self.register_buffer("rows", target_head.detach()[ids.long()], persistent=False)
        self._packed: tuple[int, CpuWeight] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> logits over the draft vocabulary [..., Vd] (the CPU's matmuls on the
        rows laid out once, :class:`~minillm.model.packed.CpuWeight`, where they apply outside
        autograd: 3x faster than a plain matmul at a draft step's few rows)."""
        rows = self.rows
        if x.dtype != rows.dtype or (torch.is_grad_enabled() and x.requires_grad) \
                or not can_pack_linears(rows.device, rows.dtype):
            return x @ rows.to(x.dtype).T
        if self._packed is None or self._packed[0] != rows.data_ptr():
            self._packed = rows.data_ptr(), CpuWeight(rows)
        return self._packed[1](x)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_packed": None}   # a copy lays the rows out again

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., Vd] draft logits -> [..., V] full-vocabulary logits (-inf off the draft vocab)."""
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.ids] = logits
        return out


class FeatureDrafter(nn.Module):
    """EAGLE's drafter (``input_norms`` False), DeepSeek-V3's MTP module or EAGLE-3's (True).

    forward(tokens [B, T, D] embeddings of x_{t+1}, features [B, T, D] target states h_t,
    positions [T]) -> f [B, T, D], each f_t a guess of h_{t+1}; logits = head(f). With
    ``cfg.target_layers`` (EAGLE-3) the features are ``fuse(states)``: states [B, T, m * D],
    the target's residual streams after those m layers, side by side."""

    def __init__(self, cfg: DrafterConfig, block_cfg: ModelConfig, input_norms: bool) -> None:
        super().__init__()
        self.cfg, self.block_cfg = cfg, block_cfg
        d = cfg.d_model
        self.token_norm = RMSNorm(d, cfg.norm_eps) if input_norms else nn.Identity()
        self.feature_norm = RMSNorm(d, cfg.norm_eps) if input_norms else nn.Identity()
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList(Block(block_cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(d, cfg.norm_eps)
        if cfg.target_layers:
            self.fuse = nn.Linear(len(cfg.target_layers) * d, d, bias=False)

    def inputs(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The first block's input rows [..., D] from tokens' embeddings and features [..., D]."""
        return self.proj(torch.cat([self.token_norm(tokens), self.feature_norm(features)], -1))

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache=None) -> torch.Tensor:
        x = self.inputs(tokens, features)
        cos, sin = rope_cos_sin(positions, self.block_cfg.head_dim, self.block_cfg.rope_theta,
                                x.dtype)
        cos, sin = _heads_axis(cos), _heads_axis(sin)
        for layer in self.layers:
            x = layer(x, cos, sin, cache)
        if cache is not None:
            cache.advance(tokens.shape[1])
        return self.norm(x)


class MedusaHeads(nn.Module):
    """K residual heads: head i maps h [.., D] to h + SiLU(W_i h) (W_i starts at zero, so every
    head starts as the target's own next-token head). forward -> [K, .., D]."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.heads = nn.ModuleList(nn.Linear(cfg.d_model, cfg.d_model) for _ in
                                   range(cfg.num_heads))
        for h in self.heads:
            nn.init.zeros_(h.weight)
            nn.init.zeros_(h.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.stack([h + F.silu(head(h)) for head in self.heads])


class MaskedAttention:
    """A stand-in for a KV cache in a dense (training) pass: attention of every row over the
    rows ``mask`` [B, R, R] allows (True: row i sees row j), keys and values of this pass only."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask[:, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_fn=None) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)

    def advance(self, t: int) -> None: ...


class BlockDrafter(nn.Module):
    """DFlash's drafter (and DSpark's heads). Its rows are of two kinds:

    - context rows: c_t = RMSNorm(W [h^(l1)_t, ..., h^(lm)_t]), the target's states at
      committed position t from the layers ``target_layers`` joined and projected; in every
      layer they only give keys and values (the same c_t each layer, its own K/V weights);
    - block rows: the embedding of the last committed token, then ``block_size - 1`` copies
      of a learned MASK vector, at the next positions; they see every context row before
      them and each other (bidirectional), and the output at MASK row i is the guess of the
      token at that position (no shift: it denoises its own position).

    forward(x [B, R, D], is_context [B, R] or [R] bool, positions, cache, mask) -> [B, R, D]
    (normed; context rows' outputs mean nothing). ``cache``: a paged cache at serving time;
    without one, ``mask`` [B, R, R] says who sees whom (:class:`MaskedAttention`).

    DSpark's heads on a block row's output h_i, given the token before it (t_{i-1}, its
    index in the draft vocabulary, Vd for one outside it): ``markov(h_i, prev)`` adds
    (E[prev] * P h_i) @ F^T, a rank-r bilinear term, to the base logits; ``confidence(h_i,
    prev, logp)`` is a logit of P(the drafted token is accepted | all before it were)."""

    def __init__(self, cfg: DrafterConfig, block_cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg, self.block_cfg = cfg, block_cfg
        d, r = cfg.d_model, cfg.markov_rank
        self.fc = nn.Linear(len(cfg.target_layers) * d, d, bias=False)
        self.context_norm = RMSNorm(d, cfg.norm_eps)
        self.mask_embedding = nn.Parameter(torch.randn(d) * 0.02)
        self.layers = nn.ModuleList(Block(block_cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(d, cfg.norm_eps)
        if r:
            self.prev_codes = nn.Embedding(cfg.draft_vocab + 1, r)
            self.next_codes = nn.Parameter(torch.zeros(cfg.draft_vocab, r))
            self.mix = nn.Linear(d, r, bias=False)
            self.confidence_proj = nn.Linear(d + r + 1, 1)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """[..., m * D] joined target states -> context vectors [..., D]."""
        return self.context_norm(self.fc(features))

    def forward(self, x: torch.Tensor, is_context: torch.Tensor, positions: torch.Tensor,
                cache=None, mask: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = rope_cos_sin(positions, self.block_cfg.head_dim, self.block_cfg.rope_theta,
                                x.dtype)
        cos, sin = _heads_axis(cos), _heads_axis(sin)
        cache = cache if cache is not None else MaskedAttention(mask)
        ctx = is_context[..., None]
        c = x
        for layer in self.layers:
            a = layer.attn_norm(x)
            x = x + layer.attn(a, cos, sin, cache, kv=torch.where(ctx, c, a))
            x = torch.where(ctx, c, x + layer.ffn(layer.ffn_norm(x)))
        return self.norm(x)

    def markov(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """h [..., D], prev [...] draft-vocabulary indices -> logit offsets [..., Vd]."""
        return (self.prev_codes(prev) * self.mix(h)) @ self.next_codes.T

    def confidence(self, h: torch.Tensor, prev: torch.Tensor, logp: torch.Tensor
                   ) -> torch.Tensor:
        """h [..., D], prev [...], logp [...] (the drafted token's log-probability) -> [...]
        logits of acceptance."""
        x = torch.cat([h, self.prev_codes(prev), logp[..., None].to(h.dtype)], -1)
        return self.confidence_proj(x)[..., 0]


def eagle3_layers(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers of an n-layer target: 2, n // 2 and n - 3 (fewer
    distinct ones on a very shallow model)."""
    return tuple(sorted({min(2, n_layers - 1), n_layers // 2, max(0, n_layers - 3)}))


def build_drafter(cfg: DrafterConfig, target: Transformer) -> nn.Module:
    """The module for ``cfg`` (random weights), sharing ``target``'s embedding where it needs
    one. A ``draft_model`` is a :class:`~minillm.model.Transformer` whose embedding is the
    target's."""
    block_cfg = cfg.block_config(target.cfg.vocab_size, target.cfg.max_seq_len)
    if cfg.method == "draft_model":
        lm = Transformer(block_cfg)
        lm.embed = target.embed                  # shared, not stored
        lm.lm_head = target.lm_head
        return lm
    if cfg.method == "medusa":
        return MedusaHeads(cfg)
    if cfg.method == "dflash":
        return BlockDrafter(cfg, block_cfg)
    return FeatureDrafter(cfg, block_cfg, input_norms=cfg.method in ("mtp", "eagle3"))


def own_parameters(drafter: nn.Module, target: Transformer) -> dict[str, torch.Tensor]:
    """The drafter's state dict without the tensors it borrows from the target."""
    borrowed = {id(p) for p in target.parameters()}
    return {k: v for k, v in drafter.state_dict(keep_vars=True).items()
            if id(v) not in borrowed}


def vocab_lookup(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] int64: a token's index in the draft vocabulary ``ids``, or OOV."""
    lookup = torch.full((vocab_size,), OOV, dtype=torch.long)
    lookup[ids.long()] = torch.arange(len(ids))
    return lookup
