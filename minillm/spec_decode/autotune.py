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
    time(k)   = T(1 + nodes(k)) + drafter(k)

where nodes(k) counts the draft nodes at depth <= k, T(r) is a step's time for r rows (read
off the measured points, below), and drafter(k) is k / K of the drafter's measured time for
one that runs once per depth (draft model, EAGLE, MTP) and all of it for one that drafts in
one pass (Medusa, the block drafters, the model-free ones); and picks the k of the highest
tokens(k) * T1 / time(k). A tree's size (EAGLE's and DDTree's node budget, ``tree_nodes``) is
chosen the same way: their drafts list the nodes best first, so the best b nodes of depth
<= k of a calibration draft are the tree of b nodes, and the accepted path such a tree would
have kept is the leading part of the measured path within them. The calibration predicts
tokens and rows for every (k, b) and picks the best pair: on a CPU, where verifying 17 rows
costs clearly more than a decode step, a small tree often beats the 16-node tree a GPU prefers.
When no k is predicted to beat plain decoding by ``MARGIN`` (the spread of the calibration's
own timings), the speculator keeps that k but does not draft
(``DraftAndVerify.drafting`` is False): the engine decodes plainly.

Under load the same prediction runs per batch size: the plain decode step is also measured
with 4, 16 and 64 sequences, and a step's cost is read off the curve of seconds against the
rows it computes (b sequences verifying 1 + nodes(k) rows each). Each step drafts only as deep
as :meth:`Calibration.k_for_batch` says pays for the sequences decoding in it, and not at all
when no depth does: as the batch grows, verification stops being nearly free.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from statistics import median

from ..config import SamplingParams
from ..engine.engine import LLMEngine

PER_DEPTH = ("draft_model", "eagle", "eagle3", "mtp")     # the drafter runs once per drafted depth
BUDGETED = ("eagle", "eagle3", "ddtree")    # trees whose drafts list their nodes best first
CALIBRATION_PROMPTS = 4
CALIBRATION_TOKENS = 32
BATCHES = (4, 16, 64)       # batch sizes whose plain step the calibration measures
MARGIN = 1.1                # drafting must be predicted this much faster: a calibration's
#                             step timings spread by about as much from run to run


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


def leviathan_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al.'s expected speedup, (1 - a^(k+1)) / ((1 - a)(k c + 1)): acceptance
    ``alpha`` per drafted token, lookahead ``k``, drafter cost ``c`` per drafted token in target
    steps, a verify pass counted as one step."""
    tokens = k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + 1)


@dataclass
class Calibration:
    """What one calibration measured, and the k it chose. ``reached[i]`` / ``nodes[i]``: per
    decode step, how often the accepted path reached depth i + 1 / the draft nodes at depth
    i + 1; seconds per decode step: ``plain_s`` (no drafting), ``step_s`` (drafting at
    ``max_k``, drafter included), ``draft_s`` (the drafter alone). ``trees`` (a tree whose
    size is tuned): {k: {b: (tokens, draft nodes) per decode step had the drafts kept their
    best b nodes of depth <= k}}; the full-size tree's follow from ``reached`` and
    ``nodes``."""

    method: str
    max_k: int
    plain_s: float
    step_s: float
    draft_s: float
    reached: list[float]
    nodes: list[float]
    per_depth: bool
    batch_s: dict[int, float] = field(default_factory=dict)
    trees: dict[int, dict[int, tuple[float, float]]] = field(default_factory=dict)

    def tokens(self, k: int, budget: int | None = None) -> float:
        """Predicted tokens per sequence and decode step at lookahead k (a tree of ``budget``
        nodes; None: the calibrated size)."""
        return self.trees[k][budget][0] if budget else 1.0 + sum(self.reached[:k])

    def draft_nodes(self, k: int, budget: int | None = None) -> float:
        """Predicted draft nodes per sequence and decode step at lookahead k (and size)."""
        return self.trees[k][budget][1] if budget else sum(self.nodes[:k])

    def rows_seconds(self, rows: float) -> float:
        """A step's seconds for ``rows`` new tokens, linear between the measured points: plain
        steps of b sequences (b rows; 1 and ``batch_s``) and the batch-1 drafting step
        (1 + nodes(K) rows, drafter excluded); past the last one, its slope goes on."""
        measured = {float(b): s for b, s in self.batch_s.items()} | {1.0: self.plain_s}
        if sum(self.nodes):
            measured[1.0 + sum(self.nodes)] = self.step_s - self.draft_s
        points = sorted(measured.items())
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if rows <= x1 or (x1, y1) == points[-1]:
                return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
        return self.plain_s * rows                     # one point only: proportional

    def seconds(self, k: int, batch: int = 1, budget: int | None = None) -> float:
        """Predicted seconds of a decode step of ``batch`` sequences at lookahead k: the
        target over their rows, plus the drafter (which scales with the batch like the
        target's plain step; a drafter running once per depth costs k / max_k of its
        calibrated time)."""
        if k == 0:
            return self.rows_seconds(batch)
        drafter = self.draft_s * (k / self.max_k if self.per_depth else 1.0)
        rows = batch * (1.0 + self.draft_nodes(k, budget))
        return self.rows_seconds(rows) + drafter * self.rows_seconds(batch) / self.plain_s

    def speedup(self, k: int, batch: int = 1, budget: int | None = None) -> float:
        """Predicted tokens per second at lookahead k (and tree size ``budget``) over plain
        decoding's, at ``batch``."""
        return self.tokens(k, budget) * self.rows_seconds(batch) / self.seconds(k, batch, budget)

    def best(self, batch: int = 1) -> tuple[int, int | None]:
        """The (k, tree size) of the best predicted speedup at ``batch`` (size None: the
        calibrated one, for a method whose size is not tuned)."""
        pairs = [(k, b) for k in range(1, self.max_k + 1) for b in self.trees.get(k, [None])]
        return max(pairs, key=lambda kb: self.speedup(kb[0], batch, kb[1]))

    @property
    def best_k(self) -> int:
        return self.best()[0]

    @property
    def best_budget(self) -> int | None:
        """The tree size chosen with :attr:`best_k` (None: not tuned)."""
        return self.best()[1]

    def k_for_batch(self, batch: int) -> int:
        """The lookahead of the best predicted speedup with ``batch`` sequences decoding (the
        tree size chosen at batch 1), 0 (no drafting) when none beats plain decoding by
        MARGIN."""
        b = self.best_budget
        k = max(range(1, self.max_k + 1), key=lambda k: self.speedup(k, batch, b))
        return k if self.speedup(k, batch, b) > MARGIN else 0

    @property
    def pays(self) -> bool:
        """Whether drafting at the best k is predicted to beat plain decoding by MARGIN."""
        k, b = self.best()
        return self.speedup(k, 1, b) > MARGIN

    def summary(self) -> dict:
        """JSON-ready: the measurements and the predicted speedup of every k (at the chosen
        tree size)."""
        b = self.best_budget
        return asdict(self) | {"k": self.best_k, "tree_nodes": b, "pays": self.pays,
                               "predicted": {k: round(self.speedup(k, 1, b), 4)
                                             for k in range(1, self.max_k + 1)},
                               "k_by_batch": {n: self.k_for_batch(n) for n in (1, 4, 16, 64)}}


