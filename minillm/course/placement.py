"""Where prefill and decode run: a DistServe-style placement simulator on a measured cost model.

- :func:`measure_costs` times real steps of our engine (one prompt of n tokens; a decode step of
  b sequences) and fits a :class:`CostModel`: ``prefill_time(n) = p0 + p1 n + p2 n^2``,
  ``decode_time(b, ctx) = d0 + d1 b + d2 ctx`` (ctx: the tokens all b sequences attend to),
  by non-negative least squares on the relative error. The measurements stay in the model.
- :func:`simulate`: a seeded, deterministic discrete-event run of a cluster (:class:`Placement`):
  ``colocated`` instances that each prefill and decode (``prefill_first``: a step is either
  whole prompts up to the token budget or one decode step of all running; ``chunked``: the
  engine's own rule, decodes first, the rest of the budget to prompt chunks in arrival order),
  or ``disaggregated`` P:D (prefill instances batch whole prompts FCFS up to the budget, the KV
  of ``prompt_len * kv_bytes_per_token`` bytes crosses a link of ``link_bandwidth`` bytes/s,
  decode instances batch continuously up to ``max_batch``).
- goodput as DistServe defines it (Zhong et al., OSDI 2024): the highest request rate (Poisson
  arrivals) at which at least ``attainment`` of the requests meet both the TTFT and the TPOT
  SLO; per device: divided by the devices. :func:`sweep_rates` (a grid), :func:`find_goodput`
  (doubling, then bisection). :func:`search_placement` tries colocated and every P:D split of
  N devices, also over :class:`DeviceClass` es with prices (Splitwise, Patel et al., ISCA 2024).
- :func:`validate`: the simulator against our real engine (colocated, on ch04's virtual clock).

Assumptions (the simulator's, not measured): no KV capacity limit (no preemption) beyond
``max_batch`` sequences per instance; each KV transfer has the link to itself (no contention),
and the first token counts as delivered when its KV has reached the decode instance, so a
disaggregated TTFT includes the transfer (a request of one output token never leaves its
prefill instance); a mixed step costs its prefill part plus its decode part less a measured
shared overhead (``mixed_overlap``); a step's extra prompts cost no fixed overhead of their
own, and decodes of unequal lengths cost what equal ones of the same total do (the CPU backend
pads groups of decodes to their longest); the cost model is of warm steps (PyTorch on the CPU
runs a token count it has not met yet slower, once). A second device class made with
:meth:`CostModel.scaled` is an assumption about hardware we do not have, never a measurement.
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from ..cache.block_manager import blocks_for
from ..config import SamplingParams
from ..driver import drive
from ..engine.config import EngineConfig
from ..engine.engine import LLMEngine
from ..serving_metrics import SLO, goodput_of, tpot
from ..workloads import Workload, poisson_arrivals

TOLERANCE = 0.25            # validate(): |simulated - measured| / measured allowed, mean TTFT/TPOT
LINK_BANDWIDTH = 25e9       # bytes/s: an assumed PCIe 4.0 x16-class link, not a measurement
POLICIES = ("prefill_first", "chunked")
ROUTING = ("round_robin", "least_loaded")
MODES = ("colocated", "disaggregated")
OBJECTIVES = ("per_device", "per_dollar_hour")


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


# ---- what is simulated -----------------------------------------------------------------------
@dataclass(frozen=True)
class RequestMix:
    """Prompt and output lengths (tokens) of the requests, in arrival order."""

    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.prompt_lens or len(self.prompt_lens) != len(self.output_lens):
            raise ValueError(f"prompt_lens and output_lens must be non-empty and of one length, "
                             f"got {len(self.prompt_lens)} and {len(self.output_lens)}")
        if min(self.prompt_lens) < 1 or min(self.output_lens) < 1:
            raise ValueError("prompt_lens and output_lens must be >= 1 token")

    @classmethod
    def from_workload(cls, work: Workload) -> RequestMix:
        return cls(tuple(len(p) for p in work.prompts), tuple(work.output_lens))

    def __len__(self) -> int:
        return len(self.prompt_lens)


@dataclass(frozen=True)
class DeviceClass:
    """A kind of accelerator: its step costs and its price ($ per hour, for ranking only)."""

    name: str
    costs: CostModel
    price_per_hour: float = 1.0

    def __post_init__(self) -> None:
        if not self.price_per_hour > 0:
            raise ValueError(f"price_per_hour must be > 0, got {self.price_per_hour}")


@dataclass(frozen=True)
class Placement:
    """``colocated``: ``num_prefill`` instances that each prefill and decode, on
    ``prefill_class``. ``disaggregated``: ``num_prefill`` prefill instances on ``prefill_class``
    and ``num_decode`` decode instances on ``decode_class``. One device per instance."""

    mode: str
    num_prefill: int
    num_decode: int
    prefill_class: DeviceClass
    decode_class: DeviceClass

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.num_prefill < 1:
            raise ValueError(f"num_prefill (colocated: instances) must be >= 1, got "
                             f"{self.num_prefill}")
        if self.mode == "disaggregated" and self.num_decode < 1:
            raise ValueError(f"num_decode must be >= 1 when disaggregated, got {self.num_decode}")
        if self.mode == "colocated" and self.num_decode:
            raise ValueError(f"num_decode must be 0 when colocated, got {self.num_decode}")

    @property
    def num_devices(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def price_per_hour(self) -> float:
        return (self.num_prefill * self.prefill_class.price_per_hour
                + self.num_decode * self.decode_class.price_per_hour)

    @property
    def label(self) -> str:
        if self.mode == "colocated":
            return f"colocated x{self.num_prefill} ({self.prefill_class.name})"
        return (f"P{self.num_prefill}:D{self.num_decode} "
                f"({self.prefill_class.name}/{self.decode_class.name})")


def colocated(num_instances: int, device: DeviceClass) -> Placement:
    return Placement("colocated", num_instances, 0, device, device)


def disaggregated(num_prefill: int, num_decode: int, prefill: DeviceClass,
                  decode: DeviceClass | None = None) -> Placement:
    return Placement("disaggregated", num_prefill, num_decode, prefill, decode or prefill)


@dataclass(frozen=True)
class SimConfig:
    """Each instance's scheduler: ``policy`` (colocated instances), ``token_budget`` (tokens per
    step), ``max_batch`` (sequences per instance), ``routing`` of requests to instances, and the
    KV link's ``link_bandwidth`` (bytes/s). Defaults: the engine's."""

    policy: str = "chunked"
    token_budget: int = EngineConfig.max_num_batched_tokens
    max_batch: int = EngineConfig.max_num_seqs
    routing: str = "round_robin"
    link_bandwidth: float = LINK_BANDWIDTH

    def __post_init__(self) -> None:
        for name, allowed in (("policy", POLICIES), ("routing", ROUTING)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1 token, got {self.token_budget}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.policy == "chunked" and self.token_budget < self.max_batch:
            raise ValueError(f"token_budget must be >= max_batch ({self.max_batch}: one decode "
                             f"token each) with the chunked policy, got {self.token_budget}")
        if not self.link_bandwidth > 0:
            raise ValueError(f"link_bandwidth must be > 0 bytes/s, got {self.link_bandwidth}")


def config_for(engine: LLMEngine) -> SimConfig:
    """The :class:`SimConfig` that mirrors ``engine``'s scheduler."""
    c = engine.config
    if c.batching != "continuous" or engine.speculator is not None:
        raise ValueError("engine must use continuous batching without speculation to be "
                         "simulated")
    if c.mixed != c.enable_chunked_prefill:
        raise ValueError(f"engine must be mixed with chunked prefill ('chunked') or neither "
                         f"('prefill_first'), got mixed={c.mixed}, "
                         f"enable_chunked_prefill={c.enable_chunked_prefill}")
    return SimConfig("chunked" if c.mixed else "prefill_first", c.max_num_batched_tokens,
                     c.max_num_seqs)


