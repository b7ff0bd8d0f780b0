"""The engine core: token-level step plans (chunked prefill under a token budget), the runner's
logits rows and hidden states, tree masks, KV rollback and compaction, batched seeded sampling,
logprobs, incremental text, the driver (streams, abort, bounded trace, hooks, O(1) stats) and
bad input.

References: the model's own forward pass without any cache in float64 (logits, logprobs,
hidden states, a tree node's logits = the forward over its root-to-node path), each request run
alone, the tokenizer's full decode. The model is the tiny preset with sharpened q/k (attention
peaked, so a wrong KV cache changes the outputs: ``test_context_matters`` makes sure).
"""
from __future__ import annotations

import pytest
import torch
from engine_checks import assert_all_free, prompts_of, run_all, sharp_model

import minillm
from minillm import SamplingParams
from minillm.config import get_preset
from minillm.engine import EngineConfig, LLMEngine
from minillm.engine.output_processor import OutputProcessor
from minillm.engine.scheduler import ScheduledSeq, SchedulerOutput
from minillm.engine.sequence import Draft
from minillm.generate import generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def sharp():
    return sharp_model()


@pytest.fixture(scope="module")
def tok():
    from minillm.checkpoint.loader import smollm2_tokenizer

    return smollm2_tokenizer()


@torch.no_grad()
def full_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits over the whole sequence, no cache: [T, vocab]."""
    return model(torch.tensor([ids]))[0].double().log_softmax(-1)


def test_context_matters(sharp):
    """The test model's next token depends on its context: changing the first token of 40
    changes the greedy choice at most later positions and moves the logits by orders of
    magnitude more than the tests' tolerance, so a wrong KV cache cannot go unseen."""
    a = prompts_of([40], seed=1)[0]
    b = [a[0] + 1] + a[1:]
    with torch.no_grad():
        la, lb = (sharp(torch.tensor([p]))[0] for p in (a, b))
    assert (la.argmax(-1) != lb.argmax(-1))[1:].double().mean() > 0.5
    assert (la[-1] - lb[-1]).abs().max() > 0.1


# ---- step plans in tokens ---------------------------------------------------------------------
@pytest.mark.parametrize("budget", [16, 64, 1000])
def test_chunked_prefill_gives_the_same_tokens_and_logprobs(budget):
    """Prompts of 1 to 2,000 tokens under budgets from 16: the same greedy tokens (fp32) as
    with chunking off (a large budget) and as each request alone, the same logprobs, and the
    budget holds in every step."""
    model = sharp_model(torch.float32)
    prompts = prompts_of([1, 17, 300, 2000, 5])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    chunked = LLMEngine(model, None, EngineConfig(num_kv_blocks=600, max_num_batched_tokens=budget,
                                                  max_num_seqs=4, block_size=16))
    outs = run_all(chunked, prompts, params)
    assert all(sum(r.scheduled.values()) <= budget for r in chunked.trace)
    whole = LLMEngine(model, None, EngineConfig(num_kv_blocks=600, max_num_batched_tokens=4096,
                                                enable_chunked_prefill=False))
    ref = run_all(whole, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref] == \
        [generate(model, p, params) for p in prompts]
    for o, r in zip(outs, ref):
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_a_long_prompt_does_not_wait_behind_decodes(sharp):
    """Budget 64, two requests decoding: a 100-token prompt is admitted in the very next step
    (a 62-token chunk next to the 2 decodes) and finishes its prefill in the one after."""
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=100, max_num_batched_tokens=64,
                                                 max_num_seqs=4))
    for p in prompts_of([5, 6]):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()
    rid = engine.add_request(prompts_of([100], seed=2)[0], GREEDY)
    engine.step()
    engine.step()
    first, second = list(engine.trace)[-2:]
    assert first.scheduled[rid] == 62 and second.scheduled[rid] == 38
    while engine.has_unfinished():
        engine.step()
    assert_all_free(engine)


