"""The serving engine's batched sampler: one call per step for every scheduled row.

The chapter-01 sampler (:mod:`minillm.sampling`) picks one sequence's token at a time. Here the
engine hands over the logits of all R rows it scheduled, ``[R, V]``, and a :class:`SamplingBatch`
with each row's temperature, top-k, top-p and generator; :func:`sample_rows` does the work on
the logits' device and reads the results back to the host with a single ``.tolist()``.

Per row the rules are those of :func:`minillm.sampling.sample`, in the same order: temperature
0 is argmax of the raw logits; otherwise divide by the temperature, keep the top-k (ties at the
k-th value stay), keep the nucleus (drop a token when the mass of the tokens sorted before it
already reaches p, so the top token always stays), softmax, draw. The draw is the one
``torch.multinomial`` makes for a single sample, the exponential race
``argmax(probs / q)`` with ``q ~ Exp(1)`` drawn from the row's own generator, so a seeded row
gives the same token as ``minillm.sampling.sample`` with the same generator state, whatever
else is in the batch. Unseeded rows share one draw from the global RNG. Greedy rows never
touch their generator.

The reported log-probability of a token is under the model's own distribution,
``log_softmax(raw logits)`` (vLLM's default), not the tempered or filtered one.

Structured outputs: a batch's ``allowed`` [R, V] bool mask (True: the row's grammar allows the
token) sets every other logit to -inf before anything else, greedy rows included, so
constrained and free rows share one step and a free row's token is what it would be alone. The
reported log-probabilities stay those of the raw logits (a masked token's is finite, so the
top-n alternatives may name tokens the grammar did not allow).

Token-for-token equality with the chapter sampler is exact on the CPU (the tests check it). On
CUDA, PyTorch divides by a Python-float temperature as a multiply by its reciprocal while this
module divides by a tensor, so the two may differ in a last bit and, very rarely, in a token.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import SamplingParams


@dataclass
class SamplingBatch:
    """The sampling parameters of R rows as tensors on the logits' device, built once per step.

    temperature: [R] float32 (0 = greedy); top_k: [R] int64 (0 = off); top_p: [R] float32
    (1 = off); generators: R entries, None for a row drawn from the global RNG (a request's
    rows may share one generator: they draw from it in row order); chosen_logprobs False skips
    the log-probabilities (a full-vocabulary log_softmax) when no row wants them; logprobs: the
    most top-n
    alternatives any row asks for (0 = none). ``greedy`` and ``use_filters`` are host-side
    facts that let :func:`sample_rows` skip work without reading the tensors back: greedy[i]
    is temperature[i] == 0 (None: read from ``temperature`` once, here), use_filters False
    promises that no sampled row uses top-k or top-p (True is always safe); top_k_only > 0
    promises that every sampled row uses top-k with k <= top_k_only and no top-p (so a top-k
    selection replaces the full sort; 0 is always safe); top_k_bound > 0 promises that every
    sampled row uses top-k with k <= top_k_bound, top-p or not (the sort is of that many
    values; 0 is always safe). allowed: [R, V] bool on the logits'
    device, or None (no row constrained): True where row i may pick the token (structured
    outputs, :mod:`.constraints`); an unconstrained row is all True.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    generators: list[torch.Generator | None]
    logprobs: int = 0
    chosen_logprobs: bool = True
    greedy: list[bool] | None = None
    use_filters: bool = True
    top_k_only: int = 0
    top_k_bound: int = 0
    allowed: torch.Tensor | None = None

    def __post_init__(self) -> None:
        rows = len(self.generators)
        for name in ("temperature", "top_k", "top_p"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.shape != (rows,):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"SamplingBatch.{name} must be a [R] tensor with R = "
                                 f"len(generators) = {rows}, got {shape}")
        if self.logprobs < 0:
            raise ValueError(f"SamplingBatch.logprobs must be >= 0, got {self.logprobs}")
        if self.greedy is None:
            self.greedy = (self.temperature == 0).tolist()
        if len(self.greedy) != rows:
            raise ValueError(f"SamplingBatch.greedy must have R = {rows} entries, got "
                             f"{len(self.greedy)}")
        a = self.allowed
        if a is not None and not (isinstance(a, torch.Tensor) and a.dtype == torch.bool
                                  and a.dim() == 2 and a.shape[0] == rows):
            shape = (a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else type(a).__name__
            raise ValueError(f"SamplingBatch.allowed must be None or a [R, V] bool tensor with "
                             f"R = {rows}, got {shape}")

    @property
    def num_rows(self) -> int:
        return len(self.generators)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams],
                    generators: Sequence[torch.Generator | None],
                    device: torch.device | str, logprobs: int = 0,
                    allowed: torch.Tensor | None = None) -> SamplingBatch:
        """One row per entry of ``params`` (repeat a request's params for each of its rows);
        ``allowed``: the rows' [R, V] bool mask of structured outputs, or None.

        ``logprobs`` is the most top-n alternatives any row wants; a ``logprobs`` attribute on
        a SamplingParams, where it has one, counts too. Beam search rows are refused: they are
        ranked by the beam step, not sampled.
        """
        if logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 (0 = none), got {logprobs}")
        if len(generators) != len(params):
            raise ValueError(f"generators must have one entry per row of params "
                             f"({len(params)}), got {len(generators)}")
        for i, p in enumerate(params):
            if p.use_beam_search:
                raise ValueError(f"params[{i}] uses beam search (beam_width={p.beam_width}); "
                                 f"beam rows are not sampled by sample_rows")
        greedy = [p.greedy for p in params]
        top_k = [max(p.top_k, 0) for p in params]
        top_p = [p.top_p for p in params]
        wanted = [logprobs] + [getattr(p, "logprobs", None) or 0 for p in params]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                     device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            generators=list(generators), logprobs=max(wanted), greedy=greedy, allowed=allowed,
            chosen_logprobs=logprobs > 0 or any(getattr(p, "logprobs", None) is not None
                                                for p in params),
            use_filters=any(not g and (k > 0 or p < 1) for g, k, p in zip(greedy, top_k, top_p)),
            top_k_only=max((k for g, k in zip(greedy, top_k) if not g), default=0)
            if all(g or (k > 0 and p >= 1) for g, k, p in zip(greedy, top_k, top_p)) else 0,
            top_k_bound=max((k for g, k in zip(greedy, top_k) if not g), default=0)
            if all(g or k > 0 for g, k in zip(greedy, top_k)) else 0)


