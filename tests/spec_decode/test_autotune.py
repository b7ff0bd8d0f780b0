"""num_speculative_tokens="auto": the predicted speedup is Leviathan's formula when its
assumptions hold, the chosen k is the best predicted one, and calibrating leaves the engine as
it was and serves the target's tokens."""
from __future__ import annotations

import pytest
import torch
from engine_checks import assert_all_free, prompts_of, run_all, sharp_model
from test_spec_engine import random_drafter, repetitive

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.spec_decode import build_speculator
from minillm.spec_decode.autotune import (
    Calibration,
    acceptance_rate,
    cut_tree,
    leviathan_speedup,
)


@pytest.mark.parametrize("a, c", [(0.8, 0.05), (0.6, 0.2), (0.3, 0.5)])
def test_prediction_is_leviathans_formula_under_its_assumptions(a, c):
    """Acceptance a at every depth, a drafter of c target steps per drafted token, and a
    verification that costs one step: Leviathan et al.'s (1 - a^(k+1)) / ((1 - a)(1 + k c))."""
    K, t1 = 8, 0.02
    cal = Calibration("draft_model", K, plain_s=t1, step_s=t1 + K * c * t1, draft_s=K * c * t1,
                      reached=[a ** (i + 1) for i in range(K)], nodes=[1.0] * K, per_depth=True)
    for k in range(1, K + 1):
        assert cal.speedup(k) == pytest.approx((1 - a ** (k + 1)) / ((1 - a) * (1 + k * c)))
    best = max(range(1, K + 1), key=lambda k: (1 - a ** (k + 1)) / ((1 - a) * (1 + k * c)))
    assert cal.best_k == best
    assert acceptance_rate(cal.tokens(K), K) == pytest.approx(a, abs=1e-6)
    assert leviathan_speedup(a, 4, c) == pytest.approx(cal.speedup(4))
    assert leviathan_speedup(1.0, 4, c) == pytest.approx(5 / (1 + 4 * c))   # every token kept


def test_a_costly_verification_shortens_k():
    """Same acceptance, but verifying costs 1.5 steps more at K: a smaller k pays more."""
    reached = [0.7 ** (i + 1) for i in range(8)]
    cheap = Calibration("ngram", 8, 0.02, 0.02, 0.0, reached, [1.0] * 8, per_depth=False)
    dear = Calibration("ngram", 8, 0.02, 0.05, 0.0, reached, [1.0] * 8, per_depth=False)
    assert dear.best_k < cheap.best_k == 8


def test_under_load_drafting_stops_where_verification_stops_being_free():
    """Steps cost the same up to 16 rows, then grow with every row (compute-bound): at batch
    1 a deep draft pays; at 16 and 64 sequences no draft does."""
    reached = [0.7 ** (i + 1) for i in range(8)]
    cal = Calibration("ngram", 8, 0.02, 0.02, 0.0, reached, [1.0] * 8, per_depth=False,
                      batch_s={4: 0.02, 16: 0.02, 64: 0.08})
    assert cal.rows_seconds(32) == pytest.approx(0.02 + 0.06 * 16 / 48)
    assert cal.rows_seconds(128) == pytest.approx(0.08 + 0.06 * 64 / 48)      # the slope on
    assert cal.k_for_batch(1) == cal.best_k == 8
    assert 0 < cal.k_for_batch(4) < 8
    assert cal.k_for_batch(16) == cal.k_for_batch(64) == 0
    assert cal.speedup(3, 64) < 1 and cal.speedup(8, 1) == pytest.approx(cal.tokens(8))


@pytest.fixture(scope="module")
def model():
    return sharp_model(torch.float32, max_seq_len=512)


