"""The engine's batched sampler against the chapter-01 sampler, float64 math and counting.

References: ``minillm.sampling.sample`` with the same generator state (token for token),
a float64 softmax / log_softmax written out here, and the empirical distribution of many draws.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from engine_checks import prompts_of, run_all

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.engine.sampler import (
    SamplingBatch,
    _top_k_then_top_p,
    filtered_probs,
    prompt_logprobs,
    sample_rows,
)
from minillm.sampling import sample

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Row kinds mixed through the tests: greedy, plain, tempered, top-k, top-p and both.
KINDS = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
         SamplingParams(temperature=0.6), SamplingParams(temperature=1.3, top_k=20),
         SamplingParams(temperature=0.9, top_p=0.7),
         SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
         SamplingParams(temperature=1.0, top_k=4, top_p=0.6)]  # the nucleus of the top-k


def gen(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def batch_of(params, generators, device="cpu", logprobs=0) -> SamplingBatch:
    return SamplingBatch.from_params(params, generators, device, logprobs=logprobs)


def ref_distribution(row: list[float], t: float, k: int, p: float) -> list[float]:
    """softmax(row / t) restricted to top-k then the nucleus of mass p, in float64 loops."""
    x = [v / t for v in row]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    if k > 0:
        order = [i for i in order if x[i] >= x[order[k - 1]]]  # ties at the k-th value stay
    z = [math.exp(x[i] - x[order[0]]) for i in order]
    kept, mass = [], 0.0
    for i, w in zip(order, z):
        kept.append(i)
        mass += w / sum(z)
        if mass >= p:
            break
    total = sum(math.exp(x[i] - x[order[0]]) for i in kept)
    out = [0.0] * len(row)
    for i in kept:
        out[i] = math.exp(x[i] - x[order[0]]) / total
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seeded_rows_match_the_chapter_sampler(device, dtype):
    """Each seeded row, step after step, equals minillm.sampling.sample on a twin generator."""
    torch.manual_seed(0)
    params = KINDS * 2
    ours = [gen(100 + i, device) for i in range(len(params))]
    twins = [gen(100 + i, device) for i in range(len(params))]
    batch = batch_of(params, ours, device)
    for _ in range(25):
        logits = (torch.randn(len(params), 300) * 3).to(device, dtype)
        got = sample_rows(logits, batch).token_ids
        want = [int(sample(logits[i:i + 1], p, g)) for i, (p, g) in
                enumerate(zip(params, twins))]
        assert got == want
    assert all(a.get_state().equal(b.get_state()) for a, b in zip(ours, twins))


def test_greedy_rows_take_the_first_argmax_and_leave_their_generator_alone():
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 3.0, 9.0],
                           [0.0, 1.0, 2.0, 3.0]])
    gens = [gen(1), gen(2), None, gen(3)]
    before = [g.get_state() for g in gens[:2]]
    greedy = SamplingParams(temperature=0.0)
    for last in (greedy, SamplingParams(temperature=1.0)):  # all greedy, or one row sampled
        out = sample_rows(logits, batch_of([greedy] * 3 + [last], gens))
        assert out.token_ids[:3] == [1, 0, 3]
        assert all(g.get_state().equal(s) for g, s in zip(gens[:2], before))


def tokens_of_tracked_row(logit_steps, tracked, others, position):
    """The tracked (params, seed) row's tokens over the steps, at ``position`` among others.

    others: (params, seed or None) rows; each step they get fresh random logits."""
    rows = others[:position] + [tracked] + others[position:]
    gens = [None if s is None else gen(s) for _, s in rows]
    batch = batch_of([p for p, _ in rows], gens, logprobs=3)
    noise = torch.Generator().manual_seed(position + 17 * len(others))
    tokens = []
    for step_logits in logit_steps:
        logits = torch.randn(len(rows), step_logits.shape[-1], generator=noise) * 4
        logits[position] = step_logits
        tokens.append(sample_rows(logits, batch).token_ids[position])
    return tokens


@pytest.mark.parametrize("tracked", [KINDS[1], KINDS[3], KINDS[4], KINDS[5]])
def test_a_seeded_request_gives_the_same_tokens_alone_and_in_any_batch(tracked):
    torch.manual_seed(3)
    steps = [torch.randn(256) * 2 for _ in range(30)]
    alone = tokens_of_tracked_row(steps, (tracked, 42), [], 0)
    compositions = [
        [(KINDS[0], None)],                                               # next to greedy
        [(KINDS[1], None), (KINDS[2], None)],                             # unseeded rows
        [(KINDS[0], 5), (KINDS[4], 6), (KINDS[5], None), (KINDS[3], 7)],  # everything
        [(tracked, 42)] * 3,                                              # same seed elsewhere
        [(k, None if i % 2 else i) for i, k in enumerate(KINDS * 3)],     # a big batch
    ]
    for others in compositions:
        for position in sorted({0, len(others) // 2, len(others)}):
            assert tokens_of_tracked_row(steps, (tracked, 42), others, position) == alone
    assert len(set(alone)) > 1  # the row really samples


def test_rows_sharing_a_generator_draw_from_it_in_row_order():
    """n > 1 rows of one request share its generator, like the engine's per-row loop."""
    p = KINDS[4]
    logits = torch.randn(4, 200) * 3
    shared, twin = gen(9), gen(9)
    got = sample_rows(logits, batch_of([p] * 4, [shared] * 4)).token_ids
    assert got == [int(sample(row[None], p, twin)) for row in logits]


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 4, 1.0), (1.0, 0, 0.6),
                                   (0.7, 5, 0.8), (1.5, 3, 0.95), (1.0, 3, 0.75)])