def test_logprobs_equal_the_full_forward(sharp):
    """Every output token's logprob and top-3 alternatives, sampled at temperature 1 with a
    chunked prompt, equal log_softmax of the model's own logits over the finished sequence."""
    prompt = prompts_of([45])[0]
    params = SamplingParams(temperature=1.0, max_tokens=7, seed=5, logprobs=3, ignore_eos=True)
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=50, max_num_batched_tokens=16,
                                                 max_num_seqs=4))
    out = run_all(engine, [prompt], params)[0].outputs[0]
    ref = full_logprobs(sharp, prompt + out.token_ids)
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert list(entry)[0] == tok and abs(entry[tok] - row[tok]) < 1e-5   # fp32 logprobs
        top = row.topk(3)
        assert set(top.indices.tolist()) <= set(entry)
        assert all(abs(entry[t] - v) < 1e-5 for t, v in zip(top.indices.tolist(),
                                                            top.values.tolist()))


def test_prompt_logprobs_across_chunks(sharp):
    prompt = prompts_of([50])[0]
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=50, max_num_batched_tokens=16,
                                                 max_num_seqs=4))
    out = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=2,
                                                   prompt_logprobs=2))[0]
    ref = full_logprobs(sharp, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert abs(entry[prompt[i]] - ref[i - 1, prompt[i]]) < 1e-5 and len(entry) in (2, 3)


def test_prompt_logprobs_survive_recompute_mid_prompt(sharp):
    """Preempted (recompute) after two of its four chunks, the prompt is computed again from
    the start: its prompt logprobs are rewritten, not repeated."""
    prompt = prompts_of([60], seed=5)[0]
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=50, max_num_batched_tokens=16,
                                                 max_num_seqs=4))
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2,
                                                    prompt_logprobs=1))
    engine.step()
    engine.step()
    req = engine.requests[rid]
    assert 0 < len(req.prompt_logprobs) < len(prompt)
    engine.scheduler.running.remove(req)
    engine.scheduler._preempt(req, SchedulerOutput())
    out = None
    while engine.has_unfinished():
        out = engine.step() or out
    ref = full_logprobs(sharp, prompt)
    got = out[0].prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    assert all(abs(e[prompt[i]] - ref[i - 1, prompt[i]]) < 1e-5
               for i, e in enumerate(got[1:], start=1))
    assert_all_free(engine)


# ---- the runner: rows, hidden states, tree masks ----------------------------------------------
def one_step(engine: LLMEngine, seq, n: int, **kw):
    """Run ``n`` tokens of ``seq`` (blocks already reserved) through the runner directly."""
    plan = SchedulerOutput(seqs=[ScheduledSeq(seq, n)])
    engine.blocks.reserve(seq.seq_id, seq.num_computed + n)
    result = engine.runner.forward(plan, engine.blocks.tables, **kw)
    seq.num_computed += n
    return result


def start_request(engine: LLMEngine, prompt: list[int]):
    """Prefill ``prompt`` through the engine; returns its live Sequence (one output token)."""
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=50,
                                                     ignore_eos=True))
    engine.step()
    return rid, engine.requests[rid].seqs[0]


def test_every_row_logits_and_hidden_states_from_one_pass(sharp):
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=50))
    rid, seq = start_request(engine, prompts_of([21])[0])
    seq.token_ids += prompts_of([5], seed=9)[0]           # a "draft" of 5 tokens to verify
    n = seq.num_uncomputed
    result = one_step(engine, seq, n, all_logits={seq.seq_id}, hidden_layers=[0, 1, -1])
    ids = torch.tensor([seq.token_ids])
    with torch.no_grad():
        final, kept = sharp.forward_layers(ids, keep=[0, 1])
        want = sharp.lm_head(final)[0, -n:]
    torch.testing.assert_close(result.logits.double(), want, rtol=0, atol=1e-9)
    for layer, h in ((0, kept[0]), (1, kept[1]), (-1, final)):
        torch.testing.assert_close(result.hidden[layer], h[0, -n:], rtol=0, atol=1e-9)
    engine.abort(rid)
    assert_all_free(engine)