@dataclass
class SamplerOutput:
    """What :func:`sample_rows` returns, as plain Python values (R rows).

    token_ids[i]: the chosen token; logprobs[i]: its log-probability under log_softmax of the
    raw logits (0.0 when the batch's chosen_logprobs is False); top[i]: the batch's
    ``logprobs`` most likely (token, logprob) pairs of that distribution, most likely first
    (empty lists when logprobs is 0).
    """

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


def _check_logits(logits: torch.Tensor, rows: int | None = None) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a 2-D tensor [rows, vocab], got {shape}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if logits.shape[1] < 1:
        raise ValueError("logits must have a vocabulary of at least one token, got 0 columns")
    if rows is not None and logits.shape[0] != rows:
        raise ValueError(f"logits has {logits.shape[0]} rows but the SamplingBatch has {rows}")


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[R, V] logits -> [R, V] float32 distribution each sampled row draws from.

    Per row: logits / temperature, top-k, top-p, softmax, as in
    :func:`minillm.sampling.probabilities`. Greedy rows get softmax(logits) (never drawn from).
    """
    vocab = logits.shape[1]
    temp = torch.where(batch.temperature > 0, batch.temperature, 1.0)
    x = logits.float() / temp[:, None]
    if not batch.use_filters:
        return x.softmax(dim=-1)
    if 0 < batch.top_k_only < vocab:                # top-k alone: no sort of the vocabulary
        k = torch.where(batch.top_k > 0, batch.top_k, batch.top_k_only)
        kth = x.topk(batch.top_k_only, dim=-1).values.gather(1, (k - 1)[:, None])
        return x.masked_fill(x < kth, float("-inf")).softmax(dim=-1)
    if 0 < batch.top_k_bound < vocab - 1:
        bounded = _top_k_then_top_p(x, batch)
        if bounded is not None:
            return bounded
    # One descending sort serves both filters: the k-th largest value is sorted[:, k - 1], and
    # the sorted top-k-filtered row is the sorted row with its values below that set to -inf.
    sorted_x, order = x.sort(dim=-1, descending=True)
    k = torch.where((batch.top_k > 0) & (batch.top_k < vocab), batch.top_k, vocab)
    kth = sorted_x.gather(1, (k - 1)[:, None])                          # [R, 1]
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = (mass_before >= batch.top_p[:, None]) & (batch.top_p < 1)[:, None]
    drop = drop_sorted.scatter(1, order, drop_sorted)                   # back to vocab order
    return x.masked_fill((x < kth) | drop, float("-inf")).softmax(dim=-1)


def _top_k_then_top_p(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
    """:func:`filtered_probs` when every sampled row has a top-k of at most
    ``batch.top_k_bound`` = b: the top b + 1 values alone are sorted (not the vocabulary), the
    filters run on the first b and scatter back. None when a row's k-th value ties with its
    (b + 1)-th: the full sort keeps every tie of the k-th value, so that case goes there."""
    b = batch.top_k_bound
    vals, idx = x.topk(b + 1, dim=-1)                                   # descending
    k = torch.where(batch.top_k > 0, batch.top_k, b)                    # greedy rows: any k
    kth = vals.gather(1, (k - 1)[:, None])
    if bool((vals[:, b:] == kth).any()):
        return None
    vals, idx = vals[:, :b], idx[:, :b]
    vals = vals.masked_fill(vals < kth, float("-inf"))
    probs = vals.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs >= batch.top_p[:, None]) & (batch.top_p < 1)[:, None]
    kept = torch.full_like(x, float("-inf")).scatter(1, idx, vals.masked_fill(drop,
                                                                              float("-inf")))
    probs = kept.softmax(dim=-1)
    greedy = [i for i, g in enumerate(batch.greedy) if g]
    if greedy:                                            # unfiltered, as filtered_probs says
        probs[greedy] = x[greedy].softmax(dim=-1)
    return probs


def _draw(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[R, V] probabilities -> [R] int64 draws, each row with its own generator (or the global
    RNG), the way torch.multinomial draws one sample: argmax(probs / q), q ~ Exp(1)."""
    unseeded = any(g is None and not greedy for g, greedy in zip(batch.generators, batch.greedy))
    q = torch.empty_like(probs).exponential_() if unseeded else torch.ones_like(probs)
    for i, (gen, greedy) in enumerate(zip(batch.generators, batch.greedy)):
        if gen is not None and not greedy:
            q[i].exponential_(generator=gen)
    return (probs / q).argmax(dim=-1)