@pytest.mark.parametrize("seeded", [False, True])
def test_draws_follow_the_filtered_softmax(t, k, p, seeded):
    row = [2.0, 1.5, 1.2, 0.9, 0.5, 0.0, -0.4, -1.0]
    want = ref_distribution(row, t, k, p)
    draws = 20000
    torch.manual_seed(0)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p)] * draws
    gens = [gen(123)] * draws if seeded else [None] * draws
    tokens = sample_rows(torch.tensor([row] * draws), batch_of(params, gens)).token_ids
    freq = [tokens.count(i) / draws for i in range(len(row))]
    assert all(f == 0 for f, w in zip(freq, want) if w == 0)  # never outside top-k / nucleus
    assert 0.5 * sum(abs(f - w) for f, w in zip(freq, want)) < 0.02  # total variation
    torch.testing.assert_close(filtered_probs(torch.tensor([row]), batch_of(params[:1], [None])),
                               torch.tensor([want]), rtol=0, atol=1e-6)


def test_top_k_rows_with_different_k_each_keep_their_own_top_k():
    """Rows with top-k 1, 3, 6 and 12 (no top-p, so the top-k-only path runs) and a greedy row:
    each sampled row draws only from its own k largest logits (float64 ranking) and, over 600
    draws, from every one of them; its filtered distribution equals the float64 reference."""
    ks = [3, 12, 1, 6]
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(len(ks) + 1, 40, generator=g, dtype=torch.float64)
    params = [SamplingParams(temperature=1.0, top_k=k) for k in ks]
    params.append(SamplingParams(temperature=0.0, top_k=2))
    batch = batch_of(params, [None] * len(params))
    assert batch.top_k_only == max(ks)                  # the path under test is taken
    want = [ref_distribution(logits[i].tolist(), 1.0, k, 1.0) for i, k in enumerate(ks)]
    probs = filtered_probs(logits.float(), batch)
    torch.testing.assert_close(probs[:len(ks)], torch.tensor(want, dtype=torch.float32),
                               rtol=0, atol=1e-6)
    draws = 600
    torch.manual_seed(0)
    rows = logits.float().repeat_interleave(draws, dim=0)
    out = sample_rows(rows, batch_of([p for p in params for _ in range(draws)],
                                     [None] * (len(params) * draws)))
    for i, k in enumerate(ks):
        top_k = set(logits[i].argsort(descending=True)[:k].tolist())
        seen = set(out.token_ids[i * draws:(i + 1) * draws])
        assert seen == top_k, f"row {i} (top_k={k}): drew {sorted(seen)}, top-k {sorted(top_k)}"
    greedy = out.token_ids[len(ks) * draws:]
    assert set(greedy) == {int(logits[len(ks)].argmax())}


def test_top_p_always_keeps_at_least_one_token():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [10.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 0.5]])
    params = [SamplingParams(temperature=1.0, top_p=1e-6)] * 3
    probs = filtered_probs(logits, batch_of(params, [None] * 3))
    assert ((probs > 0).sum(-1) == 1).all()
    for _ in range(50):
        assert sample_rows(logits, batch_of(params, [None] * 3)).token_ids[1:] == [0, 2]


