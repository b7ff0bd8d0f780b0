"""Checkers for the exercises of chapter 06b (block drafting: DFlash, DDTree, DSpark).

Each ``check_*`` compares the student's function with the package's
(:func:`minillm.spec_decode.trees.best_first_tree`, :func:`minillm.spec_decode.blocks.fill_budget`)
and, for the budget, with a brute-force search; prints a one-line verdict and returns a
:class:`~minillm.labs.common.Result` (``passed`` is None while the exercise still raises
NotImplementedError).

The builds run the student's function inside the block drafter or the engine:
:func:`check_block_mask` (the mask of the drafter's dense pass, against what each block sees
when served), :func:`check_best_first_tree_in_engine` (:class:`TreeFromFunction`: DDTree's
tree) and :func:`check_fill_budget_in_engine` (:class:`BudgetFromFunction`: DSpark's shared
verification budget).
"""
from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

import torch

from ..engine import EngineConfig, LLMEngine
from ..engine.sequence import Draft
from ..model.transformer import Transformer
from ..spec_decode.blocks import BlockProposer, fill_budget
from ..spec_decode.drafters import BlockDrafter, DrafterConfig, DraftHead, build_drafter
from ..spec_decode.inputs import SpecInput
from ..spec_decode.speculator import DraftAndVerify, SpecStats, build_speculator
from ..spec_decode.trees import best_first_tree
from .ch06 import sampling_model, serve_in_order
from .common import Result, check
from .in_engine import assert_same_tokens, demo_model, demo_prompts, serve_greedy

# --- DDTree: the best-first tree under a node budget -------------------------------------------


def rank_paths(parents, picks) -> list[tuple[int, ...]]:
    """The rank path (rank chosen at depth 0, 1, ...) of every node of a tree given as
    (parents, picks): node i + 1 sits under ``parents[i]`` (0: the root) and holds the candidate
    ``picks[i]`` = (depth, rank)."""
    paths: list[tuple[int, ...]] = []
    for p, (_, r) in zip(parents, picks):
        paths.append((paths[p - 1] if p else ()) + (int(r),))
    return paths


def path_logp(logps, path) -> float:
    """A node's score: the sum of its tokens' log-probabilities along the path."""
    return sum(logps[d][r] for d, r in enumerate(path))


def _random_logps(rng: random.Random, depth: int, k: int) -> list[list[float]]:
    """depth rows of k candidate log-probabilities, best first (the top-k of a random
    distribution, so a row sums to at most 1)."""
    rows = []
    for _ in range(depth):
        w = [rng.random() ** rng.choice([1, 3, 8]) for _ in range(k + rng.randint(0, 3))]
        total = sum(w)
        rows.append(sorted((math.log(x / total) for x in w), reverse=True)[:k])
    return rows


def _tree_cases() -> list[tuple[list[list[float]], int]]:
    sure = [math.log(0.9), math.log(0.05), math.log(0.03)]
    unsure = [math.log(0.55), math.log(0.4)]
    cases = [([sure] * 5, 5),                 # a confident drafter: the chain first, deep
             ([unsure] + [sure] * 4, 8),      # unsure at depth 0: both branches, deep
             ([sure, unsure, sure, sure], 7),
             ([unsure] * 3, 20),              # more budget than the 14 possible nodes
             ([sure] * 3, 1), ([[math.log(0.7)]], 3), ([], 4)]
    rng = random.Random(0)
    for _ in range(120):
        cases.append((_random_logps(rng, rng.randint(1, 7), rng.randint(1, 4)),
                      rng.randint(1, 24)))
    return cases