def test_tree_mask_node_logits_equal_their_paths(sharp):
    """A tree of 6 draft nodes over a cached prefix, verified in one pass with each node at
    position prefix + depth: node i's logits equal the forward over prefix + its path."""
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=50, block_size=8))
    rid, seq = start_request(engine, prompts_of([19])[0])
    ctx = seq.num_tokens - 1                              # the sampled token is node 0 (root)
    parent = [-1, 0, 0, 1, 1, 2]
    nodes = [seq.token_ids[-1]] + prompts_of([5], seed=4)[0]
    seq.token_ids[-1:] = nodes
    depth = [0] * 6
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
        depth[i] = int(mask[i].sum()) - 1
    result = one_step(engine, seq, 6, all_logits={seq.seq_id}, masks={seq.seq_id: mask},
                      positions={seq.seq_id: [ctx + d for d in depth]})
    for i in range(6):
        path = [nodes[j] for j in range(6) if mask[i, j]]
        want = sharp(torch.tensor([seq.token_ids[:ctx] + path]))[0, -1]
        torch.testing.assert_close(result.logits[i].double(), want, rtol=0, atol=1e-9)
    engine.abort(rid)
    assert_all_free(engine)


class FixedVerdict:
    """A speculator that drafts nothing and accepts a fixed path of nodes, then a fixed token
    (the engine's verification seam, driven by hand)."""

    hidden_layers = ()
    max_draft_tokens = 5

    def __init__(self, path: list[int], bonus: int) -> None:
        self.path, self.bonus = path, bonus

    def propose(self, plan, out, done):
        return {}

    def verify(self, seq, draft, logits, params, generator):
        return self.path, self.bonus

    def release(self, seq_id) -> None: ...


def test_rollback_and_compaction_keep_the_accepted_tokens(sharp):
    """A step verifies 6 tree nodes and accepts the path 0 -> 2 -> 5: the runner moves its
    K/V into place, the update truncates the rest (freed blocks then poisoned), and decoding
    goes on with the same tokens as the accepted sequence run alone from scratch."""
    bonus = prompts_of([1], seed=7)[0][0]
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=60, block_size=4, watermark=0),
                       speculator=FixedVerdict([2, 5], bonus))
    rid, seq = start_request(engine, prompts_of([10])[0])
    ctx = seq.num_tokens - 1
    nodes = [seq.token_ids[-1]] + prompts_of([5], seed=6)[0]
    seq.attach_draft(Draft(nodes[1:], [0, 0, 1, 1, 2]))
    engine.step()
    assert seq.token_ids[ctx:] == [nodes[0], nodes[2], nodes[5], bonus]
    assert seq.num_computed == ctx + 3 and engine.blocks.filled[seq.seq_id] == ctx + 3
    free = list(engine.blocks.device.free)
    engine.runner.pool.k[:, free] = 1e4
    engine.runner.pool.v[:, free] = 1e4
    base = list(seq.token_ids)
    out = []
    while len(out) < 5:
        engine.step()
        out = seq.output_ids[len(base) - seq.prompt_len:]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    assert out[:5] == generate(sharp, base, params)
    engine.abort(rid)
    assert_all_free(engine)


# ---- sampling --------------------------------------------------------------------------------
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


# ---- text ------------------------------------------------------------------------------------
TEXTS = ["Café au lait, s'il vous plaît", "Emoji 😀🎉 and more 🚀", "日本語のテキスト",
         "naïve façade"]


@pytest.fixture(scope="module")
def tiny_llm():
    return minillm.LLM("tiny", dtype="float32", num_kv_blocks=200)


def test_stream_joins_to_the_generated_text(tiny_llm):
    """Random weights emit arbitrary byte tokens (characters split over tokens, and bytes that
    are no UTF-8 at all): the streamed pieces join to generate()'s text, which is the
    tokenizer's decode of the same ids minus an incomplete last character."""
    llm = tiny_llm
    tok = llm.tokenizer
    for i, text in enumerate(TEXTS):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True)
        pieces = list(llm.stream(text, params))
        out = llm.generate([text], params, use_tqdm=False)[0]
        full = tok.decode(out.token_ids)
        assert "".join(pieces) == out.text == full.removesuffix("\ufffd")
        # U+FFFD only where the ids are not valid UTF-8 at all, never a character cut in two
        assert sum(p.count("\ufffd") for p in pieces) == full.removesuffix("\ufffd").count("\ufffd")
    assert_all_free(llm.engine)


def test_several_streams_at_once(tiny_llm):
    llm = tiny_llm
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True)
              for s in range(3)]
    streams = [llm.stream(t, p) for t, p in zip(TEXTS, params)]
    got = ["", "", ""]
    live = set(range(3))
    while live:
        for i in sorted(live):
            try:
                got[i] += next(streams[i])
            except StopIteration:
                live.discard(i)
    want = [o.text for o in llm.generate(TEXTS[:3], params, use_tqdm=False)]
    assert got == want
    assert_all_free(llm.engine)


