"""Block drafting (chapter 06b): DFlash, DDTree and DSpark.

The serving pass (paged cache, context rows added round by round) must equal the dense
training pass; every method must give the target's greedy tokens exactly with a random drafter
and free the drafter's cache; the best-first tree and the budget fill must equal brute force
on small cases; bad options are errors naming them.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from engine_checks import prompts_of, run_all, sharp_model
from test_spec_engine import GREEDY, assert_drafter_free, engine_for, tokens

from minillm import SamplingParams
from minillm.spec_decode.blocks import early_exit, fill_budget
from minillm.spec_decode.drafters import DrafterConfig, DraftHead, build_drafter
from minillm.spec_decode.proposers import PagedDrafter
from minillm.spec_decode.speculator import build_speculator
from minillm.spec_decode.training.batches import Batch
from minillm.spec_decode.training.block_train import block_inputs, markov_decode
from minillm.spec_decode.trees import best_first_tree


@pytest.fixture(scope="module")
def model():
    return sharp_model(torch.float32)


def block_drafter(model, seed: int = 0, block: int = 4, rank: int = 8):
    c = model.cfg
    cfg = DrafterConfig("dflash", d_model=c.d_model, layers=2, n_heads=c.n_heads,
                        n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, ffn_dim=c.ffn_dim,
                        draft_vocab=512, target_layers=(0, 1), block_size=block,
                        markov_rank=rank)
    torch.manual_seed(seed)
    module = build_drafter(cfg, model)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return module.eval(), DraftHead(model.lm_head.weight, torch.arange(512)), {}


def test_serving_pass_equals_the_dense_training_pass(model):
    """Two rounds through the paged cache (context 0..5 with a block at 6, then context 6..9
    with a block at 10, overwriting the first block's rows) against one dense pass."""
    drafter, _, _ = block_drafter(model)
    d, t = model.cfg.d_model, 11
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(t, 2 * d, generator=g)
    toks = torch.randint(0, 500, (t,), generator=g)
    cache = PagedDrafter(drafter.block_cfg, 16, 4, torch.device("cpu"), torch.float32)
    s = drafter.cfg.block_size

    def rows(lo, hi):
        ctx = drafter.context(feats[lo:hi])
        block = torch.cat([model.embed(toks[hi:hi + 1]), drafter.mask_embedding.expand(s - 1, -1)])
        x = torch.cat([torch.cat([ctx, ctx.new_ones(len(ctx), 1)], -1),
                       torch.cat([block, block.new_zeros(s, 1)], -1)])
        n = hi - lo
        mask = torch.ones(n + s, n + s, dtype=torch.bool).tril()
        mask[n:] = True
        return x, mask

    fwd = lambda x, c, p: drafter(x[..., :-1], x[0, :, -1] > 0.5, p, c)  # noqa: E731
    with torch.no_grad():
        for lo, hi in ((0, 6), (6, 10)):
            x, m = rows(lo, hi)
            served = cache.run(fwd, [(0, lo)], [x], [m])[0][-s:]
        batch = Batch(toks[None], feats[None], torch.arange(t)[None], torch.tensor([t]),
                      torch.tensor([0]))
        anchors, keep = torch.tensor([[10]]), torch.tensor([[True]])
        x, is_ctx, pos, mask = block_inputs(drafter, model.embed, batch, anchors, keep)
        dense = drafter(x, is_ctx, pos, mask=mask)[0, t:]
    torch.testing.assert_close(served, dense, atol=1e-5, rtol=1e-4)


def block_engine(model, method, k=3, **spec):
    engine = engine_for(model, None)
    options = {"method": method, "num_speculative_tokens": k, "tree_nodes": 8, **spec}
    engine.use_speculator(build_speculator(options, engine, drafter=block_drafter(model)))
    return engine


@pytest.fixture(scope="module")
def reference(model):
    prompts = prompts_of([5, 17, 9, 30, 3], seed=1)
    return prompts, tokens(run_all(engine_for(model, None), prompts, GREEDY))


@pytest.mark.parametrize("method", ["dflash", "ddtree", "dspark"])
def test_greedy_equals_the_target(model, reference, method):
    prompts, expect = reference
    extra = {"confidence_threshold": 0.01} if method == "dspark" else {}
    engine = block_engine(model, method, **extra)
    assert tokens(run_all(engine, prompts, GREEDY)) == expect
    assert_drafter_free(engine)
    assert engine.speculator.stats.rounds > 0


def test_sampled_block_drafts_finish_and_free_everything(model):
    params = SamplingParams(temperature=0.9, top_k=20, max_tokens=12, ignore_eos=True, seed=3)
    for method in ("dflash", "ddtree", "dspark"):
        engine = block_engine(model, method)
        outs = run_all(engine, prompts_of([6, 11], seed=2), params)
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
        assert_drafter_free(engine)


def test_dspark_budget_is_shared_across_the_batch(model):
    """With a budget of one token per sequence (8 for max_num_seqs 8), no step verifies more
    than 8 draft tokens, and the budget is used (some step verifies at least 5)."""
    engine = block_engine(model, "dspark", k=3, verify_budget=8, confidence_threshold=1e-6)
    run_all(engine, prompts_of([5, 7, 9, 4, 6, 8, 3, 10], seed=5), GREEDY)
    assert max(r.drafted_tokens for r in engine.trace) <= 8
    assert max(r.drafted_tokens for r in engine.trace) >= 5     # the budget was used


def brute_tree(logps, budget):
    """All prefix-closed sets are too many; the top-``budget`` prefixes by score are the
    answer (scores fall along a path, so they are prefix-closed)."""
    paths = [p for n in range(1, len(logps) + 1)
             for p in itertools.product(*[range(len(r)) for r in logps[:n]])]
    score = {p: sum(logps[d][r] for d, r in enumerate(p)) for p in paths}
    return sorted(score.values(), reverse=True)[:budget]


@pytest.mark.parametrize("seed", range(5))
def test_best_first_tree_keeps_the_most_likely_prefixes(seed):
    g = torch.Generator().manual_seed(seed)
    logps = [sorted(torch.rand(3, generator=g).log().tolist(), reverse=True) for _ in range(4)]
    parents, picks = best_first_tree(logps, 10)
    scores = []
    for i, (d, r) in enumerate(picks):
        p = parents[i]
        assert (p == 0) == (d == 0) and (p == 0 or picks[p - 1][0] == d - 1)
        scores.append(logps[d][r] + (scores[p - 1] if p else 0.0))
    assert sorted(scores, reverse=True) == pytest.approx(brute_tree(logps, 10))


def brute_fill(conf, budget):
    best = -1.0
    for lens in itertools.product(*[range(len(c) + 1) for c in conf]):
        if sum(lens) <= budget:
            best = max(best, sum(math.prod(c[:j + 1]) for c, n in zip(conf, lens)
                                 for j in range(n)))
    return best


@pytest.mark.parametrize("seed", range(5))
def test_fill_budget_maximises_expected_accepted_tokens(seed):
    g = torch.Generator().manual_seed(seed)
    conf = [torch.rand(3, generator=g).tolist() for _ in range(3)]
    keep = fill_budget(conf, 4)
    assert sum(keep) == 4
    got = sum(math.prod(c[:j + 1]) for c, n in zip(conf, keep) for j in range(n))
    assert got == pytest.approx(brute_fill(conf, 4))


def test_early_exit_stops_at_the_first_low_confidence():
    assert early_exit([0.9, 0.5, 0.05, 0.9], 0.1) == 2
    assert early_exit([0.05, 0.9], 0.1) == 0
    assert early_exit([0.9, 0.9], 0.1) == 2


def test_markov_decode_feeds_the_drafted_token_forward(model):
    drafter, head, _ = block_drafter(model)
    h = torch.randn(2, 4, model.cfg.d_model)
    base = head(h).float()
    drafted, conf = markov_decode(drafter, h, base, torch.tensor([3, 7]), 512)
    step2 = (base[:, 2] + drafter.markov(h[:, 2], drafted[:, 1]).float()).argmax(-1)
    assert torch.equal(drafted[:, 2], step2)
    assert ((conf[:, 1:] > 0) & (conf[:, 1:] < 1)).all()


@pytest.mark.parametrize("options, name", [
    ({"verify_budget": 4}, "verify_budget"),
    ({"verify_budget": 0}, "verify_budget"),
    ({"confidence_threshold": 1.0}, "confidence_threshold"),
    ({"confidence_threshold": 0.0}, "confidence_threshold"),
    ({"num_speculative_tokens": 8}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 4}, "num_speculative_tokens"),      # the test drafter's block: 4
    ({"method": "dflash", "verify_budget": 16}, "verify_budget"),
    ({"method": "ddtree", "confidence_threshold": 0.2}, "confidence_threshold"),
])
def test_bad_options_name_themselves(model, options, name):
    engine = engine_for(model, None)
    with pytest.raises(ValueError, match=name):
        build_speculator({"method": "dspark", **options}, engine, drafter=block_drafter(model))