def check_best_first_tree(fn: Callable) -> Result:
    """``fn(logps, budget)`` -> (parents, picks): DDTree's tree. ``logps[d]`` holds depth d's
    candidate log-probabilities, best first; a node is a path of ranks from the root, scored
    by the sum of its log-probabilities; the tree is the ``budget`` nodes of highest score
    (fewer if there are fewer), each listed after its parent; ``parents[i]`` is node i + 1's
    parent (0: the root) and ``picks[i]`` its (depth, rank). Any parents-first order passes;
    the set of nodes must be the package's :func:`minillm.spec_decode.trees.best_first_tree`."""
    cases = _tree_cases()

    def attempt() -> None:
        for logps, budget in cases:
            want_parents, want_picks = best_first_tree(logps, budget)
            want = set(rank_paths(want_parents, want_picks))
            got_parents, got_picks = fn([list(r) for r in logps], budget)
            got_parents = [int(p) for p in got_parents]
            got_picks = [(int(d), int(r)) for d, r in got_picks]
            case = f"logps={[[round(x, 3) for x in r] for r in logps]}, budget={budget}"
            assert len(got_parents) == len(got_picks), (
                f"{case}: {len(got_parents)} parents but {len(got_picks)} picks")
            for i, (p, (d, r)) in enumerate(zip(got_parents, got_picks)):
                assert 0 <= p <= i, (f"{case}: node {i + 1}'s parent is {p}; a parent must "
                                     f"come before its child (0 <= parent <= {i})")
                pd = got_picks[p - 1][0] if p else -1
                assert d == pd + 1, (f"{case}: node {i + 1} is at depth {d} but its parent "
                                     f"{p} is at depth {pd}")
                assert 0 <= d < len(logps) and 0 <= r < len(logps[d]), (
                    f"{case}: node {i + 1} picks (depth {d}, rank {r}), no such candidate")
            paths = rank_paths(got_parents, got_picks)
            assert len(set(paths)) == len(paths), f"{case}: a node appears twice"
            assert len(paths) == len(want), (f"{case}: {len(paths)} nodes, expected "
                                             f"{len(want)}")
            extra = sorted(set(paths) - want, key=lambda q: -path_logp(logps, q))
            if extra:
                missing = sorted(want - set(paths), key=lambda q: -path_logp(logps, q))
                raise AssertionError(
                    f"{case}: node with ranks {extra[0]} (path log-prob "
                    f"{path_logp(logps, extra[0]):.3f}) is in your tree, but {missing[0]} "
                    f"({path_logp(logps, missing[0]):.3f}) scores higher and is not")

    return check("best_first_tree", attempt)


# --- DSpark: the shared verification budget -------------------------------------------------


def expected_accepted(confidences, lengths) -> float:
    """Expected accepted draft tokens when sequence s verifies its first ``lengths[s]`` tokens:
    the sum over kept tokens of their prefix probabilities prod_{j<=i} c[s][j]."""
    return sum(math.prod(c[:j + 1]) for c, n in zip(confidences, lengths) for j in range(n))


def best_fill(confidences, budget: int) -> float:
    """Brute force: the largest expected accepted count of any lengths within the budget."""
    best = 0.0
    for lens in itertools.product(*[range(len(c) + 1) for c in confidences]):
        if sum(lens) <= budget:
            best = max(best, expected_accepted(confidences, lens))
    return best


def _budget_cases() -> list[tuple[list[list[float]], int]]:
    cases = [([[0.9, 0.9, 0.9, 0.9], [0.1, 0.1, 0.1, 0.1]], 4),   # not an equal split
             ([[0.8, 0.8, 0.8], [0.6, 0.99, 0.99]], 3),        # prefix products, not raw
             ([[0.5, 0.99, 0.99, 0.99], [0.7, 0.3]], 4),
             ([[0.9, 0.2], [], [0.6]], 5),                        # more budget than tokens
             ([[0.9, 0.8]], 0), ([], 3), ([[0.3], [0.4], [0.5]], 2)]
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 4)
        conf = [[rng.random() ** rng.choice([0.3, 1, 3]) for _ in range(rng.randint(0, 5))]
                for _ in range(n)]
        cases.append((conf, rng.randint(0, 12)))
    return cases


