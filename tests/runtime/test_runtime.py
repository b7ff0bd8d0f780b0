"""Appendix A3 runtimes: the static KV cache and StaticDecoder against the plain generate loop
(eager, compiled; CUDA graphs on a GPU), the decode profile, and bench runtime."""
import json

import pytest
import torch

import minillm
from minillm.bench.runtime import parse_config, run_runtime_bench, runtime_table
from minillm.cache import KVCache
from minillm.cache.static import StaticKVCache
from minillm.generate import generate
from minillm.runtime import (
    StaticDecoder,
    capture_sizes,
    categorize,
    pad_to_captured,
    profile_decode,
    profile_engine_steps,
)

GREEDY = minillm.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, _ = minillm.load_model("tiny", dtype="float32")
    return model


def prompts(model, lengths=(5, 9, 3)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]


def test_static_cache_attention_equals_the_contiguous_cache(tiny):
    ids = torch.tensor([prompts(tiny)[1]])
    with torch.inference_mode():
        ref = tiny(ids, cache=KVCache(tiny.cfg, 1, 32))
        static = StaticKVCache(tiny.cfg, 2, 32)
        pos = torch.arange(ids.shape[1])[None]
        static.set_step(slice(1, 2), pos)
        out = tiny(ids, cache=static, positions=pos)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert static.k[0][0].abs().sum() == 0  # row 0 untouched


def test_greedy_and_seeded_sampling_equal_generate(tiny):
    p = prompts(tiny)[0]
    dec = StaticDecoder(tiny, max_len=64)
    assert dec.generate(p, GREEDY) == generate(tiny, p, GREEDY)
    sampled = minillm.SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=7,
                                     ignore_eos=True)
    assert dec.generate(p, sampled) == generate(tiny, p, sampled)


def test_a_batch_of_different_lengths_equals_each_alone(tiny):
    ps = prompts(tiny)
    outs = StaticDecoder(tiny, max_len=64, max_batch=4).generate_batch(ps, GREEDY)
    assert outs == [generate(tiny, p, GREEDY) for p in ps]


def test_the_compiled_step_equals_eager(tiny):
    p = prompts(tiny)[2]
    dec = StaticDecoder(tiny, max_len=32, compile=True)
    assert dec.generate(p, GREEDY) == generate(tiny, p, GREEDY)
    assert dec.compile_seconds > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graphs_equal_eager_with_padding():
    torch.manual_seed(0)
    model, _ = minillm.load_model("tiny", device="cuda", dtype="float32")
    ps = prompts(model)
    dec = StaticDecoder(model, max_len=64, cuda_graph_sizes=[1, 2, 4])
    assert dec.padded_size(3) == 4
    assert dec.generate_batch(ps, GREEDY) == [generate(model, p, GREEDY) for p in ps]


def test_padding_and_capture_sizes():
    assert [pad_to_captured(n, [1, 2, 4, 8]) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="largest captured size 8"):
        pad_to_captured(9, [1, 2, 4, 8])
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]


def test_bad_input_names_the_parameter(tiny):
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            StaticDecoder(tiny, cuda_graph_sizes=[1])
    dec = StaticDecoder(tiny, max_len=16, max_batch=2)
    with pytest.raises(ValueError, match="max_len"):
        dec.prefill(0, list(range(20)))
    with pytest.raises(ValueError, match="row"):
        dec.prefill(2, [1, 2])
    with pytest.raises(ValueError, match="same length"):
        dec.decode([1, 2, 3], [4, 5, 6])
    with pytest.raises(ValueError, match="max_len"):
        dec.decode([1], [16])
    with pytest.raises(ValueError, match="max_len"):
        StaticKVCache(tiny.cfg, 1, tiny.cfg.max_seq_len + 1)


def test_profile_counts_every_linear_of_a_step(tiny, tmp_path):
    prof = profile_decode(tiny, prompt_len=8, steps=3)
    mm = sum(r["calls"] for r in prof.rows if r["name"] in ("aten::mm", "aten::addmm"))
    assert mm == 7 * tiny.cfg.n_layers + 1  # q k v o gate up down per layer + the head
    assert sum(prof.by_category().values()) == pytest.approx(prof.step_ms)
    assert "matmul" in prof.table()
    trace = json.loads(prof.export_trace(tmp_path / "t.json").read_text())
    assert trace["traceEvents"]


def test_engine_step_profile_sees_one_batched_attention_per_layer(tiny):
    """Three decoding sequences attended as one batch: one attention call per layer and step
    (the CPU kernel, or SDPA over one padded group where it does not build); the profile stops
    when the engine runs out of work, counting only the steps it ran."""
    from minillm.engine import EngineConfig, LLMEngine

    engine = LLMEngine(tiny, None, EngineConfig(num_kv_blocks=32, block_size=4))
    for ids in prompts(tiny):
        engine.add_request(ids, minillm.SamplingParams(temperature=0.0, max_tokens=4,
                                                       ignore_eos=True))
    engine.step()                                         # prefill all three
    prof = profile_engine_steps(engine, steps=50)
    assert prof.steps == 3 and not engine.has_unfinished()
    name = "minillm::cpu_paged_attention" if engine.runner.attention_backend == "cpu" \
        else "aten::scaled_dot_product_attention"
    attn = [r for r in prof.rows if r["name"] == name]
    assert attn and attn[0]["calls"] == tiny.cfg.n_layers
    assert attn[0]["category"] == "attention"
    with pytest.raises(ValueError, match="no request"):
        profile_engine_steps(engine)


def test_categorize():
    assert categorize("aten::mm") == "matmul"
    assert categorize("aten::_weight_int4pack_mm_for_cpu") == "matmul"
    # cuBLAS's Hopper kernel, as the H200 profile named it (benchmarks/results/runtime_gpu.json)
    assert categorize("nvjet_sm90_tst_8x64_64x16_4x1_v_bz_TNN") == "matmul"
    assert categorize("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert categorize("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert categorize("aten::rsqrt") == "norm/elementwise"
    assert categorize("aten::index_select") == "copy/index"
    assert categorize("aten::zeros_like") == "other"


def test_parse_config():
    c = parse_config("int4@bf16+compile")
    assert (c.weights, c.dtype, c.compile, c.graphs) == ("int4", torch.bfloat16, True, False)
    for bad in ("fp16", "int4+fast", "fp32@bf16", "int8@fp8"):
        with pytest.raises(ValueError, match="configs"):
            parse_config(bad)


def test_bench_runtime_on_a_preset():
    report = run_runtime_bench("tiny", ["fp32", "int8"], prompt_len=8, new_tokens=6,
                               repeats=1, batch_sizes=[1, 2], device="cpu", llama=False,
                               log=None)
    assert [r["config"] for r in report["results"]] == ["fp32", "int8"]
    assert report["results"][0]["same_tokens"] == 6
    assert {(r["config"], r["batch"]) for r in report["batch_sweep"]} == \
        {(c, b) for c in ("fp32", "int8") for b in (1, 2)}
    assert "decode tok/s" in runtime_table(report)
    fp32, int8 = report["results"]
    assert 0 < int8["bytes_per_token"] < fp32["bytes_per_token"]    # int8 weights read less
    assert 0 < fp32["roofline_fraction"] and report["read_bandwidth_gb_s"] > 0
    with pytest.raises(ValueError, match="graphs"):
        run_runtime_bench("tiny", ["fp32+graphs"], device="cpu", log=None)
