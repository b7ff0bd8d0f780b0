"""Checkers for the exercises of chapter 06 (speculative decoding).

Each ``check_*`` compares the student's function with the package's
(:mod:`minillm.spec_decode`, the draft tree's
:meth:`~minillm.engine.sequence.Draft.tree_inputs`) or, for the sampling rule, with the target
distribution itself, prints a one-line verdict and returns a
:class:`~minillm.labs.common.Result` (``passed`` is None while the exercise still raises
NotImplementedError).

The ``check_*_in_engine`` builds put the student's function into the engine's speculator
(:class:`~minillm.engine.speculation.Speculator`, here the package's
:class:`~minillm.spec_decode.DraftAndVerify`: a proposer plus verification rules) through a small
adapter: :class:`StepVerify` (the one-step sampling rule verifies sampled chains),
:class:`FunctionLookup` (prompt lookup is the drafter), :class:`MaskedDraft` (the tree mask
drives a tree verification pass). ``check_ttt_mask`` grades EAGLE-3's training-time test mask
against :mod:`minillm.spec_decode.training.eagle3`.
"""
from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..checkpoint import random_model
from ..config import SamplingParams, get_preset
from ..course.ch06_sampling import (
    first_tokens_distribution,
    marginal,
    sample_first_tokens,
    sampling_engine,
    total_variation,
    tv_tolerance,
)
from ..engine import EngineConfig, LLMEngine
from ..engine.sampler import SamplingBatch, filtered_probs
from ..engine.sequence import Draft, Sequence
from ..model.transformer import Transformer
from ..spec_decode.config import SpeculativeConfig
from ..spec_decode.drafters import DrafterConfig, DraftHead, build_drafter
from ..spec_decode.inputs import SpecInput
from ..spec_decode.ngram import prompt_lookup
from ..spec_decode.proposers import NgramProposer
from ..spec_decode.speculator import DraftAndVerify, SpecStats, build_speculator
from ..spec_decode.trees import medusa_tree, tree_parents
from ..spec_decode.verify import greedy_accept
from .common import Result, check
from .in_engine import assert_same_tokens, demo_model, finish_all


def check_greedy_accept(fn: Callable) -> Result:
    """``fn(draft, target_argmax)`` -> (accepted count a, next token): the longest prefix of
    ``draft`` (k tokens) that equals the target's argmax at the same rows, and the target's own
    token after it (``target_argmax`` has k + 1 entries). Compared with
    :func:`minillm.spec_decode.greedy_accept`."""
    rng = random.Random(0)
    cases = [([], [7]), ([5], [5, 9]), ([5], [4, 9]), ([1, 2, 3], [1, 2, 3, 4]),
             ([1, 2, 3], [1, 9, 3, 4]), ([1, 2, 3], [9, 2, 3, 4])]
    for _ in range(60):
        k = rng.randint(0, 7)
        target = [rng.randint(0, 4) for _ in range(k + 1)]
        draft = [t if rng.random() < 0.7 else rng.randint(0, 4) for t in target[:k]]
        cases.append((draft, target))

    def attempt() -> None:
        for draft, target in cases:
            got = fn(list(draft), list(target))
            want = greedy_accept(draft, target)
            assert tuple(int(x) for x in got) == want, (f"draft={draft}, target_argmax={target}: "
                                                        f"got {tuple(got)}, expected {want}")

    return check("greedy_accept", attempt)


# --- the lossless sampling step --------------------------------------------------------------

DISTRIBUTIONS = [      # (p, q): target and drafter over a 6-token vocabulary
    ([0.30, 0.25, 0.20, 0.10, 0.10, 0.05], [0.05, 0.10, 0.15, 0.20, 0.20, 0.30]),
    ([0.50, 0.00, 0.20, 0.15, 0.15, 0.00], [0.20, 0.40, 0.00, 0.10, 0.10, 0.20]),
]


