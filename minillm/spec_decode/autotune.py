"""``num_speculative_tokens="auto"``: the lookahead k chosen from what this machine measures.

Leviathan et al. (2023, "Fast Inference from Transformers via Speculative Decoding") give the
speedup of drafting k tokens with acceptance rate a and a drafter costing c of a target step as
(1 - a^(k+1)) / ((1 - a)(k c + 1)). Its two assumptions rarely hold on a CPU: acceptance falls
with depth, and verifying k + 1 tokens costs more than one decode step. So the engine measures
instead, on a few calibration prompts (one at a time, greedy):

- a plain run: T1, the median seconds of a decode step (a step slowed by another process does
  not move it);
- a run drafting at the method's largest k (K): how often the accepted path reached each depth,
  how many nodes each depth adds, the drafter's seconds per step and the mean seconds of a step
  (a mean: steps with and without a draft both count).

For each k <= K it predicts, per decode step,

    tokens(k) = 1 + sum_{i<=k} P(accepted path reaches depth i)
    time(k)   = T1 + (T_verify(K) - T1) * nodes(k) / nodes(K) + drafter(k)

where nodes(k) counts the draft nodes at depth <= k and drafter(k) scales with nodes(k) for a
drafter that runs once per depth (draft model, EAGLE, MTP) and is fixed for one that drafts in
one pass (Medusa, the block drafters, the model-free ones); and picks the k of the highest
tokens(k) * T1 / time(k). When no k is predicted to beat plain decoding, the speculator keeps
that k but does not draft (``DraftAndVerify.drafting`` is False): the engine decodes plainly.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from statistics import median

from ..config import SamplingParams
from ..engine.engine import LLMEngine

PER_DEPTH = ("draft_model", "eagle", "eagle3", "mtp")     # the drafter runs once per drafted depth
CALIBRATION_PROMPTS = 4
CALIBRATION_TOKENS = 32


def acceptance_rate(mean_tokens: float, k: int) -> float:
    """Leviathan's a: the a with (1 - a^(k+1)) / (1 - a) = mean tokens per round (bisection;
    0 <= a < 1)."""
    lo, hi = 0.0, 1.0 - 1e-9
    for _ in range(60):
        mid = (lo + hi) / 2
        if (1 - mid ** (k + 1)) / (1 - mid) < mean_tokens:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Calibration:
    """What one calibration measured, and the k it chose. ``reached[i]`` / ``nodes[i]``: per
    decode step, how often the accepted path reached depth i + 1 / the draft nodes at depth
    i + 1; seconds per decode step: ``plain_s`` (no drafting), ``step_s`` (drafting at
    ``max_k``, drafter included), ``draft_s`` (the drafter alone)."""

    method: str
    max_k: int
    plain_s: float
    step_s: float
    draft_s: float
    reached: list[float]
    nodes: list[float]
    per_depth: bool

    def tokens(self, k: int) -> float:
        """Predicted tokens per decode step at lookahead k."""
        return 1.0 + sum(self.reached[:k])

    def seconds(self, k: int) -> float:
        """Predicted seconds per decode step at lookahead k."""
        share = sum(self.nodes[:k]) / sum(self.nodes) if sum(self.nodes) else 0.0
        verify = self.step_s - self.draft_s
        drafter = self.draft_s * (share if self.per_depth else 1.0)
        return self.plain_s + (verify - self.plain_s) * share + drafter

    def speedup(self, k: int) -> float:
        return self.tokens(k) * self.plain_s / self.seconds(k)

    @property
    def best_k(self) -> int:
        return max(range(1, self.max_k + 1), key=self.speedup)

    @property
    def pays(self) -> bool:
        """Whether drafting at the best k is predicted to beat plain decoding at all."""
        return self.speedup(self.best_k) > 1.0

    def summary(self) -> dict:
        """JSON-ready: the measurements and the predicted speedup of every k."""
        return asdict(self) | {"k": self.best_k, "pays": self.pays, "predicted": {
            k: round(self.speedup(k), 4) for k in range(1, self.max_k + 1)}}


def serve_one_by_one(engine: LLMEngine, prompts: list[list[int]], max_tokens: int
                     ) -> list[float]:
    """Serve ``prompts`` one after another (greedy, EOS ignored); returns the seconds of each
    decode-only step. Leaves no request, block or trace record behind."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    saved, records = list(engine.trace), []
    engine.step_hooks.append(lambda _engine, record: records.append(record))
    try:
        for p in prompts:
            engine.add_request(p, params)
            while engine.has_unfinished():
                engine.step()
    finally:
        engine.step_hooks.pop()
        engine.trace.clear()
        engine.trace.extend(saved)
    return [r.end - r.start for r in records if r.prefill_tokens == 0 and r.decode_tokens]


def calibrate(engine: LLMEngine, method: str, max_k: int,
              build: Callable[[int], object], prompts: list[list[int]],
              max_tokens: int = CALIBRATION_TOKENS) -> Calibration:
    """Measure ``method`` on ``engine`` (no requests in it) at lookahead ``max_k``: ``build(k)``
    makes the speculator; ``prompts`` (token ids) are served one at a time, after a short
    warm-up request. The engine is left without a speculator."""
    if engine.requests:
        raise ValueError("num_speculative_tokens='auto' calibrates before requests are added")
    if not prompts:
        raise ValueError("num_speculative_tokens='auto' needs calibration prompts")
    warm_up = [prompts[0][:8]]
    engine.speculator = engine.runner.speculator = None
    serve_one_by_one(engine, warm_up, 4)
    plain = serve_one_by_one(engine, prompts, max_tokens // 2)
    spec = build(max_k)
    engine.use_speculator(spec)
    serve_one_by_one(engine, warm_up, 4)
    spec.stats = type(spec.stats)()
    steps = serve_one_by_one(engine, prompts, max_tokens)
    engine.speculator = engine.runner.speculator = None
    s, n = spec.stats, len(steps)
    proposed = (s.proposed + [0] * max_k)[:max_k]
    accepted = (s.accepted + [0] * max_k)[:max_k]
    nodes = [p * s.nodes / max(1, sum(proposed)) / n for p in proposed]   # a tree's width
    return Calibration(method, max_k, median(plain), sum(steps) / n,
                       s.propose_seconds / (n + len(prompts)),    # each prefill proposes too
                       [a / n for a in accepted], nodes, method in PER_DEPTH)