def test_top_k_keeps_every_token_tied_at_the_kth_value():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 2.0]])
    probs = filtered_probs(logits, batch_of([SamplingParams(top_k=2)], [None]))
    assert (probs > 0).tolist() == [[True, True, True, False, True]]


def test_logprobs_are_skipped_when_nobody_asks():
    logits = torch.randn(3, 64)
    out = sample_rows(logits, batch_of([SamplingParams(temperature=0)] * 3, [None] * 3))
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs == [0.0] * 3
    asked = batch_of([SamplingParams(temperature=0, logprobs=0)] * 3, [None] * 3)
    assert asked.chosen_logprobs and sample_rows(logits, asked).logprobs != [0.0] * 3


@pytest.mark.parametrize("n", [0, 1, 5])
def test_logprobs_are_the_raw_model_distribution(n):
    """Chosen and top-n logprobs = float64 log_softmax of the raw logits, not the tempered or
    filtered distribution the token was drawn from."""
    torch.manual_seed(1)
    logits = torch.randn(len(KINDS), 64) * 3
    batch = batch_of(KINDS, [gen(i) for i in range(len(KINDS))], logprobs=n)
    batch.chosen_logprobs = True    # the chosen token's logprob even when no top-n is asked
    out = sample_rows(logits, batch)
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
        want = ref[i].topk(n)
        assert [t for t, _ in out.top[i]] == want.indices.tolist()
        lps = [lp for _, lp in out.top[i]]
        assert lps == sorted(lps, reverse=True)
        assert lps == pytest.approx(want.values.tolist(), abs=1e-5)


class SyncCounter:
    """Counts the tensor methods that bring a value to the host while installed."""

    METHODS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__",
               "__index__")

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def counted(tensor, *args, **kwargs):
            self.calls.append(name)
            return original(tensor, *args, **kwargs)
        return counted


@pytest.mark.parametrize("n", [0, 3])
def test_one_host_transfer_per_call(monkeypatch, n):
    torch.manual_seed(2)
    params = KINDS * 2
    gens = [gen(i) if i % 2 else None for i in range(len(params))]
    batch = batch_of(params, gens, logprobs=n)  # built before counting: from_params may copy
    logits = torch.randn(len(params), 100)
    counter = SyncCounter(monkeypatch)
    logits[0, 0].item()  # the counter sees a host read ...
    assert counter.calls == ["item"]
    counter.calls.clear()
    sample_rows(logits, batch)  # ... and the sampler makes exactly one
    assert counter.calls == ["tolist"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampling_synchronises_once():
    params = KINDS * 4
    gens = [gen(i, "cuda") if i % 3 else None for i in range(len(params))]
    batch = batch_of(params, gens, "cuda", logprobs=2)
    logits = torch.randn(len(params), 49152, device="cuda")
    sample_rows(logits, batch)  # warm up lazy initialisation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning) as record:
            sample_rows(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in record if "synchroniz" in str(w.message)]) == 1


def test_prompt_logprobs_match_float64():
    torch.manual_seed(4)
    ids = [5, 0, 17, 17, 3, 30]
    logits = torch.randn(len(ids), 32) * 2
    out = prompt_logprobs(logits, ids, n=3)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert len(out) == len(ids) and out[0] is None
    for i in range(1, len(ids)):
        entry = out[i]
        assert next(iter(entry)) == ids[i]  # the prompt token comes first
        assert entry[ids[i]] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-5)
        top = ref[i - 1].topk(3)
        assert set(entry) == {ids[i], *top.indices.tolist()}
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t] == pytest.approx(lp, abs=1e-5)
    assert prompt_logprobs(logits, ids) == [None] + [{t: out[i][t]} for i, t in
                                                     enumerate(ids) if i]


def test_from_params_maps_the_off_values():
    b = batch_of([SamplingParams(top_k=-1), SamplingParams(temperature=0, top_k=3),
                  SamplingParams(top_p=0.5)], [None, None, gen(0)], logprobs=2)
    assert b.top_k.tolist() == [0, 3, 0] and b.greedy == [False, True, False]
    assert b.temperature.dtype == torch.float32 and b.logprobs == 2 and b.use_filters
    assert not batch_of([SamplingParams(), SamplingParams(temperature=0, top_k=5)],
                        [None, None]).use_filters
    direct = SamplingBatch(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]),
                           torch.tensor([1.0, 1.0]), [None, None])
    assert direct.greedy == [True, False]


