"""The serving engine against independent references: each request run alone through the
contiguous-cache loop (itself checked against HF), HF transformers' greedy output, a plain beam
search without any cache; preemption, sharing and bad input leave no block behind."""
from __future__ import annotations

import pytest
import torch
from engine_checks import assert_all_free, prompts_of, run_all, sharp_model

import minillm
from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.generate import generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny64():
    """A tiny model whose attention matters (see engine_checks.sharp_model), in float64 so that
    batched and alone agree to the last bit of argmax, with SmolLM2's tokenizer."""
    from minillm.checkpoint.loader import smollm2_tokenizer

    return sharp_model(max_seq_len=512), smollm2_tokenizer()


def alone(model, prompts, params):
    return [generate(model, p, params) for p in prompts]


LENGTHS = [5, 17, 32, 1, 40, 9, 16, 23]


@pytest.mark.parametrize("options", [
    dict(),                                             # continuous, paged, mixed
    dict(mixed=False),
    dict(batching="static", max_num_seqs=3),
    dict(admission="reserve"),
    dict(block_size=1), dict(block_size=7),
    dict(max_num_batched_tokens=40, max_num_seqs=2),
    dict(step_policy="prefill_first"), dict(step_policy="decode_first"),
    dict(step_policy="chunked", max_num_batched_tokens=24, max_num_seqs=8),
])
def test_batched_greedy_equals_each_request_alone(tiny64, options):
    model, tok = tiny64
    prompts = prompts_of(LENGTHS)
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=400, **options))
    outs = run_all(engine, prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone(model, prompts, GREEDY)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


POISON = 1e4


def poison_swapped_blocks(monkeypatch):
    """After a swap-out copy, fill the device blocks with a huge value, so that a missed swap-in
    (or a block read after it was given away) shows in the outputs instead of reading stale K/V.
    (Not NaN: padded key slots are masked to probability 0, and 0 x NaN is NaN.)"""
    from minillm.cache.pool import PagedKVPool

    original = PagedKVPool.swap_out

    def swap_out(self, pairs):
        original(self, pairs)
        for dev, _ in pairs:
            self.k[:, dev] = POISON
            self.v[:, dev] = POISON

    monkeypatch.setattr(PagedKVPool, "swap_out", swap_out)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_tiny_pool_forces_preemption_and_outputs_do_not_change(tiny64, preemption,
                                                               monkeypatch):
    poison_swapped_blocks(monkeypatch)
    model, tok = tiny64
    prompts = prompts_of([30, 28, 25, 31, 29, 27])
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=16, block_size=8, watermark=0,
                                                preemption=preemption))
    outs = run_all(engine, prompts, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    if preemption == "swap":
        assert any(r.preempted for r in engine.trace)
    assert [o.token_ids for o in outs] == alone(model, prompts, params)


def test_sampling_with_seed_matches_alone(tiny64):
    model, tok = tiny64
    prompts = prompts_of([7, 19, 3])
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=10, seed=1234,
                            ignore_eos=True)
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=100))
    assert [o.token_ids for o in run_all(engine, prompts, params)] == alone(model, prompts, params)


def test_parallel_sampling_shares_prompt_blocks(tiny64):
    model, tok = tiny64
    prompt = prompts_of([37])[0]            # not a multiple of the block size: copy-on-write
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=100, block_size=8))
    engine.add_request(prompt, SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=0,
                                              ignore_eos=True))
    engine.step()                           # prefill once, fork four ways
    assert engine.blocks.num_used == 5      # ceil(37 / 8) blocks for all four samples
    engine.step()                           # each sample copies the shared last block
    assert engine.blocks.num_used == 4 + 4
    while engine.has_unfinished():
        outs = engine.step()
    assert_all_free(engine)
    assert len(outs[0].outputs) == 4 and len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    greedy = SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True)
    fresh = LLMEngine(model, tok, EngineConfig(num_kv_blocks=100, block_size=8))
    fresh.runner.pool.k.fill_(POISON)     # a block that is not copied right shows
    fresh.runner.pool.v.fill_(POISON)
    out = run_all(fresh, [prompt], greedy)[0]
    assert all(c.token_ids == generate(model, prompt, greedy) for c in out.outputs)