def emitted_distribution(step: Callable, p, q, rounds: int = 20_000, seed: int = 0
                         ) -> torch.Tensor:
    """Run ``step(d, q, p, u, generator)`` ``rounds`` times with d ~ q and u ~ U(0, 1); the
    empirical distribution [V] of the token it emits."""
    p = torch.as_tensor(p, dtype=torch.float64)
    q = torch.as_tensor(q, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, rounds, replacement=True, generator=g).tolist()
    us = torch.rand(rounds, generator=g, dtype=torch.float64).tolist()
    counts = torch.zeros(len(p), dtype=torch.float64)
    for d, u in zip(drafts, us):
        _, token = step(d, q, p, u, g)
        counts[int(token)] += 1
    return counts / rounds


def check_rejection_step(fn: Callable, rounds: int = 20_000) -> Result:
    """``fn(draft_token, q, p, u, generator)`` -> (accepted, token): one step of lossless
    speculative sampling. Keep the draft d (sampled from q) when u * q[d] < p[d] (u < p/q); else
    draw from the residual max(0, p - q), renormalised, with
    ``torch.multinomial(residual, 1, generator=generator)``.

    First exact cases (the accept decision, the token on acceptance, no residual token where
    p <= q), then the distribution test: the emitted token over ``rounds`` steps with d ~ q must
    be within about 4 standard errors (total variation) of p."""

    def attempt() -> None:
        g = torch.Generator().manual_seed(1)
        p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
        q = torch.tensor([0.4, 0.4, 0.1, 0.1], dtype=torch.float64)
        for d, u in [(0, 0.2), (0, 0.3), (1, 0.45), (1, 0.55), (2, 0.99), (3, 0.0)]:
            want = bool(u * q[d] < p[d])
            accepted, token = fn(d, q.clone(), p.clone(), u, g)
            assert bool(accepted) == want, (f"p={p.tolist()}, q={q.tolist()}, draft {d}, "
                                            f"u={u}: accepted={bool(accepted)}, expected {want} "
                                            f"(p/q = {float(p[d] / q[d]):.3g})")
            if want:
                assert int(token) == d, (f"draft {d} accepted (u={u}) but the token emitted is "
                                         f"{int(token)}, not the draft")
            else:
                assert p[int(token)] > q[int(token)], (
                    f"draft {d} rejected (u={u}); the correction {int(token)} has p <= q there "
                    f"(p={float(p[int(token)]):.2f}, q={float(q[int(token)]):.2f}): it must "
                    f"come from the residual max(0, p - q)")
        for p, q in DISTRIBUTIONS:
            emp = emitted_distribution(fn, p, q, rounds)
            tv = 0.5 * float((emp - torch.tensor(p, dtype=torch.float64)).abs().sum())
            tol = tv_tolerance(p, rounds)
            assert tv <= tol, (f"p={p}, q={q}: over {rounds} steps the emitted tokens' "
                               f"distribution {[round(x, 3) for x in emp.tolist()]} is "
                               f"{tv:.3f} from p in total variation (tolerance {tol:.3f}): the "
                               f"output is not distributed as the target")

    return check("rejection_step", attempt)


def check_prompt_lookup(fn: Callable) -> Result:
    """``fn(tokens, k, max_n)`` -> up to k drafted tokens: the continuation of the most recent
    earlier occurrence of the last n tokens, for n = max_n down to 1; [] when none occurs.
    Compared with :func:`minillm.spec_decode.prompt_lookup` on crafted and random sequences."""
    rng = random.Random(0)
    cases = [([1], 3, 2), ([1, 2, 3, 4], 3, 2), ([1, 2, 3, 1, 2], 3, 2),
             ([1, 2, 3, 1, 2, 4, 1, 2], 3, 2),       # the most recent occurrence wins
             ([5, 1, 9, 7, 1, 2, 6, 6, 7, 1, 2], 4, 3),
             ([7, 1, 2, 8, 3, 1, 2, 4, 7, 1, 2], 2, 3),   # the longest n first, even far back
             ([3, 3, 3, 3], 5, 2)]                    # the continuation runs into the tail
    for _ in range(150):
        n = rng.randint(1, 30)
        vocab = rng.choice([2, 3, 5, 8])
        cases.append(([rng.randrange(vocab) for _ in range(n)], rng.randint(1, 6),
                      rng.randint(1, 4)))

    def attempt() -> None:
        for tokens, k, max_n in cases:
            got = [int(t) for t in fn(list(tokens), k, max_n)]
            want = prompt_lookup(tokens, k, max_n)
            assert got == want, (f"tokens={tokens}, k={k}, max_n={max_n}: got {got}, "
                                 f"expected {want}")

    return check("prompt_lookup", attempt)


