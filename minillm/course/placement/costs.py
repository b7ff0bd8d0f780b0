"""The cost model of the placement simulator: a step's time from measured steps of our engine."""
from __future__ import annotations

import itertools
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from ...cache.block_manager import blocks_for
from ...config import SamplingParams
from ...engine.engine import LLMEngine

TOLERANCE = 0.25            # validate(): |simulated - measured| / measured allowed, mean TTFT/TPOT

# ---- the cost model --------------------------------------------------------------------------
@dataclass(frozen=True)
class CostModel:
    """Seconds per engine step. ``prefill_coef`` (p0 s, p1 s/token, p2 s/token^2),
    ``decode_coef`` (d0 s, d1 s/sequence, d2 s/context token), all >= 0, and
    ``mixed_overlap`` (s, in [0, min(p0, d0)]): what a step that mixes prompt chunks and decodes
    saves over its prefill part and its decode part run apart (shared fixed cost).
    ``kv_bytes_per_token``: bytes of K and V of one token (all layers), for transfers. The
    measurements behind the fit (empty for a hand-made or scaled model): ``prefill_points``
    (prompt tokens, s), ``decode_points`` (batch, context tokens, s), ``mixed_points`` (prompt
    tokens, batch, context tokens, s); ``source`` says where the model came from."""

    prefill_coef: tuple[float, float, float]
    decode_coef: tuple[float, float, float]
    kv_bytes_per_token: int
    mixed_overlap: float = 0.0
    prefill_points: tuple[tuple[int, float], ...] = ()
    decode_points: tuple[tuple[int, int, float], ...] = ()
    mixed_points: tuple[tuple[int, int, int, float], ...] = ()
    source: str = "given"

    def __post_init__(self) -> None:
        for name in ("prefill_coef", "decode_coef"):
            coef = getattr(self, name)
            if len(coef) != 3 or not all(math.isfinite(c) and c >= 0 for c in coef):
                raise ValueError(f"{name} must be 3 finite coefficients >= 0, got {coef}")
        top = min(self.prefill_coef[0], self.decode_coef[0])
        if not 0 <= self.mixed_overlap <= top:
            raise ValueError(f"mixed_overlap must be in [0, min(p0, d0) = {top:g}] s, got "
                             f"{self.mixed_overlap}")
        if self.kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token must be >= 0, got {self.kv_bytes_per_token}")

    def prefill_time(self, num_tokens: int) -> float:
        """Seconds of a step that prefills one whole prompt of ``num_tokens`` tokens."""
        return self.step_time([(0, num_tokens)], 0, 0)

    def decode_time(self, batch: int, total_context_tokens: int) -> float:
        """Seconds of a decode step of ``batch`` sequences attending to that many tokens in all."""
        return self.step_time([], batch, total_context_tokens)

    def step_time(self, chunks: Sequence[tuple[int, int]], decode_batch: int,
                  decode_context: int) -> float:
        """Seconds of one step, possibly mixed: prompt ``chunks`` as (start, tokens), a chunk
        attending to the ``start`` tokens before it (quadratic part p2 ((start + tokens)^2 -
        start^2)), plus ``decode_batch`` decodes attending to ``decode_context`` tokens. A mixed
        step costs its prefill part plus its decode part (fixed costs p0, d0 included) less
        ``mixed_overlap``."""
        p0, p1, p2 = self.prefill_coef
        d0, d1, d2 = self.decode_coef
        prompt = p0 + sum(p1 * k + p2 * ((s + k) ** 2 - s * s) for s, k in chunks)
        decode = d0 + d1 * decode_batch + d2 * decode_context
        if chunks and decode_batch:
            return prompt + decode - self.mixed_overlap
        return prompt if chunks else decode if decode_batch else 0.0

    def transfer_time(self, num_tokens: int, bandwidth: float) -> float:
        """Seconds to ship the KV of ``num_tokens`` tokens over ``bandwidth`` bytes/s."""
        return num_tokens * self.kv_bytes_per_token / bandwidth

    def scaled(self, prefill: float = 1.0, decode: float = 1.0) -> CostModel:
        """An *assumed* device: every prefill time x ``prefill``, every decode time x
        ``decode`` (the mixed overlap x the smaller). Not a measurement: the copy has no points
        and its source says so."""
        for name, f in (("prefill", prefill), ("decode", decode)):
            if not f > 0:
                raise ValueError(f"{name} (a time factor) must be > 0, got {f}")
        return CostModel(tuple(c * prefill for c in self.prefill_coef),
                         tuple(c * decode for c in self.decode_coef), self.kv_bytes_per_token,
                         self.mixed_overlap * min(prefill, decode),
                         source=f"assumed: prefill x{prefill:g}, decode x{decode:g} of "
                                f"[{self.source}]")

    def to_dict(self) -> dict:
        """Plain types, for JSON."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(tuple(float(c) for c in d["prefill_coef"]),
                   tuple(float(c) for c in d["decode_coef"]), int(d["kv_bytes_per_token"]),
                   float(d.get("mixed_overlap", 0.0)),
                   tuple((int(n), float(t)) for n, t in d.get("prefill_points", ())),
                   tuple((int(b), int(c), float(t)) for b, c, t in d.get("decode_points", ())),
                   tuple((int(n), int(b), int(c), float(t))
                         for n, b, c, t in d.get("mixed_points", ())),
                   d.get("source", "given"))


def fit_nonnegative(rows: Sequence[Sequence[float]], times: Sequence[float]
                    ) -> tuple[float, ...]:
    """Coefficients c >= 0 minimising sum(((row . c) - t) / t)^2 (relative error, so short and
    long steps count alike): exact, by least squares on every subset of the columns and keeping
    the best non-negative one (fine for 3 columns)."""
    x = np.asarray(rows, dtype=np.float64) / np.asarray(times, dtype=np.float64)[:, None]
    y = np.ones(len(times))
    best, best_err = (), math.inf
    for r in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), r):
            sol = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
            err = float(((x[:, cols] @ sol - y) ** 2).sum())
            if (sol >= 0).all() and err < best_err:
                best, best_err = tuple(zip(cols, sol)), err
    coef = [0.0] * x.shape[1]
    for col, value in best:
        coef[col] = float(value)
    return tuple(coef)


# ---- measuring our engine --------------------------------------------------------------------
def measure_costs(engine: LLMEngine, prompt_lens: Sequence[int] = (16, 64, 128, 256),
                  batches: Sequence[int] = (1, 4, 16), contexts: Sequence[int] = (32, 128),
                  repeats: int = 5, seed: int = 0) -> CostModel:
    """Time real steps of an idle ``engine`` and fit a :class:`CostModel`. Prefill: one request
    of n tokens (greedy, max_tokens 1), one step, for each n in ``prompt_lens``. Decode: b
    requests of c prompt tokens each, prefilled, then decode steps, for every b in ``batches``
    and c in ``contexts``; then (a mixing engine only) steps of those decodes plus one prompt
    (:func:`_mixed_prompt` tokens), whose median saving over the fitted parts is
    ``mixed_overlap``. Each point is the median of ``repeats`` steps after one warm-up; prompts
    are seeded random token ids."""
    _check_measure(engine, prompt_lens, batches, contexts, repeats)
    rng, n_mix = random.Random(seed), _mixed_prompt(engine, prompt_lens, batches)
    pre = tuple((n, _time_prefill(engine, n, repeats, rng)) for n in prompt_lens)
    runs = [_time_decode(engine, b, c, n_mix, repeats, rng) for b in batches for c in contexts]
    dec, mixed = tuple(d for d, _ in runs), tuple(m for _, m in runs if m)
    model = engine.model
    elem = torch.empty((), dtype=model.dtype).element_size()
    costs = CostModel(fit_nonnegative([(1, n, n * n) for n, _ in pre], [t for _, t in pre]),
                      fit_nonnegative([(1, b, c) for b, c, _ in dec], [t for *_, t in dec]),
                      model.cfg.kv_bytes_per_token(elem))
    return replace(costs, mixed_overlap=_overlap(costs, mixed), prefill_points=pre,
                   decode_points=dec, mixed_points=mixed,
                   source=f"measured: {model.cfg.name}, {model.dtype}, {model.device}, "
                          f"median of {repeats}")


def _mixed_prompt(engine: LLMEngine, prompt_lens: Sequence[int], batches: Sequence[int]) -> int:
    """Tokens of the prompt timed with the decodes: the median prompt length, cut to the room
    the largest batch leaves in a step; 0 (no mixed points) when the engine never mixes."""
    n = min(sorted(prompt_lens)[len(prompt_lens) // 2],
            engine.config.max_num_batched_tokens - max(batches))
    return n if engine.config.mixed and n >= 2 else 0


def _overlap(costs: CostModel, mixed: Sequence[tuple[int, int, int, float]]) -> float:
    """Median of (prefill part + decode part - measured) over the mixed points, in [0, min(p0,
    d0)] s; 0 without points."""
    if not mixed:
        return 0.0
    saved = statistics.median(costs.prefill_time(n) + costs.decode_time(b, c) - t
                              for n, b, c, t in mixed)
    return min(max(saved, 0.0), costs.prefill_coef[0], costs.decode_coef[0])


def _check_measure(engine: LLMEngine, prompt_lens: Sequence[int], batches: Sequence[int],
                   contexts: Sequence[int], repeats: int) -> None:
    cfg = engine.config
    if engine.has_unfinished():
        raise ValueError("engine must be idle (no unfinished requests) to be measured")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if len(set(prompt_lens)) < 3 or not all(1 <= n <= cfg.max_num_batched_tokens
                                            for n in prompt_lens):
        raise ValueError(f"prompt_lens must hold >= 3 distinct lengths in [1, "
                         f"max_num_batched_tokens={cfg.max_num_batched_tokens}] (one step "
                         f"each), got {tuple(prompt_lens)}")
    if len(set(batches)) < 2 or not all(1 <= b <= cfg.max_num_seqs for b in batches):
        raise ValueError(f"batches must hold >= 2 distinct sizes in [1, max_num_seqs="
                         f"{cfg.max_num_seqs}], got {tuple(batches)}")
    if len(set(contexts)) < 2 or min(contexts) < 1:
        raise ValueError(f"contexts must hold >= 2 distinct lengths >= 1, got {tuple(contexts)}")
    b, c = max(batches), max(contexts)
    need = b * blocks_for(c + _decode_tokens(engine, b, c, repeats), engine.blocks.block_size)
    need += blocks_for(max(prompt_lens), engine.blocks.block_size)
    if need > engine.blocks.num_blocks:
        raise ValueError(f"batches x contexts need {need} KV blocks, the pool has "
                         f"{engine.blocks.num_blocks}: lower batches or contexts, or raise "
                         f"num_kv_blocks")


def _random_prompt(engine: LLMEngine, n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(engine.model.cfg.vocab_size) for _ in range(n)]


def _decode_tokens(engine: LLMEngine, batch: int, context: int, repeats: int) -> int:
    """max_tokens that outlasts the prefill of ``batch`` prompts of ``context`` tokens (early
    ones decode meanwhile: each step gives prompts at least budget - batch tokens), then two
    rounds (decode, mixed) of a warm-up and ``repeats`` timed steps."""
    room = max(1, engine.config.max_num_batched_tokens - batch)
    return -(-batch * context // room) + 2 * (repeats + 1) + 2


def _time_prefill(engine: LLMEngine, n: int, repeats: int, rng: random.Random) -> float:
    """Median seconds of a step prefilling one prompt of ``n`` tokens (after a warm-up)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(repeats + 1):
        engine.add_request(_random_prompt(engine, n, rng), params)
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        if engine.has_unfinished():
            raise RuntimeError(f"a prompt of {n} tokens did not finish in one step")
    return statistics.median(times[1:])