def test_copy_on_write_leaves_the_parents_block_unchanged(tiny64):
    model, tok = tiny64
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=20, block_size=8))
    rid = engine.add_request(prompts_of([13])[0], SamplingParams(n=2, temperature=1.0, seed=3,
                                                                  max_tokens=4, ignore_eos=True))
    engine.step()
    parent, child = engine.requests[rid].seqs
    shared = engine.blocks.tables[parent.seq_id][1]
    before = engine.runner.pool.k[:, shared].clone()
    engine.step()                           # both write position 13 in their own copies
    assert engine.blocks.tables[child.seq_id][1] != engine.blocks.tables[parent.seq_id][1]
    after = engine.runner.pool.k[:, shared]
    assert torch.equal(after[:, :5], before[:, :5])           # the 13 - 8 cached slots kept
    engine.abort(rid)
    assert_all_free(engine)


def reference_beam_search(model, prompt, width, max_tokens, eos, length_penalty=1.0):
    """Plain beam search: every step recomputes every beam from scratch (no cache)."""
    beams, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        cands = []
        for ids, score in beams:
            lp = torch.log_softmax(model(torch.tensor([ids]))[0, -1].float(), -1)
            top = lp.topk(2 * width)
            cands += [(score + v, ids, t) for v, t in zip(top.values.tolist(),
                                                          top.indices.tolist())]
        cands.sort(key=lambda c: -c[0])
        beams = []
        for rank, (score, ids, t) in enumerate(cands[:2 * width]):
            if t == eos:
                if rank < width:
                    done.append((ids + [t], score))
                continue
            beams.append((ids + [t], score))
            if len(beams) == width:
                break
        if len(done) >= width:
            break
    else:
        done += beams
    n = len(prompt)
    ranked = sorted(done, key=lambda d: -d[1] / (len(d[0]) - n) ** length_penalty)
    return [d[0][n:] for d in ranked]


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_plain_reference(tiny64, width):
    model, tok = tiny64
    prompt = prompts_of([11])[0]
    params = SamplingParams(beam_width=width, n=width, max_tokens=8)
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=60, block_size=4))
    out = run_all(engine, [prompt], params)[0]
    ref = reference_beam_search(model, prompt, width, 8, model.cfg.eos_token_id)
    assert [c.token_ids for c in out.outputs] == ref[:width]


def test_priority_policy_runs_urgent_request_first(tiny64):
    model, tok = tiny64
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=100, max_num_seqs=1,
                                                policy="priority"))
    outs = run_all(engine, prompts_of([5, 6, 7]), GREEDY, priorities=[5, 0, 9])
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_token)
    assert order == [1, 0, 2]


def test_static_batching_waits_for_the_whole_batch(tiny64):
    model, tok = tiny64
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=200, batching="static",
                                                max_num_seqs=2))
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    a, b, c = (engine.add_request(p, s) for p, s in zip(prompts_of([4, 4, 4]),
                                                          [short, long, short]))
    while engine.has_unfinished():
        engine.step()
    steps = {rid: [r.index for r in engine.trace if rid in r.request_ids] for rid in (a, b, c)}
    assert min(steps[c]) > max(steps[b])    # c waited for b although a's slot was free
    assert_all_free(engine)


def test_bad_input_is_refused_and_nothing_leaks(tiny64):
    model, tok = tiny64
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=40))
    good = [engine.add_request(p, GREEDY) for p in prompts_of([5, 8])]
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.add_request([7] * model.cfg.max_seq_len, GREEDY)
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
        engine.add_request([1, 10**9], GREEDY)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request([5] * 100, SamplingParams(max_tokens=400, n=8))
    assert engine.abort("no-such-request") is False      # unknown: a harmless no-op
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5], GREEDY, request_id=good[0])
    for kw, name in [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
                     (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(n=0), "n must"),
                     (dict(beam_width=2, n=3), "n must"), (dict(logprobs=21), "logprobs"),
                     (dict(beam_width=2, prompt_logprobs=1), "beam search")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kw)
    engine.step()
    engine.abort(good[1])                   # aborted mid-run: its blocks come back
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [good[0]] and len(done[0].token_ids) == 12
    assert_all_free(engine)


def test_engine_config_errors_name_the_option():
    for kw, name in [(dict(batching="dynamic"), "batching"), (dict(policy="lifo"), "policy"),
                     (dict(admission="x"), "admission"), (dict(preemption="x"), "preemption"),
                     (dict(block_size=0), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
                     (dict(num_kv_blocks=0), "num_kv_blocks")]:
        with pytest.raises(ValueError, match=name):
            EngineConfig(**kw)


def test_triton_backend_in_interpreter_matches_torch(tiny):
    """The paged Triton kernels (interpreted on the CPU) as the engine's attention backend."""
    from minillm.device import setup_triton

    setup_triton()
    model, tok = tiny
    prompts = prompts_of([9, 3, 20])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = {}
    for backend in ("sdpa", "triton"):
        engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=30, block_size=8,
                                                    attention_backend=backend))
        outs[backend] = [o.token_ids for o in run_all(engine, prompts, params)]
    assert outs["triton"] == outs["sdpa"] == alone(model, prompts, params)