def check_tree_mask(fn: Callable) -> Result:
    """``fn(parents)`` -> bool mask [N + 1, N + 1] of a draft tree (node 0 the root, node i + 1
    with parent ``parents[i]`` < i + 1): True where row i may attend to column j, i.e. j is i
    itself or one of its ancestors. Compared with
    :meth:`minillm.engine.sequence.Draft.tree_inputs`."""
    rng = random.Random(0)
    acc = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1], [0.2]]
    cases = [[], [0], [0, 1, 2, 3], [0, 0, 0], [0, 0, 1, 1, 2], tree_parents(medusa_tree(acc, 12))]
    for _ in range(30):
        n = rng.randint(1, 20)
        cases.append([rng.randint(max(0, i - 3), i) for i in range(n)])

    def attempt() -> None:
        for parents in cases:
            got = torch.as_tensor(fn(list(parents))).bool()
            want = torch.tensor(Draft([0] * len(parents), list(parents)).tree_inputs(0)[0])
            assert got.shape == want.shape, (f"parents={parents}: mask shape {tuple(got.shape)}, "
                                             f"expected {tuple(want.shape)}")
            bad = (got != want).nonzero().tolist()
            assert not bad, (f"parents={parents}: wrong at (row, column) {bad[0]}: got "
                             f"{bool(got[tuple(bad[0])])}, expected {bool(want[tuple(bad[0])])}")

    return check("tree_mask", attempt)


def check_ttt_mask(fn: Callable) -> Result:
    """``fn(step, t)`` -> bool mask [t, step * t] of EAGLE-3's training-time test: which keys a
    step-``step`` query row sees, the keys being the t rows of steps 1..step side by side.
    Query t sees the step-1 keys s <= t - (step - 1) (the committed context) and, of each later
    step i, the one key s = t - (step - i) (its own draft so far). Compared with
    :func:`minillm.spec_decode.training.eagle3.ttt_mask`."""
    from ..spec_decode.training.eagle3 import ttt_mask
    cases = [(step, t) for step in range(1, 6) for t in (1, 2, 3, 5, 8)]

    def attempt() -> None:
        for step, t in cases:
            got = torch.as_tensor(fn(step, t)).bool()
            want = ttt_mask(step, t)
            assert got.shape == want.shape, (f"step={step}, t={t}: mask shape "
                                             f"{tuple(got.shape)}, expected {tuple(want.shape)}")
            bad = (got != want).nonzero().tolist()
            if bad:
                q, col = bad[0]
                i, s = divmod(col, t)
                raise AssertionError(
                    f"step={step}, t={t}: query row {q} and the step-{i + 1} key at position "
                    f"{s} (column {col}): got {bool(got[q, col])}, expected {bool(want[q, col])}")

    return check("ttt_mask", attempt)


# --- builds: the student's rule, drafter and mask inside the engine --------------------------


def sampling_model(vocab_size: int = 256) -> Transformer:
    """The tiny preset with a vocabulary of ``vocab_size`` tokens, seeded random weights, in
    float64: the default target of :func:`check_rejection_in_engine` (its many sampled
    continuations are cheap with a small vocabulary)."""
    return random_model(get_preset("tiny").with_(vocab_size=vocab_size), seed=1).double()


def attentive_model() -> Transformer:
    """The tiny float64 demo model with its attention weights (q, k, v, o) multiplied by 4:
    peaked attention whose output outweighs the token's own embedding, so that a token
    attending to the wrong positions changes the greedy output (the default target of
    :func:`check_tree_mask_in_engine`)."""
    model = demo_model()
    with torch.no_grad():
        for layer in model.layers:
            for w in (layer.attn.wq, layer.attn.wk, layer.attn.wv, layer.attn.wo):
                w.weight.mul_(4.0)
    return model