class Sampler(Protocol):
    """Draws one token per row: ``sampler(logits [R, V], batch) -> SamplerOutput`` of R rows,
    each token id in [0, V), following the batch's temperature, top-k, top-p and generators
    (greedy rows: the argmax). :func:`sample_rows` is the package's; the runner checks what a
    sampler returns and fails the request of a row that breaks the contract."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput: ...


def sampler_violations(out: object, rows: int, vocab: int) -> dict[int, str]:
    """{row: why it breaks the :class:`Sampler` contract} for a sampler's output ``out`` over
    ``rows`` rows of a ``vocab``-token vocabulary (empty when it keeps it)."""
    lists = [getattr(out, name, None) for name in ("token_ids", "logprobs", "top")]
    if not all(isinstance(x, list) and len(x) == rows for x in lists):
        sizes = ", ".join(f"{name} {len(x) if isinstance(x, list) else type(x).__name__}"
                          for name, x in zip(("token_ids", "logprobs", "top"), lists))
        return dict.fromkeys(range(rows), f"returned {sizes} for {rows} rows: a SamplerOutput "
                                          f"has one entry per row in each list")
    return {i: f"returned {t!r} for row {i}: a token id must be an int in [0, {vocab})"
            for i, t in enumerate(out.token_ids)
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab}


def sample_rows(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """[R, V] logits -> one token per row, its log-probability, and the top-n alternatives.

    All work stays on the logits' device; the results come back with one ``.tolist()``.
    """
    _check_logits(logits, batch.num_rows)
    vocab = logits.shape[1]
    if batch.temperature.device != logits.device:
        raise ValueError(f"SamplingBatch tensors are on {batch.temperature.device} but logits "
                         f"on {logits.device}")
    for i, gen in enumerate(batch.generators):
        if gen is not None and gen.device.type != logits.device.type:
            raise ValueError(f"generators[{i}] is on {gen.device} but logits on "
                             f"{logits.device}")
    if batch.logprobs > vocab:
        raise ValueError(f"logprobs must be in [0, vocab={vocab}], got {batch.logprobs}")
    raw = logits                                                       # for log-probabilities
    if batch.allowed is not None:
        if batch.allowed.shape != logits.shape or batch.allowed.device != logits.device:
            raise ValueError(f"SamplingBatch.allowed is {tuple(batch.allowed.shape)} on "
                             f"{batch.allowed.device} but logits {tuple(logits.shape)} on "
                             f"{logits.device}")
        logits = logits.masked_fill(~batch.allowed, float("-inf"))     # structured outputs

    tokens = logits.argmax(dim=-1)                                     # [R] greedy choice
    if not all(batch.greedy):
        drawn = _draw(filtered_probs(logits, batch), batch)
        tokens = torch.where(batch.temperature == 0, tokens, drawn)
    n = batch.logprobs
    if not (batch.chosen_logprobs or n):                               # nobody asked: skip
        host = tokens.tolist()                                         # the one sync
        return SamplerOutput(token_ids=host, logprobs=[0.0] * len(host), top=[[]] * len(host))
    logp = raw.float().log_softmax(dim=-1)                             # [R, V] model's own
    parts = [tokens[:, None].double(), logp.gather(1, tokens[:, None]).double()]
    if n:
        top = logp.topk(n, dim=-1)
        parts += [top.indices.double(), top.values.double()]
    host = torch.cat(parts, dim=1).tolist()                            # [R, 2 + 2n]: one sync
    return SamplerOutput(
        token_ids=[int(r[0]) for r in host], logprobs=[r[1] for r in host],
        top=[[(int(t), lp) for t, lp in zip(r[2:2 + n], r[2 + n:])] for r in host])


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int],
                    n: int = 0) -> list[dict[int, float] | None]:
    """[T, V] logits of a T-token prompt -> T entries (OpenAI echo / vLLM prompt_logprobs).

    Entry 0 is None (nothing predicts the first token); entry i maps token id -> log-prob
    under log_softmax(logits[i - 1]): the prompt token prompt_ids[i] first, then the n most
    likely tokens, most likely first (the prompt token appears once, so n or n + 1 keys).
    logits[T - 1] predicts the token after the prompt and is not used.
    """
    _check_logits(logits)
    steps, vocab = logits.shape
    if steps != len(prompt_ids):
        raise ValueError(f"logits has {steps} rows but prompt_ids has {len(prompt_ids)} tokens")
    if not 0 <= n <= vocab:
        raise ValueError(f"n must be in [0, vocab={vocab}], got {n}")
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt_ids must be in [0, {vocab}), got {bad[:5]}")
    if steps == 0:
        return []
    logp = logits[:-1].float().log_softmax(dim=-1)                     # [T - 1, V]
    ids = torch.tensor(prompt_ids[1:], dtype=torch.long, device=logits.device)
    parts = [logp.gather(1, ids[:, None]).double()]
    if n:
        top = logp.topk(n, dim=-1)
        parts += [top.indices.double(), top.values.double()]
    host = torch.cat(parts, dim=1).tolist()                            # [T - 1, 1 + 2n]
    out: list[dict[int, float] | None] = [None]
    for tok, row in zip(prompt_ids[1:], host):
        entry = {tok: row[0]}
        for t, lp in zip(row[1:1 + n], row[1 + n:]):
            entry.setdefault(int(t), lp)
        out.append(entry)
    return out
