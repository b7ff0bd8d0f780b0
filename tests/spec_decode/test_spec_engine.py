"""Speculative decoding in the engine: every method is lossless against the plain engine.

At temperature 0 each method (with random drafters on the sharp tiny model, and an oracle tree
whose right answers sit off the first branch, so kept nodes must be moved) must give the
target's greedy tokens exactly, through paged KV, preemption (recompute and swap), n > 1 and
aborts, leaking no block in the target's cache or the drafter's. At temperature > 0 the first
two tokens' joint distribution must match the exact one, and a biased rule must not.
"""
from __future__ import annotations

import pytest
import torch
from engine_checks import assert_all_free, prompts_of, run_all, sharp_model
from test_spec_verify import tv, wrong_accept

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine, cpu_forward
from minillm.engine.sampler import SamplingBatch, filtered_probs
from minillm.engine.sequence import Draft
from minillm.spec_decode import speculator as spec_mod
from minillm.spec_decode.config import MODEL_FREE, SpeculativeConfig
from minillm.spec_decode.drafters import DrafterConfig, DraftHead, build_drafter, eagle3_layers
from minillm.spec_decode.speculator import DraftAndVerify, build_speculator

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return sharp_model(torch.float32)


def random_drafter(method: str, model, seed: int = 0):
    """(module, head, manifest) for a drafter with random weights (no training needed to be
    lossless)."""
    c = model.cfg
    cfg = DrafterConfig(method, d_model=c.d_model, layers=1, n_heads=c.n_heads,
                        n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, ffn_dim=c.ffn_dim,
                        num_heads=4 if method == "medusa" else 0, draft_vocab=512,
                        target_layers=eagle3_layers(c.n_layers) if method == "eagle3" else ())
    torch.manual_seed(seed)
    module = build_drafter(cfg, model)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 2 and p is not model.embed.weight:
                p.normal_(0, 0.2)
    module = module.to(model.dtype).eval()
    head = DraftHead(model.lm_head.weight, torch.arange(512))
    acc = [[0.5, 0.2, 0.1], [0.3, 0.1, 0.05], [0.2, 0.05], [0.1]]
    return module, head, {"head_accuracy": acc}


def engine_for(model, method, k=3, drafter_seed=0, **options):
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=options.pop("num_kv_blocks", 256),
                                                 block_size=4,
                                                 max_num_seqs=options.pop("max_num_seqs", 8),
                                                 **options))
    if method is None:
        return engine
    drafter = None if method in MODEL_FREE else random_drafter(method, model, drafter_seed)
    engine.use_speculator(build_speculator({"method": method, "num_speculative_tokens": k,
                                            "tree_nodes": 8}, engine, drafter=drafter))
    return engine