def test_an_empty_batch_gives_empty_lists():
    out = sample_rows(torch.zeros(0, 10), batch_of([], [], logprobs=2))
    assert (out.token_ids, out.logprobs, out.top) == ([], [], [])


def _batch(rows=2, **kw):
    return batch_of([SamplingParams()] * rows, [None] * rows, **kw)


@pytest.mark.parametrize("call,name", [
    (lambda: sample_rows(torch.zeros(4), _batch()), "logits"),
    (lambda: sample_rows(torch.zeros(2, 3, 4), _batch()), "logits"),
    (lambda: sample_rows(torch.zeros(3, 4), _batch()), "rows"),
    (lambda: sample_rows(torch.zeros(2, 4, dtype=torch.long), _batch()), "floating"),
    (lambda: sample_rows(torch.zeros(2, 4), _batch(logprobs=5)), "logprobs"),
    (lambda: _batch(logprobs=-1), "logprobs"),
    (lambda: batch_of([SamplingParams()] * 2, [None]), "generators"),
    (lambda: batch_of([SamplingParams(beam_width=2)], [None]), "beam"),
    (lambda: SamplingBatch(torch.ones(2), torch.zeros(3), torch.ones(2), [None, None]),
     "top_k"),
    (lambda: prompt_logprobs(torch.zeros(3, 4), [1, 2]), "prompt_ids"),
    (lambda: prompt_logprobs(torch.zeros(2, 4), [1, 9]), "prompt_ids"),
    (lambda: prompt_logprobs(torch.zeros(2, 4), [1, 2], n=-1), "n must"),
    (lambda: prompt_logprobs(torch.zeros(4), [1]), "logits"),
])
def test_bad_input_names_the_parameter(call, name):
    with pytest.raises(ValueError, match=name):
        call()


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


# ---- through the engine ----------------------------------------------------------------------
def test_seeded_request_is_the_same_alone_and_in_any_batch(sharp):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=8, seed=77,
                            ignore_eos=True)
    prompt = prompts_of([13], seed=3)[0]
    alone = run_all(LLMEngine(sharp, None, EngineConfig(num_kv_blocks=80)), [prompt],
                    seeded)[0].token_ids
    others = prompts_of([4, 30, 9], seed=8)
    mix = [GREEDY, SamplingParams(temperature=1.0, max_tokens=5), SamplingParams(
        temperature=0.7, seed=1, max_tokens=9, ignore_eos=True)]
    for k in range(len(others) + 1):   # the seeded request at every position of the batch
        prompts = others[:k] + [prompt] + others[k:]
        params = mix[:k] + [seeded] + mix[k:]
        outs = run_all(LLMEngine(sharp, None, EngineConfig(num_kv_blocks=80)), prompts, params)
        assert outs[k].token_ids == alone


def test_top_k_with_top_p_sorts_only_the_top_values_and_agrees_with_the_full_sort():
    """Rows that all have a top-k (some with top-p; a greedy row among them): the bounded path
    (the top b + 1 values sorted) gives the full sort's distribution; ties of the k-th value
    past the bound fall back to the full sort, which keeps every tie."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=g) * 3
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in
              [(0.7, 4, 0.9), (1.0, 50, 1.0), (1.3, 17, 0.5), (0.0, 0, 1.0), (1.0, 1, 0.3)]]
    batch = SamplingBatch.from_params(params, [None] * 5, "cpu")
    assert batch.top_k_bound == 50 and _top_k_then_top_p(logits / 1.0, batch) is not None
    full = filtered_probs(logits, dataclasses.replace(batch, top_k_bound=0))
    torch.testing.assert_close(filtered_probs(logits, batch), full, rtol=0, atol=1e-7)
    tied = torch.randn(1, 1000, generator=g)
    tied[0, :60] = 9.0                                      # 60 maxima: a top-4 row keeps all
    one = SamplingBatch.from_params([SamplingParams(temperature=1.0, top_k=4, top_p=0.99)],
                                    [None], "cpu")
    assert _top_k_then_top_p(tied, one) is None
    assert (filtered_probs(tied, one) > 0).sum() == 60