def test_stop_strings_and_stream():
    import minillm

    llm = minillm.LLM("tiny", dtype="float32", num_kv_blocks=50)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    full = llm.generate("Hello there", params, use_tqdm=False)[0].text
    assert "".join(llm.stream("Hello there", params)) == full
    stop = full[3:6]
    out = llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=20,
                                                       stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.text == full[:full.index(stop)] and out.outputs[0].finish_reason == "stop"
    assert_all_free(llm.engine)


@pytest.mark.slow
def test_real_model_mixed_batch_equals_hf_greedy(real, hf_model):
    model, tok = real
    texts = ["The capital of France is", "def add(a, b):\n    return",
             "List three colours:", "In 1969, the first humans"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=64))
    outs = run_all(engine, [tok.encode(t) for t in texts], params)
    for text, out in zip(texts, outs):
        ids = torch.tensor([tok.encode(text)])
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist()
        assert out.ttft is not None and out.tpot is not None and out.tpot > 0


def test_llm_with_quantized_weights_equals_the_quantized_model_alone():
    import minillm

    llm = minillm.LLM("tiny", dtype="float32", quantization="int8", num_kv_blocks=50)
    assert type(llm.model.layers[0].attn.wq).__name__ == "Int8Linear"
    prompts = prompts_of([5, 3])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == alone(llm.model, prompts, GREEDY)
    assert_all_free(llm.engine)


def test_throughput_bench_counts_every_requested_token(tmp_path):
    """The benchmark's plumbing on the tiny model with HF as the peer (same weights): the
    engine generated exactly the output tokens of the workload, as drawn again here from the
    same seed, and computed each prompt and output token once (no preemption)."""
    from minillm.bench.throughput import run_throughput_bench, throughput_table
    from minillm.viz.bench import plot_throughput
    from minillm.workloads import make_workload

    report = run_throughput_bench("tiny", num_requests=4, dtype="float32", device="cpu",
                                  hf_batch=2, peers=("hf",), prompt_range=(4, 12),
                                  output_range=(3, 6), say=lambda msg: None, max_num_seqs=3,
                                  profile_steps=1)
    work = make_workload(minillm.load_model("tiny")[1], 4, (4, 12), (3, 6), seed=0)
    stats = report["minillm_stats"]
    assert stats["finished_requests"] == 4 and stats["preemptions"] == 0
    assert stats["generated_tokens"] == report["output_tokens"] == sum(work.output_lens)
    prompt_tokens = sum(map(len, work.prompts))
    assert report["prompt_tokens"] == prompt_tokens
    assert stats["computed_tokens"] == prompt_tokens + sum(work.output_lens) - 4
    assert stats["prefill_steps"] + stats["decode_steps"] == stats["steps"]
    assert stats["prefill_steps"] >= 1 and stats["prefill_step_seconds"] > 0
    assert [r["engine"] for r in report["results"]] == ["minillm", "hf"]
    step = report["minillm_step_profile"]           # a decode step with every seat taken
    assert step["batch"] == 3 and step["ms_by_category"]["attention"] > 0
    assert step["wall_ms_per_step"] > 0 and step["op_ms_per_step"] > 0   # different steps:
    assert step["python_ms"] == pytest.approx(     # the wall ones run unprofiled; each figure
        max(step["wall_ms_per_step"] - step["op_ms_per_step"], 0), abs=0.015)   # rounded to 0.01
    assert set(report["ratios"]) == {"minillm/hf"} and report["dtype"] == "float32"
    assert "minillm/hf" in throughput_table(report)
    assert plot_throughput(report).axes


def test_warmup_leaves_the_engine_as_it_was(tiny64):
    """A warm-up pass (what ``minillm serve`` and the throughput benchmark run first) takes no
    block, step or request, and greedy outputs afterwards equal those of each prompt alone."""
    model, tok = tiny64
    engine = LLMEngine(model, tok, EngineConfig(max_num_batched_tokens=64))
    assert engine.warmup(num_tokens=1000) > 0          # clipped to max_num_batched_tokens
    assert engine.num_steps == 0 and not engine.requests and not engine.trace
    assert_all_free(engine)
    prompts = prompts_of(LENGTHS[:4])
    got = run_all(engine, prompts, GREEDY)
    assert [o.token_ids for o in got] == alone(model, prompts, GREEDY)
    assert_all_free(engine)


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
