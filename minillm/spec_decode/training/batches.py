"""Batches for the drafters' training: windows of the target's replies, real positions for RoPE,
and the target's features stored with the data or computed as batches are drawn.

- :func:`sample_batch`: ``BATCH`` windows of at most ``WINDOW`` positions from random training
  sequences (the window always covers the reply; its start in the prompt is random), for data
  that stores the target's features (:func:`.distill.load_dataset`).
- :func:`sample_whole`: windows from each sequence's first token, rows of about one length, for
  the corpus (token ids only); :class:`LiveFeatures` computes their features.
- :func:`split`: the held-out sequences (the last shard's); :func:`draft_vocabulary`: the reply
  tokens a drafter's head predicts.

Shapes: B windows, T positions, D the target's width.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...model.transformer import Transformer
from . import distill

WINDOW, BATCH = 256, 16
NEIGHBOURS = 128            # sample_whole draws a batch's rows among this many of a length


def draft_vocabulary(data: dict, size: int) -> torch.Tensor:
    """The ``size`` most frequent reply tokens (positions >= prompt_len), always including the
    ids below 3 (bos/eos/pad); sorted int64 [size] (ties go to the lower id)."""
    tokens, offsets, plens = data["tokens"].long(), data["offsets"], data["prompt_lens"]
    seq = torch.repeat_interleave(torch.arange(len(plens)), offsets.diff())
    reply = torch.arange(len(tokens)) - offsets[seq] >= plens[seq]
    counts = torch.bincount(tokens[reply], minlength=int(tokens.max()) + 1).double()
    counts[:3] = counts.max() + 1
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:size].sort().values


def load_data(data_dir: Path | None = None) -> dict:
    """:func:`distill.load_dataset` plus ``heldout``: how many final sequences (the last shard's)
    are kept for evaluation."""
    data_dir = Path(data_dir or distill.default_data_dir())
    data = distill.load_dataset(data_dir)
    last = sorted(data_dir.glob("shard-*.pt"))[-1]
    data["heldout"] = len(torch.load(last, mmap=True)["prompt_lens"])
    return data


def split(data: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(training sequence ids, held-out ids): the last ``data['heldout']`` sequences (default
    1/12) are held out, unless that would leave nothing to train on."""
    s = len(data["prompt_lens"])
    held = min(data.get("heldout", max(1, s // 12)), s - 1)
    return torch.arange(s - held), torch.arange(s - held, s)


@dataclass
class Batch:
    """Right-padded windows: tokens [B, T] int64, features [B, T, D], positions [B, T] (in the
    sequence), lengths [B] (real positions per window), prompt_lens [B] (in the sequence)."""

    tokens: torch.Tensor
    features: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    prompt_lens: torch.Tensor
    target_next: torch.Tensor | None = None     # [B, T] the target's greedy token after t

    def to(self, device: torch.device, dtype: torch.dtype) -> Batch:
        nxt = None if self.target_next is None else self.target_next.to(device)
        return Batch(self.tokens.to(device), self.features.to(device, dtype),
                     self.positions.to(device), self.lengths.to(device),
                     self.prompt_lens.to(device), nxt)


def make_batch(data: dict, spans: list[tuple[int, int]], width: int) -> Batch:
    """Windows (sequence id, start) of at most ``width`` positions each, gathered and padded."""
    offsets = data["offsets"]
    feats = data.get("features", torch.zeros(0, 0))    # none: recomputed by the loss
    ends = [min(int(offsets[s + 1]), int(offsets[s]) + a + width) for s, a in spans]
    lens = [e - int(offsets[s]) - a for (s, a), e in zip(spans, ends)]
    t = max(lens)
    tokens = torch.zeros(len(spans), t, dtype=torch.long)
    features = torch.zeros(len(spans), t, feats.shape[1], dtype=feats.dtype)
    nxt = torch.zeros(len(spans), t, dtype=torch.long) if "target_next" in data else None
    for row, (e, n) in enumerate(zip(ends, lens)):
        tokens[row, :n] = data["tokens"][e - n:e].long()
        if len(feats):
            features[row, :n] = feats[e - n:e]
        if nxt is not None:
            nxt[row, :n] = data["target_next"][e - n:e]
    starts = torch.tensor([a for _, a in spans])
    return Batch(tokens, features, starts[:, None] + torch.arange(t), torch.tensor(lens),
                 data["prompt_lens"][[s for s, _ in spans]].long(), nxt)


def sample_whole(data: dict, seqs: torch.Tensor, gen: torch.Generator, batch: int = BATCH,
                 width: int = WINDOW) -> Batch:
    """``batch`` sequences from their first token (at most ``width`` of each): windows whose
    target states can be recomputed exactly (:class:`LiveFeatures`). The rows are drawn among
    the ``NEIGHBOURS`` sequences around a random rank in length order, so they are about as
    long and little of the batch is padding (corpus sequences run from tens to hundreds of
    tokens)."""
    lengths = data["offsets"][1:][seqs] - data["offsets"][:-1][seqs]
    by_length = seqs[lengths.clamp(max=width).argsort(stable=True)]
    anchor = int(torch.randint(len(seqs), (), generator=gen))
    lo = max(0, min(anchor - NEIGHBOURS // 2, len(seqs) - NEIGHBOURS))
    near = by_length[lo:lo + NEIGHBOURS]
    picks = near[torch.randint(len(near), (batch,), generator=gen)].tolist()
    return make_batch(data, [(s, 0) for s in picks], width)


@dataclass(frozen=True)
class LiveFeatures:
    """Target features computed for each batch, for data that keeps token ids only (the
    corpus, :func:`distill.load_corpus`: its 4M tokens' states would take 4.6 GB, 18 GB for
    four layers). ``model``: the target in the dtype it serves in (what a drafter reads at
    serving time); ``layers``: whose states go into ``batch.features``, joined (-1: the final
    normed state); ``next_tokens``: also ``batch.target_next``, the target's argmax after each
    position. Batches must be windows from each sequence's first token (:func:`sample_whole`;
    padding after a sequence changes nothing, attention being causal)."""

    model: Transformer
    layers: tuple[int, ...] = (-1,)
    next_tokens: bool = False

    @torch.no_grad()
    def __call__(self, batch: Batch) -> Batch:
        if int(batch.positions[:, 0].max()) != 0:
            raise ValueError("live features need windows from each sequence's first token")
        tokens = batch.tokens.to(self.model.device)
        h, kept = self.model.forward_layers(tokens, keep=[i for i in self.layers if i >= 0])
        kept[-1] = h
        features = torch.cat([kept[i] for i in self.layers], -1)
        nxt = self.model.lm_head(h).argmax(-1) if self.next_tokens else batch.target_next
        return Batch(batch.tokens, features, batch.positions, batch.lengths, batch.prompt_lens,
                     nxt)

    def sampler(self):
        """A ``sample`` for :func:`train`: :func:`sample_whole` with these features."""
        return lambda data, seqs, gen, batch, width: self(sample_whole(data, seqs, gen, batch,
                                                                       width))


def window_start(length: int, prompt_len: int, width: int, gen: torch.Generator) -> int:
    """Half the time the earliest start whose window reaches the sequence's end, else a
    random one between it and the reply's first token (the reply is always covered)."""
    lo = max(0, length - width)
    hi = max(lo, min(prompt_len, length - 2))
    if hi == lo or torch.rand((), generator=gen) < 0.5:
        return lo
    return int(torch.randint(lo, hi + 1, (), generator=gen))


def sample_batch(data: dict, seqs: torch.Tensor, gen: torch.Generator, batch: int = BATCH,
                 width: int = WINDOW) -> Batch:
    """``batch`` random windows from the sequences ``seqs``."""
    picks = seqs[torch.randint(len(seqs), (batch,), generator=gen)].tolist()
    lengths = data["offsets"].diff()
    spans = [(s, window_start(int(lengths[s]), int(data["prompt_lens"][s]), width, gen))
             for s in picks]
    return make_batch(data, spans, width)