def test_stop_string_spanning_tokens_never_leaks(tiny_llm):
    llm = tiny_llm
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = llm.generate(["The weather today"], params, use_tqdm=False)[0]
    ids, tok = full.token_ids, llm.tokenizer
    pieces = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
    # a stop string made of the end of token 9's text and the start of token 10's
    a, b = pieces[9], pieces[11]
    stop = b[len(a) - 2:len(a) + 3]
    assert len(stop) == 5 and stop in full.text
    stopped = llm.generate(["The weather today"], SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, stop=(stop,)), use_tqdm=False)[0]
    streamed = "".join(llm.stream("The weather today", SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, stop=(stop,))))
    assert stopped.text == streamed == full.text[:full.text.index(stop)]
    assert stopped.outputs[0].finish_reason == "stop"


def test_generate_takes_one_params_per_prompt_and_token_ids(tiny_llm):
    llm = tiny_llm
    outs = llm.generate([[5, 6, 7], "Hello"], [SamplingParams(temperature=0, max_tokens=3),
                                               SamplingParams(temperature=0, max_tokens=5)],
                        use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 5] and outs[0].prompt_token_ids == [5, 6, 7]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    assert_all_free(llm.engine)


# ---- the driver ------------------------------------------------------------------------------
def test_trace_is_bounded_hooks_fire_and_stats_are_live(sharp):
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=80, trace_steps=5,
                                                 block_size=4))
    seen = []
    engine.step_hooks.append(lambda eng, rec: seen.append((rec.index,
                                                           eng.blocks._slots_by_scan())))
    rid = engine.add_request(prompts_of([9])[0], SamplingParams(temperature=0, max_tokens=12,
                                                                 ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        assert engine.stats().slots_used == engine.blocks._slots_by_scan()
    assert len(engine.trace) == 5 and [i for i, _ in seen] == list(range(engine.num_steps))
    assert engine.abort(rid) is False            # finished: a no-op
    assert_all_free(engine)


# ---- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize("options, name", [
    (dict(max_num_batched_tokens=8, block_size=16, max_num_seqs=4), "block_size"),
    (dict(max_num_batched_tokens=32, max_num_seqs=64), "max_num_seqs"),
    (dict(trace_steps=0), "trace_steps"),
])
def test_bad_engine_options_name_the_parameter(options, name):
    with pytest.raises(ValueError, match=f"max_num_batched_tokens|{name}") as err:
        EngineConfig(**options)
    assert name in str(err.value)


def test_prompt_too_long_for_one_step_without_chunking(sharp):
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=80, max_num_batched_tokens=64,
                                                 enable_chunked_prefill=False, max_num_seqs=4))
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        engine.add_request(prompts_of([100])[0], GREEDY)
    assert_all_free(engine)


# ---- the real model, one slow test per path ----------------------------------------------------
REAL_TEXTS = ["The capital of France is", "def add(a, b):\n    return",
              "List three colours:", "In 1969, the first humans"]


def real_prompts(tok, repeat: int = 1) -> list[list[int]]:
    return [tok.encode(t * repeat) for t in REAL_TEXTS]


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    dict(preemption="recompute", num_kv_blocks=14, block_size=4, watermark=0),
    dict(preemption="swap", num_kv_blocks=14, block_size=4, watermark=0),
    dict(max_num_batched_tokens=16, max_num_seqs=4),           # chunked prefill
    dict(attention_backend="triton", num_kv_blocks=40, block_size=8),  # interpreted kernels
])
def test_real_model_paths_equal_each_request_alone(real, options):
    """SmolLM2 through each engine path: the same greedy tokens, and logprobs within fp32
    rounding, as each request alone through the contiguous-cache loop."""
    from minillm.device import setup_triton

    setup_triton()
    model, tok = real
    triton = options.get("attention_backend") == "triton"
    prompts = real_prompts(tok, 1 if triton else 3)[:2 if triton else 4]
    params = SamplingParams(temperature=0.0, max_tokens=3 if triton else 10, ignore_eos=True,
                            logprobs=1)
    engine = LLMEngine(model, tok, EngineConfig(**{"num_kv_blocks": 64, **options}))
    outs = run_all(engine, prompts, params)
    if "preemption" in options:
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == generate(model, p, params)
        ref = full_logprobs(model, p + o.token_ids)
        for i, (t, entry) in enumerate(zip(o.token_ids, o.outputs[0].logprobs)):
            assert abs(entry[t] - ref[len(p) - 1 + i, t]) < 1e-3