def first_layer_drafter(model: Transformer, sharpness: float = 8.0) -> tuple:
    """(module, head, manifest) for ``build_speculator(..., drafter=...)``: a one-layer draft
    model that is ``model``'s first layer followed by its final norm and output matrix, the
    logits multiplied by ``sharpness`` (a confident drafter: its guesses overlap the target's
    without being distributed like them, so both acceptance and rejection happen often)."""
    c = model.cfg
    cfg = DrafterConfig("draft_model", d_model=c.d_model, layers=1, n_heads=c.n_heads,
                        n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, ffn_dim=c.ffn_dim,
                        draft_vocab=c.vocab_size)
    module = build_drafter(cfg, model)
    module.layers[0].load_state_dict(model.layers[0].state_dict())
    module.norm.load_state_dict(model.norm.state_dict())
    module = module.to(device=model.device, dtype=model.dtype).eval()
    ids = torch.arange(c.vocab_size, device=model.device)
    return module, DraftHead(model.lm_head.weight * sharpness, ids), {}


class StepVerify(DraftAndVerify):
    """The package's speculator with its sampled chains verified by exercise (b)'s one-step
    rule ``step(draft_token, q, p, u, generator)``, position by position as the chapter
    describes: u ~ U(0, 1) from the request's generator; the first rejection's token ends the
    round; after k acceptances the bonus token is drawn from the target's last row. p, q: the
    target's and the drafter's distributions [V] (float64, after the request's temperature and
    filters). Greedy drafts, and drafts without q, go to the package's rules. ``base``: the
    speculator whose proposer this one keeps."""

    def __init__(self, step: Callable, base: DraftAndVerify) -> None:
        super().__init__(base.config, base.max_seq_len, base.proposer)
        self.step = step

    def verify(self, seq: Sequence, draft: Draft, logits: torch.Tensor,
               params: SamplingParams, generator: torch.Generator | None
               ) -> tuple[list[int], int]:
        if params.greedy or draft.q is None:
            return super().verify(seq, draft, logits, params, generator)
        rows = len(draft.tokens) + 1
        batch = SamplingBatch.from_params([params] * rows, [generator] * rows, logits.device)
        p = filtered_probs(logits, batch).cpu().double()
        q = draft.q.cpu().double()
        kept, token = 0, None
        for d, q_i, p_i in zip(draft.tokens, q, p):
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            accepted, token = self.step(d, q_i.clone(), p_i.clone(), u, generator)
            if not accepted:
                break
            kept += 1
        if kept == len(draft.tokens):
            token = torch.multinomial(p[-1], 1, generator=generator)
        self.stats.add(len(draft.tokens), kept)
        return list(range(1, kept + 1)), int(token)