# ---- the simulator ---------------------------------------------------------------------------
@dataclass
class _Req:
    arrival: float
    prompt_len: int
    output_len: int
    computed: int = 0              # prompt tokens whose K/V exist
    generated: int = 0             # output tokens so far
    first_token: float = math.nan
    finished: float = math.nan

    @property
    def prefilled(self) -> bool:
        return self.computed == self.prompt_len

    @property
    def context(self) -> int:
        """Tokens the next decode attends to (its input token included)."""
        return self.prompt_len + self.generated


_Step = tuple[list[tuple[_Req, int]], list[_Req]]      # (prompt chunks (request, tokens), decodes)


class _Instance:
    """One simulated engine (``role`` colocated, prefill or decode): a waiting queue, the running
    batch in arrival order, and the step in flight."""

    def __init__(self, role: str, costs: CostModel, config: SimConfig) -> None:
        self.role, self.costs, self.config = role, costs, config
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.load = 0                  # requests routed here that have not left
        self.step: _Step | None = None

    def plan(self) -> _Step:
        """Admit waiting requests and return this step's work."""
        if self.role == "decode":
            while self.waiting and len(self.running) < self.config.max_batch:
                self.running.append(self.waiting.popleft())
            return [], list(self.running)
        if self.role == "prefill" or self.config.policy == "prefill_first":
            chunks = self._admit_whole()
            return (chunks, []) if chunks or self.role == "prefill" else ([], list(self.running))
        return self._plan_chunked()

    def _admit_whole(self) -> list[tuple[_Req, int]]:
        """Whole prompts in order while they fit the budget (the first always does)."""
        chunks, used = [], 0
        while self.waiting and len(self.running) < self.config.max_batch:
            r = self.waiting[0]
            if chunks and used + r.prompt_len > self.config.token_budget:
                break
            self.running.append(self.waiting.popleft())
            chunks.append((r, r.prompt_len))
            used += r.prompt_len
        return chunks

    def _plan_chunked(self) -> _Step:
        """The engine's rule: decodes first, the rest of the budget to prompt chunks of running
        then waiting requests, in order."""
        decodes = [r for r in self.running if r.prefilled]
        room, chunks = self.config.token_budget - len(decodes), []
        for r in self.running:
            if not r.prefilled and room > 0:
                chunks.append((r, min(r.prompt_len - r.computed, room)))
                room -= chunks[-1][1]
        while self.waiting and room > 0 and len(self.running) < self.config.max_batch:
            r = self.waiting.popleft()
            self.running.append(r)
            chunks.append((r, min(r.prompt_len, room)))
            room -= chunks[-1][1]
        return chunks, decodes

    def duration(self, step: _Step) -> float:
        chunks, decodes = step
        return self.costs.step_time([(r.computed, k) for r, k in chunks], len(decodes),
                                    sum(r.context for r in decodes))