def repetitive(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so that prompt lookup finds matches."""
    base = prompts_of([6] * n, seed)
    return [(p * 4)[:20] for p in base]


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference(model):
    prompts = prompts_of([5, 17, 9, 30, 3], seed=1) + repetitive(3, 2)
    return prompts, tokens(run_all(engine_for(model, None), prompts, GREEDY))


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp",
                                    "medusa"])
def test_greedy_equals_the_target(model, reference, method):
    prompts, expect = reference
    engine = engine_for(model, method)
    assert tokens(run_all(engine, prompts, GREEDY)) == expect
    assert_drafter_free(engine)
    assert engine.speculator.stats.rounds > 0


def test_logprobs_and_stop_match_the_plain_engine(model, reference):
    prompts, _ = reference
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True)
    want = run_all(engine_for(model, None), prompts, params)
    got = run_all(engine_for(model, "ngram"), prompts, params)
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert da.keys() == db.keys()
            assert all(abs(da[t] - db[t]) < 1e-4 for t in da)


def test_stop_strings_end_inside_an_accepted_draft(model, reference):
    """A stop string met in the middle of a round's accepted tokens ends the text there, as
    without speculation (SmolLM2's tokenizer over the tiny model's tokens)."""
    from minillm.checkpoint.loader import smollm2_tokenizer

    tok = smollm2_tokenizer()
    prompts, expect = reference
    full = tok.decode(expect[-1][0])
    stop = full[len(full) // 2:len(full) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True)
    outs = []
    for method in (None, "ngram"):
        engine = engine_for(model, method)
        engine.tokenizer = tok
        outs.append(run_all(engine, prompts[-1:], params)[0].outputs[0])
    assert outs[0].text == outs[1].text == full[:full.index(stop)]
    assert outs[1].finish_reason == "stop"


def assert_drafter_free(engine):
    cache = getattr(engine.speculator.proposer, "cache", None)
    if cache is not None:
        assert not cache.blocks.tables and cache.blocks.num_free == cache.blocks.num_blocks


class OracleProposer:
    """Knows the greedy continuation; proposes a binary tree per level, [wrong, right], and
    errs on purpose at depth ``miss`` (so acceptance stops there)."""

    hidden_layers = ()
    max_nodes = 8

    def __init__(self, full: dict[tuple, list[int]], depth: int = 4, miss: int = 3) -> None:
        self.full, self.depth, self.miss = full, depth, miss

    def propose(self, inputs, hidden):
        out = []
        for inp in inputs:
            seq = inp.seq
            ref = self.full[tuple(seq.token_ids[:seq.prompt_len])]
            cont = ref[seq.num_tokens:seq.num_tokens + min(self.depth, inp.max_depth)]
            toks, parents, parent = [], [], 0
            for d, right in enumerate(cont):
                wrong = (right + 1) % 500
                right = wrong + 1 if d == self.miss else right
                toks += [wrong, right]
                parents += [parent, parent]
                parent = len(toks)
            out.append(Draft(toks, parents) if toks else None)
        return out

    def fork(self, parent_id, child_id): ...

    def release(self, seq_id): ...


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_tree_paths_off_the_first_branch_and_preemption(model, reference, preemption):
    prompts, expect = reference
    full = {tuple(p): p + e[0] for p, e in zip(prompts, expect)}
    engine = engine_for(model, None, num_kv_blocks=24, preemption=preemption)
    engine.use_speculator(DraftAndVerify(SpeculativeConfig("ngram"), model.cfg.max_seq_len,
                                       OracleProposer(full)))
    outs = run_all(engine, prompts, GREEDY)
    assert tokens(outs) == expect
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    acc = engine.speculator.stats.acceptance_by_position
    assert acc[0] == 1.0 and acc[3] == 0.0          # the oracle's miss at depth 4


def test_parallel_samples_and_abort_leak_nothing(model):
    engine = engine_for(model, "eagle")
    prompts = prompts_of([8, 12], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=30, n=3, ignore_eos=True)
    outs = run_all(engine, prompts, params)
    single = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in run_all(engine_for(model, None), prompts, single)]
    assert tokens(outs) == [[w] * 3 for w in want]      # every sample = the plain greedy one
    assert_drafter_free(engine)
    rid = engine.add_request(prompts[0], params)
    engine.add_request(prompts[1], params)
    while not any(s.draft for r in engine.requests.values() for s in r.seqs):
        engine.step()
    assert engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert_all_free(engine)
    assert_drafter_free(engine)


def exact_joint(model, prompt, params) -> torch.Tensor:
    """[V * V] exact distribution of the first two sampled tokens (top-k keeps it small)."""
    batch = SamplingBatch.from_params([params], [None], "cpu")
    with torch.no_grad():
        p1 = filtered_probs(model(torch.tensor([prompt]))[0, -1:].float(), batch)[0]
        firsts = p1.nonzero().flatten().tolist()
        ids = torch.tensor([prompt + [t] for t in firsts])
        p2 = filtered_probs(model(ids)[:, -1].float(), SamplingBatch.from_params(
            [params] * len(firsts), [None] * len(firsts), "cpu"))
    joint = {(a, b): float(p1[a] * p2[i, b]) for i, a in enumerate(firsts)
             for b in p2[i].nonzero().flatten().tolist()}
    return joint


def first_layer_drafter(model):
    """A draft model that is the target's first layer (its final norm, the full vocabulary):
    its distributions resemble the target's without being them."""
    module, _, manifest = random_drafter("draft_model", model)
    module.layers[0].load_state_dict(model.layers[0].state_dict())
    module.norm.load_state_dict(model.norm.state_dict())
    return module, DraftHead(model.lm_head.weight, torch.arange(model.cfg.vocab_size)), manifest


class TopTwoTreeProposer:
    """A tree of deterministic candidates from the target itself: its two likeliest next
    tokens, and under the likeliest one the token likeliest after it."""

    hidden_layers = ()
    max_nodes = 3

    def __init__(self, model) -> None:
        self.model = model
        self.seen: dict[tuple[int, ...], list[int]] = {}   # many requests share a context

    def propose(self, inputs, hidden):
        return [Draft(self.candidates(inp.seq.token_ids), [0, 0, 1]).pruned(inp.max_depth)
                for inp in inputs]

    @torch.no_grad()
    def candidates(self, ids: list[int]) -> list[int]:
        if tuple(ids) not in self.seen:
            a, b = self.model(torch.tensor([ids]))[0, -1].topk(2).indices
            c = self.model(torch.tensor([ids + [int(a)]]))[0, -1].argmax()
            self.seen[tuple(ids)] = [int(a), int(b), int(c)]
        return self.seen[tuple(ids)]

    def fork(self, parent_id, child_id): ...

    def release(self, seq_id): ...


def sampled_joint(model, prompt, params, rounds, biased=False, monkeypatch=None, tree=False):
    """Counts of the first two tokens of ``rounds`` seeded requests through the speculative
    engine: a draft-model chain (sampled, with q) or a tree of deterministic candidates
    (``tree``); ``biased``: with a rule that resamples from p instead of the residual."""
    if biased:
        monkeypatch.setattr(spec_mod, "rejection_accept", wrong_accept)
        monkeypatch.setattr(spec_mod, "tree_accept", wrong_tree_accept)
    # 64 requests a step (each is seeded: how they are batched does not change its draws)
    engine = engine_for(model, None, max_num_batched_tokens=1024, max_num_seqs=64,
                        num_kv_blocks=1024)
    if tree:
        engine.use_speculator(DraftAndVerify(SpeculativeConfig("eagle"), model.cfg.max_seq_len,
                                             TopTwoTreeProposer(model)))
    else:
        engine.use_speculator(build_speculator(
            {"method": "draft_model", "num_speculative_tokens": 2}, engine,
            drafter=first_layer_drafter(model)))
    seeded = [SamplingParams(temperature=params.temperature, top_k=params.top_k,
                             top_p=params.top_p, max_tokens=3, ignore_eos=True, seed=i)
              for i in range(rounds)]
    outs = run_all(engine, [prompt] * rounds, seeded)
    counts: dict[tuple, int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids[:2])   # token 2 is a verified draft or resample
        counts[key] = counts.get(key, 0) + 1
    return counts, engine.speculator.stats


def wrong_tree_accept(children, tokens, q, p, generator=None):
    """The tree rule, but a rejected candidate's node draws from p itself, not the residual."""
    node, path = 0, []
    while True:
        for child in children.get(node, []):
            if float(torch.rand((), generator=generator)) < float(p[node, tokens[child]]):
                path.append(child)
                break
        else:
            return path, int(torch.multinomial(p[node].double(), 1, generator=generator))
        node = path[-1]


def joint_tv(counts: dict, exact: dict) -> float:
    keys = sorted(set(counts) | set(exact))
    c = torch.tensor([float(counts.get(k, 0)) for k in keys])
    return tv(c, torch.tensor([exact.get(k, 0.0) for k in keys], dtype=torch.float64))


def test_sampling_is_lossless_and_a_biased_rule_is_not(model, monkeypatch):
    """The spec engine's first two tokens against their exact joint distribution (top-4 at
    temperature 1.5: 16 outcomes); 1200 samples give a TV standard error near 0.02. Measured
    once at 300 / 1200 / 4800 samples: lossless 0.077 / 0.041 / 0.016, biased 0.171 / 0.147 /
    0.139."""
    prompt = prompts_of([7], seed=9)[0]
    params = SamplingParams(temperature=1.5, top_k=4)
    exact = exact_joint(model, prompt, params)
    counts, stats = sampled_joint(model, prompt, params, 1200)
    assert 0.05 < stats.acceptance_by_position[0] < 0.95     # both branches exercised
    good = joint_tv(counts, exact)
    fewer = joint_tv(sampled_joint(model, prompt, params, 300)[0], exact)
    bad = joint_tv(sampled_joint(model, prompt, params, 1200, True, monkeypatch)[0], exact)
    assert good < 0.06 and good < fewer, (good, fewer)     # noise, shrinking with samples
    assert bad > good + 0.04, (good, bad)                  # a bias that does not


@pytest.mark.parametrize("tree, temperature", [(False, 0.8), (True, 1.0)])
def test_top_p_sampling_is_lossless_for_a_chain_and_a_tree(model, monkeypatch, tree,
                                                            temperature):
    """Top-p 0.9 within the top 4 at temperature 0.8 (a sampled chain) and 1.0 (a tree of
    deterministic candidates): the first two tokens against their exact joint distribution;
    a rule that resamples from p instead of the residual is caught. Measured once (TV,
    lossless / biased): chain 0.051 / 0.142, tree 0.039 / 0.227."""
    prompt = prompts_of([7], seed=9)[0]
    params = SamplingParams(temperature=temperature, top_k=4, top_p=0.9)
    exact = exact_joint(model, prompt, params)
    counts, stats = sampled_joint(model, prompt, params, 800, tree=tree)
    assert 0.05 < stats.acceptance_by_position[0] < 0.95     # both branches exercised
    good = joint_tv(counts, exact)
    bad = joint_tv(sampled_joint(model, prompt, params, 800, True, monkeypatch, tree)[0],
                   exact)
    assert good < 0.085, good                # about 1.7x the noise of 800 samples
    assert bad > good + 0.06, (good, bad)


def first_proposal(engine, prompt):
    """Run ``prompt`` greedily and return what the proposer saw and made at its first call
    (right after the prefill): the sequence's tokens, the drafter's input features of the
    prompt's rows, the drafts, and the tree it grew (tree methods)."""
    prop = engine.speculator.proposer
    seen, real = {}, prop.propose

    def spy(inputs, hidden):
        drafts = real(inputs, hidden)
        if not seen:
            inp = inputs[0]
            assert inp.start == 0
            seen.update(tokens=list(inp.seq.token_ids), draft=drafts[0],
                        feats=prop.features(hidden)[torch.tensor(inp.rows)].clone(),
                        tree=dict(prop.last_tree.get(inp.seq.seq_id, {})))
        return drafts

    prop.propose = spy
    run_all(engine, [prompt], GREEDY)
    return seen


def dense_feature(prop, tokens: list[int], feats: list[torch.Tensor]) -> torch.Tensor:
    """The drafter's output at the last of ``tokens`` (x_{t+1} per row) and ``feats`` (h_t)
    by a dense causal pass at positions 0.. (no paged cache, no tree mask)."""
    with torch.no_grad():
        x = prop.embed(torch.tensor(tokens))[None]
        return prop.drafter(x, torch.stack(feats)[None], torch.arange(len(tokens)))[0, -1]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_tree_scores_are_a_dense_pass_over_each_path(model, method, fused):
    """EAGLE-2's tree grows one drafter pass per level over the new nodes only, the earlier
    levels kept in the drafter's paged cache behind a mask. Every node's joint
    log-confidence must be what dense causal passes over the prompt's rows and the node's
    path give, through the CPU fast path and the eager modules alike."""
    engine = engine_for(model, method, k=4)
    prop = engine.speculator.proposer
    real_runs, took = prop.fused.runs, []
    prop.fused.runs = lambda batch: took.append(fused and real_runs(batch)) or took[-1]
    seen = first_proposal(engine, prompts_of([11], seed=3)[0])
    tree, toks = seen["tree"], seen["tokens"]
    # the fast path ran where its C++ kernels built (else both runs are the eager path)
    assert any(took) == (fused and cpu_forward.supports(prop.drafter, prop.drafter.block_cfg))
    assert len(tree["tokens"]) > 2 * prop.topk            # it grew past the first level
    prefix_tokens, prefix = toks[1:len(seen["feats"]) + 1], list(seen["feats"])
    index = {int(t): j for j, t in enumerate(prop.head.ids)}
    for node in range(1, len(tree["tokens"]) + 1):
        path = [node]
        while tree["parents"][path[-1] - 1]:
            path.append(tree["parents"][path[-1] - 1])
        path.reverse()
        feats, tokens = list(prefix), list(prefix_tokens)
        score = 0.0
        for n in path:
            f = dense_feature(prop, tokens, feats)
            logp = prop.head(f).float().log_softmax(-1)
            score += float(logp[index[tree["tokens"][n - 1]]])
            tokens.append(tree["tokens"][n - 1])
            feats.append(f)
        assert abs(score - tree["scores"][node - 1]) < 1e-3, (node, path)


def test_chain_is_the_dense_greedy_chain(model):
    """MTP drafts a chain, one cached step per token: the tokens a dense causal pass picks."""
    engine = engine_for(model, "mtp", k=4)
    prop = engine.speculator.proposer
    seen = first_proposal(engine, prompts_of([9], seed=4)[0])
    feats, tokens = list(seen["feats"]), seen["tokens"][1:len(seen["feats"]) + 1]
    want = []
    for _ in range(4):
        f = dense_feature(prop, tokens, feats)
        want.append(int(prop.head.ids[prop.head(f).argmax()]))
        tokens, feats = tokens + want[-1:], feats + [f]
    assert seen["draft"].tokens == want