def check_rejection_in_engine(fn: Callable, model: Transformer | None = None,
                              prompt: list[int] | None = None, drafter: tuple | None = None,
                              samples: int = 600, k: int = 2, top_k: int = 2,
                              positions: int = 3) -> Result:
    """Exercise (b)'s ``rejection_step`` verifies the engine's sampled drafts
    (:class:`StepVerify`): a draft model proposes chains of ``k`` tokens, sampled from its own
    distribution q, for ``samples`` continuations of ``prompt`` (seeded requests of 25 parallel
    samples each) at temperature 1 with top-k ``top_k`` (so the distribution of the first
    tokens has few outcomes). Passes when the first ``positions`` tokens the engine emits,
    taken together and at each position, are within about 4 standard errors (total
    variation, :func:`tv_tolerance`) of their exact distribution under plain sampling
    (:func:`first_tokens_distribution`). The package's rule
    runs the same way for comparison; prints both distances and acceptance rates. Defaults:
    the small-vocabulary float64 model (:func:`sampling_model`), a random prompt,
    :func:`first_layer_drafter`."""
    model = model or sampling_model()
    if prompt is None:
        g = torch.Generator().manual_seed(7)
        prompt = torch.randint(5, model.cfg.vocab_size, (8,), generator=g).tolist()
    params = SamplingParams(temperature=1.0, top_k=top_k)
    options = {"method": "draft_model", "num_speculative_tokens": k}
    draft_lm = drafter or first_layer_drafter(model)

    def run(step: Callable | None) -> tuple[Counter, float, SpecStats]:
        engine = sampling_engine(model, len(prompt), k)
        base = build_speculator(options, engine, drafter=draft_lm)
        engine.use_speculator(StepVerify(step, base) if step else base)
        counts, seconds = sample_first_tokens(engine, prompt, params, samples, positions)
        return counts, seconds, engine.speculator.stats

    def attempt() -> None:
        p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
        fn(0, p.flip(0), p, 0.5, torch.Generator().manual_seed(0))   # a stub raises here
        exact = first_tokens_distribution(model, prompt, params, positions)
        tol = tv_tolerance(list(exact.values()), samples)
        ref, ref_s, ref_stats = run(None)
        mine, mine_s, stats = run(fn)
        assert stats.rounds > 0, "no sampled draft was verified: nothing was tested"
        tv, ref_tv = total_variation(mine, exact), total_variation(ref, exact)
        tests = [(f"the first {positions} tokens, together,", tv, tol, ref_tv)]
        for j in range(positions):
            want = marginal(exact, j)
            tests.append((f"the tokens at position {j + 1}",
                          total_variation(Counter(marginal(mine, j)), want),
                          tv_tolerance(list(want.values()), samples),
                          total_variation(Counter(marginal(ref, j)), want)))
        for what, got, allowed, theirs in tests:
            assert got <= allowed, (
                f"over {samples} samples, {what} under your rule are distributed {got:.3f} "
                f"from the target's own distribution in total variation (sampling noise allows "
                f"{allowed:.3f}; the package's rule, run the same way: {theirs:.3f}): the output "
                f"is not distributed as the target's")

        def acc(s: SpecStats) -> str:
            return ", ".join(f"{a:.2f}" for a in s.acceptance_by_position)

        print(f"{samples} samples, {len(exact)} possible first {positions} tokens: your rule "
              f"{tv:.3f} from the exact distribution (acceptance by position {acc(stats)}; "
              f"{mine_s:.1f} s), the package's {ref_tv:.3f} ({acc(ref_stats)}; {ref_s:.1f} s); "
              f"sampling noise allows {tol:.3f}")

    return check("rejection_in_engine", attempt)


class FunctionLookup:
    """Exercise (c)'s ``prompt_lookup`` as the engine's drafter (a proposer of
    :mod:`minillm.spec_decode.proposers`): each sequence's draft is
    ``fn(its tokens, k, max_n)``, k cut to the room the sequence has left, as a chain; no draft
    when it returns []."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, fn: Callable, k: int, max_n: int) -> None:
        self.fn, self.k, self.max_n, self.max_nodes = fn, k, max_n, k

    def propose(self, inputs: list[SpecInput], hidden: dict) -> list[Draft | None]:
        out = []
        for inp in inputs:
            k = min(self.k, inp.max_depth)
            tokens = [int(t) for t in self.fn(list(inp.seq.token_ids), k, self.max_n)] if k else []
            if len(tokens) > k:
                raise ValueError(f"prompt_lookup returned {len(tokens)} tokens, more than "
                                 f"k = {k}")
            out.append(Draft.chain(tokens) if tokens else None)
        return out

    def fork(self, parent_id: int, child_id: int) -> None: ...

    def release(self, seq_id: int) -> None: ...


def serve_in_order(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Each prompt through ``engine`` once the previous one has finished (batch 1, where
    speculation pays), greedy, ``max_tokens`` each: tokens per request, steps, seconds."""
    tokens, steps, t0 = [], 0, time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        run = finish_all(engine, [engine.add_request(p, params)])
        tokens += run["tokens"]
        steps += run["steps"]
    return {"tokens": tokens, "steps": steps, "seconds": time.perf_counter() - t0}