class _Simulation:
    """The event loop: arrivals, step ends and KV arrivals, in time order; after all events of
    one instant, every idle instance with work starts a step."""

    def __init__(self, placement: Placement, config: SimConfig) -> None:
        self.config = config
        entry_role = "colocated" if placement.mode == "colocated" else "prefill"
        self.entry = [_Instance(entry_role, placement.prefill_class.costs, config)
                      for _ in range(placement.num_prefill)]
        self.decode = [_Instance("decode", placement.decode_class.costs, config)
                       for _ in range(placement.num_decode)]
        self.turns = {"entry": 0, "decode": 0}
        self.events: list = []
        self.order = itertools.count()

    def push(self, t: float, kind: str, obj) -> None:
        heapq.heappush(self.events, (t, next(self.order), kind, obj))

    def run(self) -> None:
        while self.events:
            now = self.events[0][0]
            while self.events and self.events[0][0] == now:
                _, _, kind, obj = heapq.heappop(self.events)
                getattr(self, f"_on_{kind}")(obj, now)
            for inst in self.entry + self.decode:
                if inst.step is None and (inst.waiting or inst.running):
                    inst.step = inst.plan()
                    self.push(now + inst.duration(inst.step), "done", inst)

    def _route(self, pool: str) -> _Instance:
        instances = self.entry if pool == "entry" else self.decode
        if self.config.routing == "least_loaded":
            inst = min(instances, key=lambda i: i.load)
        else:
            inst = instances[self.turns[pool] % len(instances)]
            self.turns[pool] += 1
        inst.load += 1
        return inst

    def _on_arrive(self, r: _Req, now: float) -> None:
        self._route("entry").waiting.append(r)

    def _on_kv(self, dest: tuple[_Instance, _Req], now: float) -> None:
        inst, r = dest
        r.first_token, r.generated = now, 1
        inst.waiting.append(r)

    def _on_done(self, inst: _Instance, now: float) -> None:
        (chunks, decodes), inst.step = inst.step, None
        for r, k in chunks:
            r.computed += k
            if r.prefilled:
                self._prefilled(inst, r, now)
        for r in decodes:
            r.generated += 1
            if r.generated == r.output_len:
                self._leave(inst, r, now)

    def _prefilled(self, inst: _Instance, r: _Req, now: float) -> None:
        if inst.role == "colocated" or r.output_len == 1:
            r.first_token, r.generated = now, 1
            if r.output_len == 1:
                self._leave(inst, r, now)
            return
        self._leave(inst, r, math.nan)
        dest = self._route("decode")
        self.push(now + inst.costs.transfer_time(r.prompt_len, self.config.link_bandwidth),
                  "kv", (dest, r))

    @staticmethod
    def _leave(inst: _Instance, r: _Req, now: float) -> None:
        inst.running.remove(r)
        inst.load -= 1
        r.finished = now