def check_fill_budget(fn: Callable) -> Result:
    """``fn(confidences, budget)`` -> how many leading draft tokens each sequence verifies.
    ``confidences[s][i]``: P(token i of sequence s is accepted | those before it were); a
    sequence's tokens are kept in order; at most ``budget`` in all, and all of them when there
    are fewer. Passing answers maximise the expected number of accepted tokens (checked by
    brute force and against :func:`minillm.spec_decode.blocks.fill_budget`)."""
    cases = _budget_cases()

    def attempt() -> None:
        for conf, budget in cases:
            case = f"confidences={[[round(x, 3) for x in c] for c in conf]}, budget={budget}"
            got = [int(n) for n in fn([list(c) for c in conf], budget)]
            assert len(got) == len(conf), (f"{case}: {len(got)} lengths for {len(conf)} "
                                           f"sequences")
            for s, (n, c) in enumerate(zip(got, conf)):
                assert 0 <= n <= len(c), (f"{case}: sequence {s} keeps {n} tokens, it has "
                                          f"{len(c)}")
            total = min(budget, sum(len(c) for c in conf))
            assert sum(got) == total, (f"{case}: got {got}, {sum(got)} tokens in all; the "
                                       f"budget allows {total} and every kept token adds to "
                                       f"the expected count")
            value, best = expected_accepted(conf, got), best_fill(conf, budget)
            want = fill_budget(conf, budget)
            assert value >= best - 1e-9, (
                f"{case}: got {got}, expected accepted tokens {value:.4f}; the best is "
                f"{best:.4f} (the package's fill_budget gives {want}, "
                f"{expected_accepted(conf, want):.4f})")

    return check("fill_budget", attempt)


# --- builds: the mask in the drafter, the tree and the budget in the engine -----------------