def repeating_prompts(n: int = 3, length: int = 24, seed: int = 2) -> list[list[int]]:
    """``n`` prompts that repeat a random phrase of 6 tokens (material for prompt lookup)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(5, 2000, (6,), generator=g).tolist() * length)[:length]
            for _ in range(n)]


def _spec_engine(model: Transformer, proposer, config: SpeculativeConfig,
                 max_seqs: int = 4) -> LLMEngine:
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=max_seqs, num_kv_blocks=256))
    engine.use_speculator(DraftAndVerify(config, model.cfg.max_seq_len, proposer))
    return engine


def _rate(run: dict, plain: dict) -> str:
    speedup = plain["seconds"] / run["seconds"]
    return f"{run['steps']} steps, {run['seconds']:.2f} s ({speedup:.2f}x plain's speed)"


def check_prompt_lookup_in_engine(fn: Callable, model: Transformer | None = None,
                                  prompts: list[list[int]] | None = None,
                                  max_tokens: int = 24, k: int = 4, max_n: int = 3) -> Result:
    """Exercise (c)'s ``prompt_lookup`` drafts in the engine (:class:`FunctionLookup`), greedy,
    one prompt after another. Passes when every request gets the plain engine's tokens and
    the drafter proposes and gets accepted exactly what the package's
    :class:`~minillm.spec_decode.proposers.NgramProposer` does (the same verification rounds,
    drafts and acceptances by position); prints tokens per verification and the speedup over
    plain decoding both ways. Defaults: the tiny float64 model, prompts that repeat a
    phrase."""
    model = model or demo_model()
    prompts = prompts if prompts is not None else repeating_prompts()
    config = SpeculativeConfig("ngram", k, prompt_lookup_max=max_n)

    def attempt() -> None:
        fn([1, 2, 1], 2, 2)                          # a stub raises NotImplementedError here
        plain = serve_in_order(LLMEngine(model, None, EngineConfig(num_kv_blocks=256)),
                               prompts, max_tokens)
        ref_engine = _spec_engine(model, NgramProposer(k, max_n), config)
        ref = serve_in_order(ref_engine, prompts, max_tokens)
        engine = _spec_engine(model, FunctionLookup(fn, k, max_n), config)
        mine = serve_in_order(engine, prompts, max_tokens)
        assert_same_tokens(mine, plain)
        got, want = engine.speculator.stats, ref_engine.speculator.stats
        assert want.rounds > 0, "the package's drafter found nothing to propose: no test"
        assert (got.rounds, got.proposed, got.accepted) == (want.rounds, want.proposed,
                                                             want.accepted), (
            f"the plain engine's tokens (a drafter never changes them), but your drafter "
            f"made {got.rounds} drafts (by depth {got.proposed}, accepted {got.accepted}) where "
            f"the package's NgramProposer made {want.rounds} (by depth {want.proposed}, "
            f"accepted {want.accepted})")
        print(f"your prompt_lookup: {got.mean_accepted:.2f} tokens per verification over "
              f"{got.rounds} rounds, {_rate(mine, plain)}; the package's: "
              f"{want.mean_accepted:.2f}, {_rate(ref, plain)}; plain decoding: {plain['steps']} "
              f"steps, {plain['seconds']:.2f} s")

    return check("prompt_lookup_in_engine", attempt)


@dataclass
class MaskedDraft(Draft):
    """A draft whose tree-attention mask comes from ``mask_fn(parents)`` (exercise (d)'s
    ``tree_mask``) instead of :meth:`Draft.tree_inputs`; the positions are the package's (the
    root's plus each node's depth). The runner asks every tree draft for its mask."""

    mask_fn: Callable | None = None

    def tree_inputs(self, root: int) -> tuple[list[list[bool]], list[int]]:
        mask = torch.as_tensor(self.mask_fn(list(self.parents))).bool()
        n = len(self.tokens) + 1
        if tuple(mask.shape) != (n, n):
            raise ValueError(f"tree_mask({self.parents}) has shape {tuple(mask.shape)}, "
                             f"expected ({n}, {n})")
        return mask.tolist(), [root + d for d in self.depths()]

    def pruned(self, max_depth: int) -> Draft | None:
        cut = super().pruned(max_depth)
        if cut is None or cut is self:
            return cut
        return MaskedDraft(cut.tokens, cut.parents, cut.q, self.mask_fn)


class OracleTree:
    """A tree drafter that knows each prompt's greedy continuation (``continuations``, keyed
    by the prompt's tokens) and hides it off the first branch: at each depth, up to
    ``depth``, a decoy first, then the right token, under the right token of the depth above.
    The decoy is the token after the right one, with the token after that as its child (a
    drafter that skipped a token), so a node that sees its siblings reads the answer's future.
    Verification accepts the whole right path only if each node's logits come from its own
    ancestors. ``mask_fn``: the drafts' tree mask (None: the package's)."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, continuations: dict[tuple, list[int]], depth: int, vocab_size: int,
                 mask_fn: Callable | None = None) -> None:
        self.continuations, self.depth, self.vocab = continuations, depth, vocab_size
        self.mask_fn, self.max_nodes = mask_fn, 3 * depth

    def propose(self, inputs: list[SpecInput], hidden: dict) -> list[Draft | None]:
        out: list[Draft | None] = []
        for inp in inputs:
            s = inp.seq
            done = s.num_tokens - s.prompt_len
            want = self.continuations[tuple(s.token_ids[:s.prompt_len])][done:]
            want = want + [(want[-1] + 1 + j) % self.vocab for j in range(3)] if want else []
            tokens: list[int] = []
            parents: list[int] = []
            node = 0
            for d in range(min(self.depth, inp.max_depth, len(want) - 3)):
                decoy = want[d + 1] if want[d + 1] != want[d] else (want[d] + 1) % self.vocab
                tokens += [decoy, want[d + 2], want[d]]
                parents += [node, len(tokens) - 2, node]
                node = len(tokens)
            if not tokens:
                out.append(None)
            elif self.mask_fn is None:
                out.append(Draft(tokens, parents))
            else:
                out.append(MaskedDraft(tokens, parents, None, self.mask_fn))
        return out

    def fork(self, parent_id: int, child_id: int) -> None: ...

    def release(self, seq_id: int) -> None: ...