@dataclass(frozen=True)
class RequestTiming:
    """One simulated request, seconds on the simulated clock."""

    arrival: float
    first_token: float
    finished: float
    prompt_len: int
    output_len: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return tpot(self.first_token, self.finished, self.output_len)


@dataclass(frozen=True)
class SimResult:
    requests: tuple[RequestTiming, ...]

    def attainment(self, slo: SLO) -> float:
        """Fraction of requests that meet both SLOs."""
        return sum(slo.met(r.ttft, r.tpot) for r in self.requests) / len(self.requests)

    def mean(self, what: str) -> float:
        """Mean of a :class:`RequestTiming` attribute ("ttft", "tpot"), seconds."""
        return statistics.fmean(getattr(r, what) for r in self.requests)

    def percentile(self, what: str, q: float) -> float:
        """Nearest-rank ``q`` quantile (0..1) of an attribute, seconds."""
        vals = sorted(getattr(r, what) for r in self.requests)
        return vals[min(len(vals) - 1, int(q * len(vals)))]


def simulate(mix: RequestMix, arrivals: Sequence[float], placement: Placement,
             config: SimConfig = SimConfig()) -> SimResult:
    """Run ``mix`` arriving at ``arrivals`` (s) on ``placement``; deterministic."""
    if len(arrivals) != len(mix):
        raise ValueError(f"arrivals must hold one time per request ({len(mix)}), got "
                         f"{len(arrivals)}")
    reqs = [_Req(a, p, o) for a, p, o in zip(arrivals, mix.prompt_lens, mix.output_lens)]
    sim = _Simulation(placement, config)
    for r in reqs:
        sim.push(r.arrival, "arrive", r)
    sim.run()
    return SimResult(tuple(RequestTiming(r.arrival, r.first_token, r.finished, r.prompt_len,
                                         r.output_len) for r in reqs))


# ---- goodput ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class RatePoint:
    """One simulated rate (requests/s): SLO attainment and latency percentiles (s)."""

    rate: float
    attainment: float
    ttft_p50: float
    ttft_p90: float
    tpot_p50: float
    tpot_p90: float


@dataclass(frozen=True)
class GoodputResult:
    """``goodput`` (requests/s) of a placement, and the rates tried (``curve``, by rate)."""

    goodput: float
    num_devices: int
    price_per_hour: float
    curve: tuple[RatePoint, ...]

    @property
    def per_device(self) -> float:
        return self.goodput / self.num_devices

    @property
    def per_dollar_hour(self) -> float:
        """Goodput (requests/s) per $/hour of the placement's devices."""
        return self.goodput / self.price_per_hour


def _check_attainment(attainment: float) -> None:
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {attainment}")