def _time_decode(engine: LLMEngine, batch: int, context: int, n_mix: int, repeats: int,
                 rng: random.Random) -> tuple[tuple[int, int, float],
                                              tuple[int, int, int, float] | None]:
    """``batch`` requests of ``context``-token prompts, prefilled, then timed: decode steps
    -> (batch, context tokens, s); with ``n_mix``, steps of those decodes plus one ``n_mix``
    token prompt -> (n_mix, batch, context tokens, s) when the batch has room for it, else
    None. Medians after a warm-up."""
    params = SamplingParams(temperature=0.0, ignore_eos=True,
                            max_tokens=_decode_tokens(engine, batch, context, repeats))
    ids = [engine.add_request(_random_prompt(engine, context, rng), params)
           for _ in range(batch)]
    try:
        while not all(engine.requests[r].seqs[0].output_ids for r in ids):
            engine.step()
        ctx, dt = _timed_steps(engine, ids, 0, repeats, rng)
        mixed = None
        if n_mix and batch < engine.config.max_num_seqs:      # room for one more sequence
            mixed = (n_mix, batch, *_timed_steps(engine, ids, n_mix, repeats, rng))
    finally:
        for r in ids:
            engine.abort(r)
    return (batch, ctx, dt), mixed


def _timed_steps(engine: LLMEngine, ids: list[str], prompt: int, repeats: int,
                 rng: random.Random) -> tuple[int, float]:
    """(median context tokens, median s) of ``repeats`` steps (after one) that decode the
    requests ``ids`` and, with ``prompt`` > 0, prefill a new prompt of that many tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times, ctxs = [], []
    for i in range(repeats + 1):
        if prompt:
            engine.add_request(_random_prompt(engine, prompt, rng), params)
        ctx = sum(s.num_tokens for r in ids for s in engine.requests[r].seqs)
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        rec = engine.trace[-1]
        if rec.decode_tokens != len(ids) or rec.prefill_tokens != prompt:
            raise RuntimeError(f"expected {len(ids)} decodes and {prompt} prompt tokens, "
                               f"got {rec}")
        if i:
            times.append(dt)
            ctxs.append(ctx)
    return int(statistics.median(ctxs)), statistics.median(times)