def check_tree_mask_in_engine(fn: Callable, model: Transformer | None = None,
                              prompts: list[list[int]] | None = None, max_tokens: int = 24,
                              depth: int = 3) -> Result:
    """Exercise (d)'s ``tree_mask`` is the attention mask of the engine's tree verification
    (:class:`MaskedDraft`), greedy, one prompt after another. The drafter
    (:class:`OracleTree`) knows the plain engine's tokens and hides them off the first branch
    of every tree, behind decoys, so the whole right path is accepted only if each node
    attended to its ancestors alone. Passes when every request gets the plain engine's
    tokens; prints tokens per verification with your mask and the package's. Defaults:
    :func:`attentive_model`, random prompts."""
    model = model or attentive_model()
    if prompts is None:
        g = torch.Generator().manual_seed(4)
        prompts = [torch.randint(5, 2000, (n,), generator=g).tolist() for n in (9, 17, 30)]
    config = SpeculativeConfig("eagle", depth, tree_nodes=3 * depth)

    def attempt() -> None:
        fn([0, 0])                                   # a stub raises NotImplementedError here
        plain = serve_in_order(LLMEngine(model, None, EngineConfig(num_kv_blocks=256)),
                               prompts, max_tokens)
        known = {tuple(p): t for p, t in zip(prompts, plain["tokens"])}
        vocab = model.cfg.vocab_size
        ref_engine = _spec_engine(model, OracleTree(known, depth, vocab), config)
        ref = serve_in_order(ref_engine, prompts, max_tokens)
        engine = _spec_engine(model, OracleTree(known, depth, vocab, fn), config)
        mine = serve_in_order(engine, prompts, max_tokens)
        assert_same_tokens(ref, plain)
        assert_same_tokens(mine, plain)
        got, want = engine.speculator.stats, ref_engine.speculator.stats
        print(f"with your tree_mask: {got.mean_accepted:.2f} tokens per verification "
              f"({got.nodes / max(1, got.rounds):.1f} tree nodes verified per round), "
              f"{_rate(mine, plain)}; with the package's: {want.mean_accepted:.2f}, "
              f"{_rate(ref, plain)}")

    return check("tree_mask_in_engine", attempt)


__all__ = ["FunctionLookup", "MaskedDraft", "OracleTree", "StepVerify", "attentive_model",
           "check_greedy_accept", "check_prompt_lookup", "check_prompt_lookup_in_engine",
           "check_rejection_in_engine", "check_rejection_step", "check_tree_mask",
           "check_tree_mask_in_engine", "emitted_distribution", "first_layer_drafter",
           "first_tokens_distribution", "marginal", "repeating_prompts", "sample_first_tokens",
           "sampling_engine", "sampling_model", "serve_in_order", "total_variation", "tv_tolerance"]