def evaluate_rate(mix: RequestMix, placement: Placement, rate: float, slo: SLO,
                  config: SimConfig = SimConfig(), seed: int = 0) -> RatePoint:
    """Simulate Poisson arrivals at ``rate`` requests/s (seeded) and summarise."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    res = simulate(mix, poisson_arrivals(len(mix), rate, seed), placement, config)
    return RatePoint(rate, res.attainment(slo), res.percentile("ttft", 0.5),
                     res.percentile("ttft", 0.9), res.percentile("tpot", 0.5),
                     res.percentile("tpot", 0.9))


def _result(placement: Placement, curve: Sequence[RatePoint], attainment: float
            ) -> GoodputResult:
    curve = sorted(curve, key=lambda p: p.rate)
    good = goodput_of([(p.rate, p.attainment) for p in curve], attainment)
    return GoodputResult(good, placement.num_devices, placement.price_per_hour, tuple(curve))


def sweep_rates(mix: RequestMix, placement: Placement, slo: SLO, rates: Sequence[float],
                attainment: float = 0.9, config: SimConfig = SimConfig(),
                seed: int = 0) -> GoodputResult:
    """Goodput on a grid of ``rates`` (requests/s), with the curve."""
    _check_attainment(attainment)
    return _result(placement, [evaluate_rate(mix, placement, r, slo, config, seed)
                               for r in rates], attainment)


def find_goodput(mix: RequestMix, placement: Placement, slo: SLO, attainment: float = 0.9,
                 config: SimConfig = SimConfig(), seed: int = 0, start_rate: float | None = None,
                 iters: int = 8, max_doublings: int = 20) -> GoodputResult:
    """Goodput by search: from ``start_rate`` (default: devices / one request's latency alone)
    double (or halve) until the attainment changes side, then bisect ``iters`` times. 0 if
    even ``start_rate`` / 2^max_doublings misses; the last rate tried if none misses."""
    _check_attainment(attainment)
    rate = start_rate if start_rate is not None else _rate_guess(mix, placement)
    if not rate > 0:
        raise ValueError(f"start_rate must be > 0 requests/s, got {rate}")
    curve: list[RatePoint] = []

    def passes(r: float) -> bool:
        curve.append(evaluate_rate(mix, placement, r, slo, config, seed))
        return curve[-1].attainment >= attainment

    up = passes(rate)
    lo, hi = (rate, None) if up else (None, rate)
    for _ in range(max_doublings):
        if lo is not None and hi is not None:
            break
        rate = rate * 2 if up else rate / 2
        lo, hi = (rate, hi) if passes(rate) else (lo, rate)
    if lo is not None and hi is not None:
        for _ in range(iters):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    return _result(placement, curve, attainment)


def _rate_guess(mix: RequestMix, placement: Placement) -> float:
    """Devices / the mean latency of one request alone on the prefill class (requests/s)."""
    c = placement.prefill_class.costs
    p, o = statistics.fmean(mix.prompt_lens), statistics.fmean(mix.output_lens)
    alone = c.prefill_time(round(p)) + (o - 1) * c.decode_time(1, round(p + o / 2))
    return placement.num_devices / max(alone, 1e-9)


# ---- placement search ------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    placement: Placement
    result: GoodputResult

    @property
    def per_device(self) -> float:
        return self.result.per_device

    @property
    def per_dollar_hour(self) -> float:
        return self.result.per_dollar_hour


@dataclass(frozen=True)
class SearchResult:
    """The ``best`` candidate by ``objective`` and every candidate tried, in search order."""

    best: Candidate
    candidates: tuple[Candidate, ...]
    objective: str

    def table(self) -> list[dict]:
        """One row per candidate: label, devices, goodput (req/s), per device, $/h, per $/h."""
        return [{"placement": c.placement.label, "devices": c.placement.num_devices,
                 "goodput": c.result.goodput, "per_device": c.per_device,
                 "price_per_hour": c.placement.price_per_hour,
                 "per_dollar_hour": c.per_dollar_hour} for c in self.candidates]


def disaggregated_splits(num_devices: int) -> list[tuple[int, int]]:
    """Every (num_prefill, num_decode) with both >= 1 summing to ``num_devices``."""
    if num_devices < 2:
        raise ValueError(f"num_devices must be >= 2 for a disaggregated split (one prefill, one "
                         f"decode), got {num_devices}; search modes=('colocated',) instead")
    return [(p, num_devices - p) for p in range(1, num_devices)]


def candidate_placements(classes: Sequence[DeviceClass], num_devices: int,
                         modes: Sequence[str] = MODES,
                         splits: Sequence[tuple[int, int]] | None = None) -> list[Placement]:
    """Colocated on each class; each split P:D with every (prefill class, decode class)."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {tuple(modes)}")
    out = [colocated(num_devices, c) for c in classes] if "colocated" in modes else []
    if "disaggregated" in modes:
        splits = disaggregated_splits(num_devices) if splits is None else splits
        for p, d in splits:
            if p + d != num_devices:
                raise ValueError(f"num_prefill + num_decode must equal num_devices "
                                 f"({num_devices}), got {p} + {d}")
            out += [disaggregated(p, d, pc, dc) for pc in classes for dc in classes]
    return out