def random_block_drafter(model: Transformer, block_size: int = 4, seed: int = 0,
                         draft_vocab: int = 512, sharpness: float = 1.0) -> tuple:
    """(module, head, manifest) for ``build_speculator(..., drafter=...)``: a block drafter
    (two layers, DSpark's heads of rank 8) with seeded random weights for ``model``, reading
    its layers 0 and 1, over the draft vocabulary of the first ``draft_vocab`` token ids, its
    logits multiplied by ``sharpness`` (above 1: confident at some positions, unsure at
    others, as a trained drafter is). It drafts badly but exercises every seam the trained
    one does."""
    c = model.cfg
    vd = min(draft_vocab, c.vocab_size)
    cfg = DrafterConfig("dflash", d_model=c.d_model, layers=2, n_heads=c.n_heads,
                        n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, ffn_dim=c.ffn_dim,
                        draft_vocab=vd, target_layers=(0, 1), block_size=block_size,
                        markov_rank=8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build_drafter(cfg, model)
        with torch.no_grad():
            for w in module.parameters():
                if w.dim() == 2:
                    w.normal_(0, 0.2)
    module = module.to(device=model.device, dtype=model.dtype).eval()
    ids = torch.arange(vd, device=model.device)
    return module, DraftHead(model.lm_head.weight * sharpness, ids), {}


@torch.inference_mode()
def block_outputs(drafter: BlockDrafter, embed, features: torch.Tensor,
                  blocks: list[tuple[int, int]], mask: torch.Tensor | None
                  ) -> list[torch.Tensor]:
    """One dense pass of the drafter: context rows from ``features`` [T, m * D] (the target's
    states at positions 0..T-1), then one block per (anchor position a, anchor token) of
    ``blocks`` (the token's embedding, then S - 1 MASK rows, at positions a..a + S - 1), rows
    seeing each other as ``mask`` [R, R] allows (None: every row sees every row). Each block's
    outputs [S, D]."""
    s, t = drafter.cfg.block_size, len(features)
    dtype = drafter.mask_embedding.dtype
    ctx = drafter.context(features.to(dtype))
    anchors = torch.tensor([tok for _, tok in blocks], dtype=torch.long, device=ctx.device)
    rows = [ctx] + [torch.cat([e[None].to(dtype), drafter.mask_embedding.expand(s - 1, -1)])
                    for e in embed(anchors)]
    positions = torch.cat([torch.arange(t)] + [torch.arange(a, a + s) for a, _ in blocks])
    r = t + len(blocks) * s
    mask = torch.ones(r, r, dtype=torch.bool) if mask is None else mask
    out = drafter(torch.cat(rows)[None], (torch.arange(r) < t).to(ctx.device),
                  positions.to(ctx.device), mask=mask.to(ctx.device)[None])[0, t:]
    return list(out.split(s))


def _window_cases(rng: random.Random) -> list[tuple[int, list[int]]]:
    cases = [(6, [3]), (6, [0]), (8, [2, 5, 7]), (5, []), (7, [6, 1])]
    for _ in range(6):
        t = rng.randint(1, 12)
        cases.append((t, sorted(rng.sample(range(t), rng.randint(1, min(t, 3))))))
    return cases


def check_block_mask(fn: Callable, drafter: BlockDrafter | None = None, embed=None,
                     tokens: list[int] | None = None, features: torch.Tensor | None = None
                     ) -> Result:
    """``fn(t, anchors, s)`` -> bool mask [R, R], R = t + len(anchors) * s, of the block
    drafter's dense pass over a window: t context rows (one per position of the window), then
    one block of s rows per anchor a (a position of the window; the block's first row holds the
    token at a). A context row sees itself only. The mask is then put to work: the drafter's
    dense pass with it must give every block the outputs the block gets when served alone
    (the context rows before its anchor, then the block, every row seeing every row), within
    rounding. Runs on small random windows of a random drafter, and, when given, on
    ``drafter`` (with ``embed``, the target's embedding) over the window ``tokens`` with its
    ``features`` [T, m * D] and three anchors."""
    rng = random.Random(0)

    def attempt() -> None:
        fn(2, [1], 2)                                # a stub raises NotImplementedError here
        target = sampling_model()
        small, _, _ = random_block_drafter(target, block_size=3, draft_vocab=64)
        g = torch.Generator().manual_seed(0)
        runs = []
        for t, anchors in _window_cases(rng):
            feats = torch.randn(t, 2 * target.cfg.d_model, generator=g, dtype=torch.float64)
            toks = torch.randint(0, 256, (t,), generator=g).tolist()
            runs.append((small, target.embed, toks, feats, anchors))
        if drafter is not None:
            t, s = len(tokens), drafter.cfg.block_size
            runs.append((drafter, embed, list(tokens), features, [s, t // 2, t - 1]))
        for module, emb, toks, feats, anchors in runs:
            _check_window(fn, module, emb, toks, feats, anchors)

    return check("block_mask", attempt)


def _check_window(fn: Callable, drafter: BlockDrafter, embed, tokens: list[int],
                  features: torch.Tensor, anchors: list[int]) -> None:
    """The student's mask for one window: its context rows, then its blocks in the dense pass
    against each block served alone."""
    t, s = len(tokens), drafter.cfg.block_size
    case = f"t={t}, anchors={anchors}, s={s}"
    mask = torch.as_tensor(fn(t, list(anchors), s)).bool().cpu()
    r = t + len(anchors) * s
    assert tuple(mask.shape) == (r, r), (f"{case}: mask of shape {tuple(mask.shape)}, "
                                         f"expected ({r}, {r})")
    for i in range(t):
        seen = mask[i].nonzero().flatten().tolist()
        assert seen == [i], f"{case}: context row {i} sees rows {seen}; it sees itself only"
    dense = block_outputs(drafter, embed, features, [(a, tokens[a]) for a in anchors], mask)
    tol = 1e-9 if drafter.mask_embedding.dtype == torch.float64 else 1e-4
    for b, (a, got) in enumerate(zip(anchors, dense)):
        alone = block_outputs(drafter, embed, features[:a], [(a, tokens[a])], None)[0]
        err = float((got - alone).abs().max())
        assert err <= tol * max(1.0, float(alone.abs().max())), (
            f"{case}: the block of anchor {a} (rows {t + b * s}..{t + b * s + s - 1}) differs "
            f"by up to {err:.3g} from the same block served alone: it must see the context "
            f"rows of the positions before its anchor, its own rows in both directions, and "
            f"nothing else")


class _AroundBlockProposer:
    """A proposer that lets the package's block proposer ``inner`` draft, then rebuilds each
    draft with the student's ``fn``; ``mismatch`` keeps the first disagreement with the
    package's own draft. Forks and releases go to ``inner``."""

    def __init__(self, fn: Callable, inner: BlockProposer) -> None:
        self.fn, self.inner = fn, inner
        self.hidden_layers, self.max_nodes = inner.hidden_layers, inner.max_nodes
        self.mismatch: str | None = None

    def fork(self, parent_id: int, child_id: int) -> None:
        self.inner.fork(parent_id, child_id)

    def release(self, seq_id: int) -> None:
        self.inner.release(seq_id)


class TreeFromFunction(_AroundBlockProposer):
    """DDTree with exercise (b)'s ``best_first_tree`` building the trees: the package's block
    proposer ``inner`` (method ddtree) drafts each block and keeps, per sequence, the
    candidates of every depth (``inner.last``: their log-probabilities ``logp`` and tokens
    ``candidates``, and the package's tree); the draft is then ``fn(logp, tree_nodes)``, its
    nodes' tokens read from the candidates, and ``inner.last`` describes it instead. Each tree
    is compared with the package's from the same block: ``mismatch`` holds the first that
    differs (as a set of rank paths)."""

    def propose(self, inputs: list[SpecInput], hidden: dict) -> list[Draft | None]:
        drafts = self.inner.propose(inputs, hidden)
        for i, inp in enumerate(inputs):
            if drafts[i] is not None:
                drafts[i] = self._tree(self.inner.last[inp.seq.seq_id])
        return drafts

    def _tree(self, last: dict) -> Draft:
        logp, budget = last["logp"], self.inner.tree_nodes
        parents, picks = self.fn([list(row) for row in logp], budget)
        parents = [int(p) for p in parents]
        picks = [(int(d), int(r)) for d, r in picks]
        if len(parents) != len(picks) or len(parents) > budget:
            raise ValueError(f"best_first_tree returned {len(parents)} parents and "
                             f"{len(picks)} picks for a budget of {budget} nodes")
        bad = [(d, r) for d, r in picks if not (0 <= d < len(logp) and 0 <= r < len(logp[d]))]
        if bad:
            raise ValueError(f"best_first_tree picked (depth, rank) {bad[0]}: no such "
                             f"candidate among {len(logp)} depths of {len(logp[0])}")
        draft = Draft([last["candidates"][d][r] for d, r in picks], parents)
        mine, want = set(rank_paths(parents, picks)), set(rank_paths(last["parents"],
                                                                      last["picks"]))
        if mine != want and self.mismatch is None:
            self.mismatch = (f"logps={[[round(x, 3) for x in row] for row in logp]}, "
                             f"budget={budget}: your tree has the rank paths "
                             f"{sorted(mine - want)[:3]} where the package's has "
                             f"{sorted(want - mine)[:3]}")
        last.update(tokens=draft.tokens, parents=parents, picks=picks)
        return draft


def _block_engine(model: Transformer, options: dict, drafter: tuple | None, max_seqs: int,
                  wrap: Callable | None = None) -> LLMEngine:
    """An engine speculating with the block drafter (``options``: a speculative_config);
    ``wrap(proposer)``: the proposer to use instead of the package's."""
    nodes = options.get("tree_nodes", 16)
    engine = LLMEngine(model, None, EngineConfig(
        max_num_seqs=max_seqs, num_kv_blocks=256,
        max_num_batched_tokens=max(2048, max_seqs * (1 + nodes))))
    base = build_speculator(options, engine, drafter=drafter)
    if wrap is not None:
        base = DraftAndVerify(base.config, base.max_seq_len, wrap(base.proposer))
    engine.use_speculator(base)
    return engine


def _same_stats(got: SpecStats, want: SpecStats) -> bool:
    return (got.rounds, got.proposed, got.accepted, got.nodes) == \
        (want.rounds, want.proposed, want.accepted, want.nodes)


def _summary(s: SpecStats, run: dict, plain: dict) -> str:
    return (f"{s.mean_accepted:.2f} tokens per verification, {s.nodes / max(1, s.rounds):.1f} "
            f"draft tokens verified per round, {run['seconds']:.2f} s "
            f"({plain['seconds'] / run['seconds']:.2f}x plain's speed)")


SHARPNESS = 20.0    # the random drafter's for DDTree: confident enough that search orders differ


def _demo_prompts(n: int) -> list[list[int]]:
    return demo_prompts(n)[0]


def check_best_first_tree_in_engine(fn: Callable, model: Transformer | None = None,
                                    prompts: list[list[int]] | None = None,
                                    max_tokens: int = 16, drafter: tuple | None = None,
                                    k: int = 3, tree_nodes: int = 8, tree_topk: int = 3
                                    ) -> Result:
    """Exercise (b)'s ``best_first_tree`` builds DDTree's trees in the engine
    (:class:`TreeFromFunction`), greedy, one prompt after another: the block drafter
    (``drafter``: (module, head, manifest); default a random one) drafts ``k`` positions with
    ``tree_topk`` candidates each, and your function picks ``tree_nodes`` of them. Passes
    when every request gets the plain engine's tokens, every tree has the package's nodes,
    and the verification rounds accept what the package's DDTree's do; prints tokens per
    verification and speed both ways. Defaults: the tiny float64 model, random prompts."""
    model = model or demo_model()
    prompts = prompts if prompts is not None else _demo_prompts(3)
    block = drafter or random_block_drafter(model, sharpness=SHARPNESS)
    options = {"method": "ddtree", "num_speculative_tokens": k, "tree_nodes": tree_nodes,
               "tree_topk": tree_topk}

    def attempt() -> None:
        fn([[-0.1, -2.0]], 1)                        # a stub raises NotImplementedError here
        plain = serve_in_order(LLMEngine(model, None, EngineConfig(num_kv_blocks=256)),
                               prompts, max_tokens)
        ref_engine = _block_engine(model, options, block, 1)
        ref = serve_in_order(ref_engine, prompts, max_tokens)
        engine = _block_engine(model, options, block, 1,
                               lambda inner: TreeFromFunction(fn, inner))
        mine = serve_in_order(engine, prompts, max_tokens)
        assert_same_tokens(mine, plain)
        mismatch = engine.speculator.proposer.mismatch
        assert mismatch is None, mismatch
        got, want = engine.speculator.stats, ref_engine.speculator.stats
        assert _same_stats(got, want), (
            f"the same trees, but {got.rounds} rounds accepting {got.accepted} by depth where "
            f"the package's DDTree had {want.rounds} accepting {want.accepted}")
        print(f"DDTree with your best_first_tree: {_summary(got, mine, plain)}; with the "
              f"package's: {_summary(want, ref, plain)}")

    return check("best_first_tree_in_engine", attempt)


class BudgetFromFunction(_AroundBlockProposer):
    """DSpark with exercise (c)'s ``fill_budget`` sharing the verification budget: the
    package's block proposer ``inner`` (method dspark) drafts every sequence's chain with its
    confidences and cuts it at the early exit (``inner.last``: ``tokens``, ``confidence``,
    ``exit``, and ``kept``, the package's share); the shares are then
    ``fn(confidences up to each exit, budget)`` and each draft keeps that many leading tokens.
    ``mismatch`` holds the first step whose shares expect fewer accepted tokens than the
    package's (:func:`expected_accepted`). Greedy requests only (a sampled draft's
    distributions are kept for the package's lengths)."""

    def propose(self, inputs: list[SpecInput], hidden: dict) -> list[Draft | None]:
        drafts = self.inner.propose(inputs, hidden)
        live = [i for i, inp in enumerate(inputs) if inp.max_depth]
        if not live:
            return drafts
        if not all(inputs[i].params.greedy for i in live):
            raise ValueError("BudgetFromFunction serves greedy requests only")
        lasts = [self.inner.last[inputs[i].seq.seq_id] for i in live]
        conf = [last["confidence"][:last["exit"]] for last in lasts]
        budget = int(min(math.inf if self.inner.budget is None else self.inner.budget,
                         sum(map(len, conf))))
        got = [int(n) for n in self.fn([list(c) for c in conf], budget)]
        case = f"confidences={[[round(x, 3) for x in c] for c in conf]}, budget={budget}"
        if len(got) != len(conf) or sum(got) > budget or any(
                not 0 <= n <= len(c) for n, c in zip(got, conf)):
            raise ValueError(f"fill_budget gave {got} for {case}: one length per sequence, "
                             f"each within its draft, {budget} tokens at most in all")
        want = [last["kept"] for last in lasts]
        if expected_accepted(conf, got) < expected_accepted(conf, want) - 1e-9 and \
                self.mismatch is None:
            self.mismatch = (f"{case}: your shares {got} expect "
                             f"{expected_accepted(conf, got):.3f} accepted tokens, the "
                             f"package's {want} {expected_accepted(conf, want):.3f}")
        for i, last, n in zip(live, lasts, got):
            sid = inputs[i].seq.seq_id
            last["kept"] = n
            drafts[i] = Draft.chain(last["tokens"][:n]) if n else None
            if n:
                self.inner.pending[sid] = last["confidence"][:n]
            else:
                self.inner.pending.pop(sid, None)
        return drafts


def check_fill_budget_in_engine(fn: Callable, model: Transformer | None = None,
                                prompts: list[list[int]] | None = None, max_tokens: int = 16,
                                drafter: tuple | None = None, k: int = 3,
                                verify_budget: int | None = None,
                                confidence_threshold: float = 0.01) -> Result:
    """Exercise (c)'s ``fill_budget`` shares DSpark's verification budget in the engine
    (:class:`BudgetFromFunction`): every prompt at once (the budget is the batch's), greedy;
    the block drafter (``drafter``: (module, head, manifest); default a random one) drafts
    ``k`` tokens per sequence with confidences, cut at ``confidence_threshold``, and your
    function decides how many of them each sequence verifies, ``verify_budget`` in all
    (default: half of what the batch drafts, so that it binds). Passes when every request
    gets the plain engine's tokens, no step verifies more than the budget, every step's
    shares expect as many accepted tokens as the package's, and the verification rounds
    accept what the package's DSpark's do; prints tokens per verification and speed both
    ways. Defaults: the tiny float64 model, random prompts."""
    model = model or demo_model()
    prompts = prompts if prompts is not None else _demo_prompts(4)
    n = len(prompts)
    budget = verify_budget if verify_budget is not None else max(n, n * k // 2)
    options = {"method": "dspark", "num_speculative_tokens": k, "verify_budget": budget,
               "confidence_threshold": confidence_threshold}
    block = drafter or random_block_drafter(model)
    lens = [max_tokens] * n

    def attempt() -> None:
        fn([[0.9, 0.5], [0.8]], 2)                   # a stub raises NotImplementedError here
        plain = serve_greedy(LLMEngine(model, None, EngineConfig(num_kv_blocks=256,
                                                                 max_num_seqs=n)), prompts, lens)
        ref_engine = _block_engine(model, options, block, n)
        ref = serve_greedy(ref_engine, prompts, lens)
        engine = _block_engine(model, options, block, n,
                               lambda inner: BudgetFromFunction(fn, inner))
        mine = serve_greedy(engine, prompts, lens)
        assert_same_tokens(mine, plain)
        most = max(r.drafted_tokens for r in engine.trace)
        assert most <= budget, f"a step verified {most} draft tokens; the budget is {budget}"
        mismatch = engine.speculator.proposer.mismatch
        assert mismatch is None, mismatch
        got, want = engine.speculator.stats, ref_engine.speculator.stats
        assert _same_stats(got, want), (
            f"shares as good as the package's, but {got.rounds} rounds accepting "
            f"{got.accepted} by depth where the package's DSpark had {want.rounds} accepting "
            f"{want.accepted}")
        print(f"DSpark, budget {budget} for {n} sequences, with your fill_budget: "
              f"{_summary(got, mine, plain)}; with the package's: {_summary(want, ref, plain)}")

    return check("fill_budget_in_engine", attempt)


__all__ = ["BudgetFromFunction", "TreeFromFunction", "best_fill", "block_outputs",
           "check_best_first_tree", "check_best_first_tree_in_engine", "check_block_mask",
           "check_fill_budget", "check_fill_budget_in_engine", "expected_accepted", "path_logp",
           "random_block_drafter", "rank_paths"]
