"""``kv_cache_dtype``: the engine storing K/V as bfloat16 or int8 below a float32 model.

Reference: the model's own forward through a contiguous :class:`QuantizedKVCache` of the same
format (one pass over prompt + reply: it reads every key back from storage, as each decode step
of the engine does), in float32. The engine's per-token logprobs must equal it, and must differ
from the plain float32 forward (the storage is visible, so the comparison can fail). The pool's
data moves (swap, copy-on-write, slot copies, connector staging) carry the int8 scales along."""
from __future__ import annotations

import copy

import pytest
import torch
from engine_checks import run_all

import minillm
from minillm.attention.kv_quant import kv_bytes_per_token, resolve_kv_dtype
from minillm.cache import KVCache, QuantizedKVCache
from minillm.cache.pool import PagedKVPool
from minillm.engine import EngineConfig, LLMEngine, cpu_forward
from minillm.sampling import SamplingParams

PROMPTS = ["Explain what a KV cache is in two sentences.",
           "List three uses of a hash table.", "Why is the sky blue?"]


def reference_logprobs(model, ids: list[int], n_prompt: int, cache) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for the reply's tokens t >= n_prompt, float64, one forward."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), cache=cache)[0].double()
    logp = logits.log_softmax(-1)
    t = torch.arange(n_prompt, len(ids))
    return logp[t - 1, torch.tensor(ids)[t]]


@pytest.fixture(scope="module")
def chats(real):
    tok = real[1]
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            for p in PROMPTS]


@pytest.fixture(scope="module")
def model64(real):
    """The real model in float64: far from every int8 rounding boundary that a float32
    difference of summation order could cross (in float32, one crossing in an early layer
    changes a value by a whole quantization step and the runs drift apart)."""
    return copy.deepcopy(real[0]).to(torch.float64)


@pytest.mark.parametrize("kv", ["int8", "bfloat16"])
def test_logprobs_equal_the_model_through_a_cache_of_that_format(model64, real, chats, kv):
    tok = real[1]
    engine = LLMEngine(model64, tok, EngineConfig(kv_cache_dtype=kv, attention_backend="sdpa",
                                                  num_kv_blocks=64, max_num_seqs=2))
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1)
    stored_gap = 0.0
    for out in run_all(engine, chats[:2], params):
        reply = out.outputs[0]
        ids = out.prompt_token_ids + reply.token_ids
        n = len(out.prompt_token_ids)
        got = torch.tensor([lp[t] for lp, t in zip(reply.logprobs, reply.token_ids)],
                           dtype=torch.float64)
        ref = reference_logprobs(model64, ids, n, QuantizedKVCache(
            model64.cfg, 1, len(ids), dtype=torch.float64, kv_dtype=kv))
        plain = reference_logprobs(model64, ids, n, KVCache(model64.cfg, 1, len(ids),
                                                            dtype=torch.float64))
        torch.testing.assert_close(got, ref, atol=5e-5, rtol=0)   # logprobs are float32
        stored_gap = max(stored_gap, (ref - plain).abs().max().item())
    assert stored_gap > 1e-3, stored_gap                    # the format changes the numbers


@pytest.mark.parametrize("kv", ["int8", "bfloat16"])
def test_the_cpu_fast_path_stores_what_the_eager_path_stores(real, kv, monkeypatch):
    """One prompt step through the C++ forward and through the eager model: the same stored
    keys and values in the first layers (an int8 value may sit one level off where float32
    rounding differs between the two paths) and the same scales."""
    model, tok = real
    ids = tok.encode("Why is the sky blue? Tell me in a few words, please.")
    pools, fused_steps = {}, []
    forward = cpu_forward.CpuForward.__call__
    monkeypatch.setattr(cpu_forward.CpuForward, "__call__",
                        lambda *a, **k: fused_steps.append(1) or forward(*a, **k))
    for fuse in (True, False):
        engine = LLMEngine(model, tok, EngineConfig(kv_cache_dtype=kv, attention_backend="cpu",
                                                    num_kv_blocks=8, fuse_ops=fuse))
        engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1))
        engine.step()
        pools[fuse] = engine.runner.pool
    assert fused_steps == [1]
    fused, eager = pools[True], pools[False]
    for layer in (0, 1):
        for a, b in ((fused.k, eager.k), (fused.v, eager.v)):
            diff = (a[layer].float() - b[layer].float()).abs()
            if kv == "int8":
                assert diff.max() <= 1 and (diff > 0).sum() <= 8, (layer, (diff > 0).sum())
            else:
                assert (diff > 0).float().mean() < 0.01, layer
        if kv == "int8":
            torch.testing.assert_close(fused.k_scale[layer], eager.k_scale[layer], rtol=1e-4,
                                       atol=0)