def assert_serves_plain_tokens(model, engine, spec, prompts, max_tokens):
    """``engine`` with ``spec`` gives the plain engine's greedy tokens and frees every block."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain = run_all(LLMEngine(model, None, EngineConfig(num_kv_blocks=256, block_size=4,
                                                        max_num_seqs=4)), prompts, greedy)
    engine.use_speculator(spec)
    got = run_all(engine, prompts, greedy)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert_all_free(engine)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_auto_keeps_the_best_measured_k_and_serves_the_targets_tokens(model, method):
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=256, block_size=4, max_num_seqs=4))
    prompts = repetitive(4, seed=3)
    drafter = random_drafter(method, model) if method != "ngram" else None
    spec = build_speculator({"method": method, "num_speculative_tokens": "auto"}, engine,
                            drafter=drafter, calibration_prompts=prompts)
    cal = spec.calibration
    assert spec.config.num_speculative_tokens == cal.best_k
    assert cal.speedup(cal.best_k) == max(cal.speedup(k) for k in range(1, cal.max_k + 1))
    assert cal.plain_s > 0 and cal.step_s > cal.draft_s > 0
    if method == "ngram":                    # repeated phrases: prompt lookup is accepted
        assert sum(cal.reached) > 0.5
        assert spec.drafting == cal.pays
    else:                                    # a random drafter is not: no k pays, no drafts
        assert sum(cal.reached) < 0.1        # (which k is "best" among losers is timing noise)
        assert not cal.pays and not spec.drafting
    assert not engine.requests and not engine.trace and engine.speculator is None
    assert set(cal.batch_s) == {4}                 # max_num_seqs=4: the larger ones do not fit
    assert_all_free(engine)
    assert_serves_plain_tokens(model, engine, spec, prompts_of([9, 14], seed=5), 16)
    if not spec.drafting:                    # (drafting at batch 2 depends on the timings)
        assert engine.speculator.stats.rounds == 0


def test_auto_without_a_tokenizer_or_prompts_names_the_option(model):
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4))
    with pytest.raises(ValueError, match="num_speculative_tokens='auto' .* needs a tokenizer"):
        build_speculator({"method": "ngram", "num_speculative_tokens": "auto"}, engine)


def test_no_drafts_at_a_batch_where_none_pays(model):
    """A calibration that says drafting pays alone but not with 4 sequences: four requests at
    once are decoded plainly until only one is left."""
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=256, block_size=4, max_num_seqs=4))
    spec = build_speculator({"method": "ngram", "num_speculative_tokens": 4}, engine)
    reached = [0.9 ** (i + 1) for i in range(4)]
    spec.calibration = Calibration("ngram", 4, 0.02, 0.02, 0.0, reached, [1.0] * 4, False,
                                   batch_s={2: 0.08, 4: 0.16})
    assert spec.calibration.k_for_batch(1) == 4 and spec.calibration.k_for_batch(4) == 0
    engine.use_speculator(spec)
    prompts = repetitive(4, seed=3)
    lengths = [6, 6, 6, 20]              # the last one goes on alone after the others finish
    depths = []
    engine.step_hooks.append(lambda e, r: depths.append((r.decode_tokens, r.drafted_tokens)))
    for p, n in zip(prompts, lengths):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert all(drafted == 0 for seqs, drafted in depths if seqs > 1), depths
    assert any(drafted > 0 for seqs, drafted in depths if seqs == 1)
    assert_all_free(engine)


def test_a_drafter_that_cannot_catch_up_drops_the_sequences_it_did_not_follow(model):
    """EAGLE reads each step's hidden states: after a step without drafting it lets the
    sequences of that step go (no drafter work, no drafter blocks), and drafts for new ones."""
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=256, block_size=4, max_num_seqs=4))
    spec = build_speculator({"method": "eagle", "num_speculative_tokens": 2}, engine,
                            drafter=random_drafter("eagle", model))
    reached = [0.9, 0.8]
    spec.calibration = Calibration("eagle", 2, 0.02, 0.02, 0.0, reached, [1.0, 1.0], True,
                                   batch_s={2: 0.08, 4: 0.16})
    engine.use_speculator(spec)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 12)]
    first = prompts_of([7, 9], seed=2)
    for p, g in zip(first, greedy):
        engine.add_request(p, g)
    stale = set()
    while engine.has_unfinished():
        engine.step()
        stale |= spec._stale
    assert len(stale) == 2 and spec.stats.rounds == 0   # the long one went on alone, plainly
    assert not spec._stale and not spec.proposer.cache.blocks.tables   # all released
    engine.add_request(prompts_of([8], seed=4)[0], greedy[1])
    while engine.has_unfinished():
        engine.step()
    assert spec.stats.rounds > 0                         # a new sequence alone drafts
    assert_all_free(engine)


def test_a_speculator_that_does_not_draft_asks_for_no_hidden_states(model):
    """A feature drafter reads the target's last hidden state; once the calibration switches
    drafting off, the runner must not be asked for it (a step that returns hidden states
    leaves the fused CPU forward and the CUDA graphs), and the engine still serves the
    target's tokens."""
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=256, block_size=4, max_num_seqs=4))
    spec = build_speculator({"method": "eagle", "num_speculative_tokens": 2}, engine,
                            drafter=random_drafter("eagle", model))
    assert spec.hidden_layers == (-1,)
    spec.drafting = False
    assert spec.hidden_layers == ()
    assert_serves_plain_tokens(model, engine, spec, prompts_of([7, 11], seed=2), 8)
    assert spec.stats.rounds == 0