def serve(engine: LLMEngine, groups: list[list[list[int]]], max_tokens: int, batch: int = 1
          ) -> list[float]:
    """Serve each group of prompts at once, one group after another (greedy, EOS ignored);
    returns the seconds of each decode-only step in which ``batch`` sequences decoded. Leaves
    no request, block or trace record behind."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    saved, records = list(engine.trace), []
    engine.step_hooks.append(lambda _engine, record: records.append(record))
    try:
        for group in groups:
            for p in group:
                engine.add_request(p, params)
            while engine.has_unfinished():
                engine.step()
    finally:
        engine.step_hooks.pop()
        engine.trace.clear()
        engine.trace.extend(saved)
    return [r.end - r.start for r in records
            if r.prefill_tokens == 0 and r.decode_tokens == batch]


def serve_one_by_one(engine: LLMEngine, prompts: list[list[int]], max_tokens: int
                     ) -> list[float]:
    """Serve ``prompts`` one after another; the seconds of each decode step."""
    return serve(engine, [[p] for p in prompts], max_tokens)


def plain_batches(engine: LLMEngine, prompts: list[list[int]], batches=BATCHES,
                  max_tokens: int = 8) -> dict[int, float]:
    """{b: median seconds of a plain decode step of b sequences} for the batch sizes the
    engine can hold at once."""
    out = {}
    for b in batches:
        if 1 < b <= engine.config.max_num_seqs:
            group = [prompts[i % len(prompts)] for i in range(b)]
            steps = serve(engine, [group], max_tokens, batch=b)
            if steps:
                out[b] = median(steps)
    return out


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
    batches = plain_batches(engine, prompts)
    spec = build(max_k)
    engine.use_speculator(spec)
    serve_one_by_one(engine, warm_up, 4)
    spec.stats = type(spec.stats)(log=[])
    steps = serve_one_by_one(engine, prompts, max_tokens)
    engine.speculator = engine.runner.speculator = None
    s, n = spec.stats, len(steps)
    proposed = (s.proposed + [0] * max_k)[:max_k]
    accepted = (s.accepted + [0] * max_k)[:max_k]
    nodes = [p * s.nodes / max(1, sum(proposed)) / n for p in proposed]   # a tree's width
    size = max((len(d) for d, _ in s.log), default=0) if method in BUDGETED else 0
    trees = {k: {b: cut_tree(s.log, k, b, n) for b in range(1, size + 1)}
             for k in range(1, max_k + 1)} if size else {}
    return Calibration(method, max_k, median(plain), sum(steps) / n,
                       s.propose_seconds / (n + len(prompts)),    # each prefill proposes too
                       [a / n for a in accepted], nodes, method in PER_DEPTH, batches, trees)


def cut_tree(log: list[tuple[list[int], list[int]]], k: int, size: int, steps: int
             ) -> tuple[float, float]:
    """(tokens, draft nodes) per decode step had each logged draft (its nodes' depths best
    first, the accepted path's node indices) kept only its best ``size`` nodes of depth
    <= k: the accepted path goes on while its nodes are among them."""
    tokens, nodes = float(steps), 0.0
    for depths, path in log:
        rank = {}                          # node index -> its place among depth <= k
        for i, d in enumerate(depths, start=1):
            if d <= k:
                rank[i] = len(rank) + 1
        nodes += min(size, len(rank))
        for node in path:
            if rank.get(node, size + 1) > size:
                break
            tokens += 1
    return tokens / steps, nodes / steps