def test_int8_scales_move_with_their_blocks(real):
    """Swap out and in, copy-on-write, slot copies and the connector's staging tensor keep
    every block's int8 values and scales together."""
    cfg = real[0].cfg
    pool = PagedKVPool(cfg, 6, 4, torch.device("cpu"), torch.float32, num_cpu_blocks=3,
                       kv_dtype=torch.int8)
    x = torch.randn(2, cfg.n_layers, 6 * 4, cfg.n_kv_heads, cfg.head_dim)
    pool.write_blocks(torch.arange(6), x)
    want = pool.gather(list(range(6)))
    torch.testing.assert_close(want, x, atol=x.abs().max().item() / 127, rtol=0)

    def block(b: int) -> torch.Tensor:
        return pool.gather([b])

    before = [block(b) for b in range(6)]
    pool.swap_out([(1, 0), (2, 2)])
    pool.k.zero_(), pool.v.zero_(), pool.k_scale.zero_(), pool.v_scale.zero_()
    pool.swap_in([(0, 4), (2, 5)])
    assert torch.equal(block(4), before[1]) and torch.equal(block(5), before[2])
    pool.copy_blocks([(4, 0)])
    assert torch.equal(block(0), before[1])
    pool.copy_slots([4 * 4 + 3], [1 * 4 + 0])                # block 4 slot 3 -> block 1 slot 0
    assert torch.equal(block(1)[:, :, 0], before[1][:, :, 3])
    again = PagedKVPool(cfg, 6, 4, torch.device("cpu"), torch.float32, kv_dtype=torch.int8)
    again.write_blocks(torch.tensor([3]), block(4))
    assert torch.equal(again.gather([3]), block(4))          # re-quantizing is lossless


def test_bytes_and_blocks():
    cfg = minillm.config.PRESETS["smollm2-135m"]
    per = {dt: kv_bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dt)
           for dt in (torch.float32, torch.bfloat16, torch.int8)}
    assert per[torch.float32] == 2 * 30 * 3 * 64 * 4
    assert per[torch.bfloat16] * 2 == per[torch.float32]
    assert per[torch.int8] == 2 * 30 * 3 * (64 + 4)


def test_a_pool_of_the_same_memory_holds_more_int8_blocks(tiny):
    model = tiny[0]
    blocks = {kv: LLMEngine(model, None, EngineConfig(kv_cache_dtype=kv,
                                                      kv_cache_memory=1 << 22)).blocks.num_blocks
              for kv in ("auto", "bfloat16", "int8")}
    d = model.cfg.head_dim
    assert blocks["bfloat16"] in (2 * blocks["auto"], 2 * blocks["auto"] + 1)
    assert abs(blocks["int8"] / blocks["auto"] - 4 * d / (d + 4)) < 0.05


def test_swapped_requests_resume_with_their_int8_blocks(real, chats):
    """A pool too small for every request preempts by swapping: the replies equal those of a
    pool large enough (swap moved the scales too)."""
    model, tok = real
    params = SamplingParams(temperature=0.0, max_tokens=40)
    outs = {}
    for blocks in (64, 12):
        engine = LLMEngine(model, tok, EngineConfig(kv_cache_dtype="int8", num_kv_blocks=blocks,
                                                    preemption="swap", swap_space=0.05))
        done = run_all(engine, chats, params)
        outs[blocks] = [o.outputs[0].token_ids for o in done]
        if blocks == 12:
            assert sum(o.metrics.num_preemptions for o in done) > 0
    assert outs[12] == outs[64]


@pytest.mark.parametrize("options,match", [
    ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype must be one of"),
    ({"kv_cache_dtype": "float16"}, "kv_cache_dtype must be one of"),
    ({"kv_cache_dtype": "int8", "attention_backend": "triton"}, "kv_cache_dtype 'int8'"),
])
def test_bad_options_name_kv_cache_dtype(tiny, options, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(tiny[0], None, EngineConfig(num_kv_blocks=8, **options))


def test_a_wider_cache_than_the_model_is_refused(tiny):
    model = tiny[0].to(torch.bfloat16)
    try:
        with pytest.raises(ValueError, match="kv_cache_dtype 'float32' is wider"):
            LLMEngine(model, None, EngineConfig(num_kv_blocks=8, kv_cache_dtype="float32"))
    finally:
        tiny[0].to(torch.float32)
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16


def test_the_default_backend_reads_the_format():
    """On CUDA the default (triton) does not read a narrower cache: sdpa is picked instead."""
    from minillm.attention.paged import default_paged_backend
    cuda = torch.device("cuda")
    assert default_paged_backend(cuda, torch.bfloat16) == "triton"
    assert default_paged_backend(cuda, torch.bfloat16, torch.int8) == "sdpa"
    assert default_paged_backend(cuda, torch.bfloat16, torch.bfloat16) == "triton"