def test_a_cut_tree_keeps_the_accepted_path_within_its_best_nodes():
    """Two logged drafts (node depths best first, accepted path): cut to the best b nodes of
    depth <= k, the path goes on while its nodes are among them."""
    log = [([1, 1, 2, 2, 3], [1, 3, 5]), ([1, 2, 1, 3], [2])]
    assert cut_tree(log, 3, 5, 2) == ((4 + 2) / 2, (5 + 4) / 2)
    assert cut_tree(log, 3, 2, 2) == ((2 + 2) / 2, (2 + 2) / 2)   # node 3 is 3rd, node 2 2nd
    assert cut_tree(log, 1, 5, 2) == ((2 + 1) / 2, (2 + 2) / 2)   # node 2 of the 2nd: depth 2
    assert cut_tree(log, 2, 3, 2) == ((3 + 2) / 2, (3 + 3) / 2)


def test_a_small_tree_wins_where_verifying_rows_is_dear():
    """Most of the accepted tokens sit in the best 2 nodes; a step of up to 4 rows costs one
    decode step, more rows cost more: the chosen tree is the largest of 4 rows (3 nodes), and
    with verification free it is the largest."""
    trees = {1: {b: (1.5, min(b, 4)) for b in range(1, 9)},
             2: {b: (1.5 + 0.3 * (b >= 2) + 0.02 * b, b) for b in range(1, 9)}}
    dear = Calibration("eagle", 2, 0.02, 0.04, 0.0, [0.5, 0.3], [4.0, 4.0], True,
                       batch_s={4: 0.02, 16: 0.08}, trees=trees)
    assert dear.best() == (2, 3)
    free = Calibration("eagle", 2, 0.02, 0.02, 0.0, [0.5, 0.3], [4.0, 4.0], True,
                       batch_s={16: 0.02}, trees=trees)
    assert free.best() == (2, 8)


def test_auto_sizes_an_eagle_tree_from_its_log(model):
    """EAGLE with "auto": the calibration predicts every (k, size); at the full size its
    prediction is what it measured per depth, and the speculator is built at the pair it
    chose."""
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=256, block_size=4, max_num_seqs=4))
    spec = build_speculator({"method": "eagle", "num_speculative_tokens": "auto",
                             "tree_nodes": 6}, engine, drafter=random_drafter("eagle", model),
                            calibration_prompts=repetitive(3, seed=3))
    cal = spec.calibration
    assert sorted(cal.trees) == list(range(1, cal.max_k + 1))
    assert max(cal.trees[1]) <= 6
    full = max(cal.trees[cal.max_k])
    assert cal.tokens(cal.max_k, full) == pytest.approx(cal.tokens(cal.max_k))
    assert cal.draft_nodes(cal.max_k, full) == pytest.approx(cal.draft_nodes(cal.max_k))
    k, b = cal.best()
    assert spec.config.num_speculative_tokens == k and spec.config.tree_nodes == b
    assert spec.proposer.budget == b
    assert_all_free(engine)