@pytest.mark.slow
def test_real_model_parallel_sampling_and_beam_search(real):
    """n = 3 greedy samples share the prompt's blocks (copy-on-write on the first decode) and
    each equals the request alone; beam search equals a plain beam search without a cache."""
    from test_engine import reference_beam_search

    model, tok = real
    prompt = tok.encode(REAL_TEXTS[0])
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=40, block_size=4))
    greedy = SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True)
    out = run_all(engine, [prompt], greedy)[0]
    assert all(c.token_ids == generate(model, prompt, greedy) for c in out.outputs)
    beams = run_all(engine, [prompt], SamplingParams(beam_width=2, n=2, max_tokens=5))[0]
    ref = reference_beam_search(model, prompt, 2, 5, model.cfg.eos_token_id)
    assert [c.token_ids for c in beams.outputs] == ref[:2]


@pytest.mark.slow
def test_real_model_streams_multibyte_text(real):
    """The real model asked for emoji and Japanese: the stream holds no broken character and
    joins to generate()'s text."""
    model, tok = real
    llm = OutputProcessor(LLMEngine(model, tok, EngineConfig(num_kv_blocks=64)))  # LLM's loops
    prompt = tok.apply_chat_template([{"role": "user", "content":
                                       "Say 'good morning' in Japanese and add two emoji."}],
                                     add_generation_prompt=True)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    pieces = list(llm.stream(prompt, params))
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert "".join(pieces) == out.text and not any("\ufffd" in p for p in pieces)
    assert any(ord(ch) > 0x2FFF for ch in out.text)        # it did write CJK or emoji
    assert_all_free(llm.engine)


def test_swap_out_is_complete_when_it_returns():
    """Blocks swapped out and overwritten on the device right away: the CPU pool holds the old
    contents. On CUDA this catches a host read of an unfinished device-to-host copy."""
    from minillm.cache.pool import PagedKVPool

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pool = PagedKVPool(get_preset("tiny"), 64, 16, device, torch.float32, num_cpu_blocks=64)
    want = torch.randn(pool.k[:, :32].shape, device=device)
    pool.k[:, :32] = want
    pool.swap_out([(b, 63 - b) for b in range(32)])
    pool.k.zero_()
    assert torch.equal(pool.cpu_k[:, 63 - torch.arange(32)], want.cpu())
    pool.swap_in([(63 - b, b) for b in range(32)])
    assert torch.equal(pool.k[:, :32], want)


def test_static_buffers_give_the_same_tokens_at_fixed_addresses(sharp):
    """With ``static_buffers`` every step's inputs and metadata live in tensors allocated once
    (what CUDA graph replay needs): same outputs as fresh tensors, same addresses every step."""
    prompts = prompts_of([7, 30, 12])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    from minillm.attention.paged import default_paged_backend, get_paged_backend

    plain = run_all(LLMEngine(sharp, None, EngineConfig(num_kv_blocks=60)), prompts, params)
    seen = set()

    class Spy:
        """The default backend, noting where each call's metadata lives."""
        name, cpu_fast_path = "spy", False
        inner = get_paged_backend(default_paged_backend(sharp.device, sharp.dtype))
        reads_direct = inner.reads_direct

        def __call__(self, q, k, v, k_cache, v_cache, meta):
            seen.add((meta.slot_mapping.data_ptr(), meta.block_tables.data_ptr(),
                      meta.seq_lens.data_ptr()))
            return self.inner(q, k, v, k_cache, v_cache, meta)

    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=60, static_buffers=True,
                                                 attention_backend=Spy()))
    fixed = run_all(engine, prompts, params)
    assert [o.token_ids for o in fixed] == [o.token_ids for o in plain]
    buffers = engine.runner.buffers
    assert seen == {(buffers.slot_mapping.data_ptr(), buffers.block_tables.data_ptr(),
                     buffers.seq_lens.data_ptr())}
