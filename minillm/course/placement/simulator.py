"""A seeded discrete-event run of a cluster of colocated or disaggregated instances."""
from __future__ import annotations

import heapq
import itertools
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ...engine.config import EngineConfig
from ...engine.engine import LLMEngine
from ...serving_metrics import SLO, tpot
from ...workloads import Workload
from .costs import CostModel

LINK_BANDWIDTH = 25e9       # bytes/s: an assumed PCIe 4.0 x16-class link, not a measurement
POLICIES = ("prefill_first", "chunked")
ROUTING = ("round_robin", "least_loaded")
MODES = ("colocated", "disaggregated")

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