def search_placement(mix: RequestMix, devices: DeviceClass | Sequence[DeviceClass],
                     num_devices: int, slo: SLO, attainment: float = 0.9,
                     config: SimConfig = SimConfig(), modes: Sequence[str] = MODES,
                     splits: Sequence[tuple[int, int]] | None = None,
                     objective: str | None = None, seed: int = 0,
                     iters: int = 8) -> SearchResult:
    """Goodput of every candidate placement of ``num_devices`` (:func:`candidate_placements`)
    and the best by ``objective``: "per_device" (default for one class) or "per_dollar_hour"
    (default for several); ties go to the earlier candidate."""
    classes = [devices] if isinstance(devices, DeviceClass) else list(devices)
    objective = objective or ("per_device" if len(classes) == 1 else "per_dollar_hour")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    _check_attainment(attainment)
    cands = tuple(Candidate(p, find_goodput(mix, p, slo, attainment, config, seed, iters=iters))
                  for p in candidate_placements(classes, num_devices, modes, splits))
    return SearchResult(max(cands, key=lambda c: getattr(c, objective)), cands, objective)


# ---- against the real engine -----------------------------------------------------------------
@dataclass(frozen=True)
class ValidationPoint:
    """Simulated and measured mean TTFT and TPOT (s) at one rate (requests/s)."""

    rate: float
    sim_ttft: float
    real_ttft: float
    sim_tpot: float
    real_tpot: float
    real_preemptions: int

    @property
    def ttft_error(self) -> float:
        return (self.sim_ttft - self.real_ttft) / self.real_ttft

    @property
    def tpot_error(self) -> float:
        return (self.sim_tpot - self.real_tpot) / self.real_tpot

    def within(self, tolerance: float = TOLERANCE) -> bool:
        return abs(self.ttft_error) <= tolerance and abs(self.tpot_error) <= tolerance


def validate(engine: LLMEngine, costs: CostModel, work: Workload, rates: Sequence[float],
             seed: int = 0, warmup: bool = True) -> list[ValidationPoint]:
    """Serve ``work`` on the real ``engine`` (ch04's :func:`serve`, a virtual clock of measured
    step times) at each Poisson rate (requests/s, seeded) and simulate the same arrivals on one
    colocated instance with the engine's scheduler settings (:func:`config_for`). ``warmup``:
    serve each rate once unmeasured first, since PyTorch runs a batch shape slower the first
    time it meets it and the cost model (medians after a warm-up) is of warm steps."""
    if engine.has_unfinished():
        raise ValueError("engine must be idle (no unfinished requests) to be validated")
    for rate in rates:
        if not rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    config, mix = config_for(engine), RequestMix.from_workload(work)
    placement = colocated(1, DeviceClass(engine.model.cfg.name, costs))
    points = []
    for rate in rates:
        arrivals = poisson_arrivals(len(mix), rate, seed)
        if warmup:
            drive(engine, work, arrivals=arrivals)
        real = drive(engine, work, arrivals=arrivals).records
        sim = simulate(mix, arrivals, placement, config)
        points.append(ValidationPoint(
            rate, sim.mean("ttft"), statistics.fmean(r.ttft for r in real), sim.mean("tpot"),
            statistics.fmean(tpot(r.first_token, r.finished, r.output_len) for r in real),
            sum(r.num_preemptions for r in real)))
    return points


__all__ = ["LINK_BANDWIDTH", "MODES", "OBJECTIVES", "POLICIES", "ROUTING", "SLO", "TOLERANCE",
           "Candidate", "CostModel", "DeviceClass", "GoodputResult", "Placement", "RatePoint",
           "RequestMix", "RequestTiming", "SearchResult", "SimConfig", "SimResult",
           "ValidationPoint", "candidate_placements", "colocated", "config_for", "disaggregated",
           "disaggregated_splits", "evaluate_rate", "find_goodput", "fit_nonnegative",
           "measure_costs", "search_placement", "simulate", "sweep_rates", "tpot", "validate"]
