"""Appendix A3 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import json
import random
import threading

import httpx
import pytest
import torch
import torch.nn.functional as F
from lab_checks import checker_tests

from minillm.cache import Cache
from minillm.labs import a3
from minillm.labs.in_engine import demo_model
from minillm.labs.solutions.a3 import (
    StaticCache,
    matmul_launches,
    pad_to_captured,
    padding_waste,
    parse_sse,
    poisson_arrivals,
    slo_attainment,
    static_decode_step,
    token_mask,
)
from minillm.runtime import padding_waste as package_waste
from minillm.workloads import poisson_arrivals as package_arrivals

# --- plausible mistakes ----------------------------------------------------------------------


def launches_without_lm_head(num_layers, fused_qkv, fused_gate_up):
    return matmul_launches(num_layers, fused_qkv, fused_gate_up) - 1


def first_fit_unsorted(n, sizes):
    """The first size that fits in the given order, not the smallest."""
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(n)


def waste_first_fit_unsorted(batch_sizes, sizes):
    """Each batch in the first captured size that fits, in the given order, not the smallest."""
    run = sum(first_fit_unsorted(b, sizes) for b in batch_sizes)
    return (run - sum(batch_sizes)) / run


def waste_over_real_rows(batch_sizes, sizes):
    """Padding divided by the real rows, not by the rows computed."""
    return sum(pad_to_captured(b, sizes) - b for b in batch_sizes) / sum(batch_sizes)


def mask_first_char_only(dfa, state, texts, eos_id):
    """Allows a token when its first character is allowed: "2024-" passes after 3 digits."""
    mask = torch.tensor([bool(t) and dfa.step(state, t[0]) is not None for t in texts])
    mask[eos_id] = state in dfa.accepting
    return mask


def mask_allows_empty_tokens(dfa, state, texts, eos_id):
    """An empty text walks nowhere and so "never falls off": control tokens slip through."""
    mask = torch.tensor([dfa.walk(state, t) is not None for t in texts])
    mask[eos_id] = state in dfa.accepting
    return mask


def mask_eos_never(dfa, state, texts, eos_id):
    """Never allows EOS: a finished pattern has nothing left to allow."""
    mask = token_mask(dfa, state, texts, eos_id)
    mask[eos_id] = False
    return mask


def mask_eos_anywhere(dfa, state, texts, eos_id):
    """EOS always allowed: the output may stop half-way through the pattern."""
    mask = token_mask(dfa, state, texts, eos_id)
    mask[eos_id] = True
    return mask


class ConcatCache(Cache):
    """Attends over the written slots and the new token joined with torch.cat, and stores the
    joined keys back as a new tensor of the same shape: the right tokens, but not in place."""

    def __init__(self, k_cache, v_cache, position):
        self.k, self.v, self.p = k_cache, v_cache, int(position)

    def attend(self, layer, q, k, v, attn_fn=None):
        group = q.shape[1] // k.shape[1]
        out = []
        for bufs, new in ((self.k, k), (self.v, v)):
            seen = torch.cat([bufs[layer][:, :, :self.p], new], dim=2)
            bufs[layer] = torch.cat([seen, bufs[layer][:, :, self.p + 1:]], dim=2)
            out.append(seen.repeat_interleave(group, dim=1))
        return F.scaled_dot_product_attention(q, *out)


class OneAheadCache(StaticCache):
    """Takes ``position`` for the count of tokens before the new one plus one: writes and
    attends one slot further on (slot 0 is never written, but attended)."""

    def __init__(self, k_cache, v_cache, position):
        super().__init__(k_cache, v_cache, position + 1)


class UnmaskedCache(StaticCache):
    """Writes in place but attends over every slot, the unwritten ones (zeros) included."""

    def attend(self, layer, q, k, v, attn_fn=None):
        super().attend(layer, q, k, v)
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            q, self.k[layer].repeat_interleave(group, dim=1),
            self.v[layer].repeat_interleave(group, dim=1))


def step_with(cache_cls):
    def step(model, tokens, position, k_cache, v_cache):
        logits = model(tokens[:, None], cache=cache_cls(k_cache, v_cache, position),
                       positions=position.reshape(1), last_only=True)
        return logits[:, -1]

    step.__name__ = f"step_with_{cache_cls.__name__}"
    return step


def parse_sse_text_after_done(lines):
    """Forgets that [DONE] ends the stream (and stops only on parse errors)."""
    return parse_sse([ln for ln in lines if ln.strip() != "data: [DONE]"])


def parse_sse_no_usage_chunk(lines):
    """Reads usage only from chunks that also carry choices."""
    text, usage = "", None
    for line in lines:
        data = line[5:].strip() if line.startswith("data:") else ""
        if data == "[DONE]":
            break
        if data:
            event = json.loads(data)
            if event["choices"]:
                text += event["choices"][0]["delta"].get("content") or ""
                usage = event.get("usage") or usage
    return text, usage


def parse_sse_every_choice(lines):
    """Joins the text of every choice, not only choice 0's (wrong once n > 1)."""
    text, usage = "", None
    for line in lines:
        data = line[5:].strip() if line.startswith("data:") else ""
        if data == "[DONE]":
            break
        if data:
            event = json.loads(data)
            text += "".join(c["delta"].get("content") or "" for c in event["choices"])
            usage = event.get("usage") or usage
    return text, usage


def parse_sse_later_null_usage_wipes(lines):
    """Takes the usage field of every chunk that has one, null included."""
    text, usage = "", None
    for line in lines:
        data = line[5:].strip() if line.startswith("data:") else ""
        if data == "[DONE]":
            break
        if data:
            event = json.loads(data)
            text += "".join(c["delta"].get("content") or "" for c in event["choices"]
                            if c["index"] == 0)
            usage = event["usage"] if "usage" in event else usage
    return text, usage


def attainment_either_slo(ttft, tpot, slo, duration_s):
    met = sum(a <= slo.ttft_s or b <= slo.tpot_s for a, b in zip(ttft, tpot))
    return met / len(ttft), met / duration_s


def attainment_strict(ttft, tpot, slo, duration_s):
    """A request exactly at the limit counted as a miss."""
    met = sum(a < slo.ttft_s and b < slo.tpot_s for a, b in zip(ttft, tpot))
    return met / len(ttft), met / duration_s


def uniform_gaps(num_requests, rate, seed):
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.uniform(0, 2 / rate)
    return out


def rate_as_mean_gap(num_requests, rate, seed):
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(1 / rate)
    return out


CHECKS = [(a3.check_matmul_launches, matmul_launches, launches_without_lm_head),
          (a3.check_padding_waste, padding_waste, waste_first_fit_unsorted),
          (a3.check_padding_waste, padding_waste, waste_over_real_rows),
          (a3.check_static_decode_step, static_decode_step, step_with(ConcatCache)),
          (a3.check_static_decode_step, static_decode_step, step_with(OneAheadCache)),
          (a3.check_static_decode_step, static_decode_step, step_with(UnmaskedCache)),
          (a3.check_parse_sse, parse_sse, parse_sse_text_after_done),
          (a3.check_parse_sse, parse_sse, parse_sse_no_usage_chunk),
          (a3.check_parse_sse, parse_sse, parse_sse_every_choice),
          (a3.check_parse_sse, parse_sse, parse_sse_later_null_usage_wipes),
          (a3.check_parse_sse_on_server, parse_sse, parse_sse_every_choice),
          (a3.check_parse_sse_on_server, parse_sse, parse_sse_no_usage_chunk),
          (a3.check_parse_sse_on_server, parse_sse, parse_sse_later_null_usage_wipes),
          (a3.check_slo_attainment, slo_attainment, attainment_either_slo),
          (a3.check_slo_attainment, slo_attainment, attainment_strict),
          (a3.check_poisson_arrivals, poisson_arrivals, uniform_gaps),
          (a3.check_poisson_arrivals, poisson_arrivals, rate_as_mean_gap),
          (a3.check_token_mask_in_engine, token_mask, mask_first_char_only),
          (a3.check_token_mask_in_engine, token_mask, mask_allows_empty_tokens),
          (a3.check_token_mask_in_engine, token_mask, mask_eos_never),
          (a3.check_token_mask_in_engine, token_mask, mask_eos_anywhere)]
test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = checker_tests(
    CHECKS, ids=["launches-no-lm-head", "waste-first-fit", "waste-over-real",
                 "static-concat", "static-one-ahead", "static-unmasked",
                 "sse-after-done", "sse-usage-chunk", "sse-every-choice", "sse-null-usage-wipes",
                 "server-every-choice", "server-usage-chunk", "server-null-usage-wipes",
                 "attainment-or", "attainment-strict",
                 "poisson-uniform", "poisson-rate-as-gap", "mask-first-char", "mask-empty",
                 "mask-eos-never", "mask-eos-anywhere"])


def test_package_versions_pass_their_checkers():
    assert a3.check_poisson_arrivals(package_arrivals).passed is True
    assert a3.check_padding_waste(package_waste).passed is True


# --- what catches each mistake ------------------------------------------------------------------


def test_a_step_that_replaces_its_buffers_gives_the_right_tokens():
    """Only the buffers' addresses tell the concatenating step from an in-place one."""
    model = demo_model()
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]

    @torch.inference_mode()
    def run(step):
        tokens, position, k, v = a3.static_inputs(model, 2, 12)
        return a3.greedy_static(lambda: step(model, tokens, position, k, v), tokens, position,
                                prompts, 6)

    assert run(step_with(ConcatCache)) == run(static_decode_step)
    result = a3.check_static_decode_step(step_with(ConcatCache), model, prompts, 6, 12)
    assert result.passed is False and "in place" in result.message


@pytest.mark.parametrize("cache_cls", [OneAheadCache, UnmaskedCache])
def test_a_misplaced_or_unmasked_step_changes_the_tokens(cache_cls):
    result = a3.check_static_decode_step(step_with(cache_cls))
    assert result.passed is False and "token" in result.message, result.message


def test_static_step_needs_prompts_of_one_length():
    with pytest.raises(ValueError, match="same length"):
        a3.check_static_decode_step(static_decode_step, prompts=[[1, 2], [3]])


@pytest.mark.parametrize("wrong", [parse_sse_every_choice, parse_sse_no_usage_chunk])
def test_the_live_server_catches_the_parser(wrong):
    """These mistakes show on the server's own streams (before the corner cases run)."""
    result = a3.check_parse_sse_on_server(wrong)
    assert result.passed is False and "stream of http://127.0.0.1" in result.message


def test_the_server_is_stopped_after_the_check():
    with a3.serving(demo_model(), a3.smollm2_tokenizer()) as base:
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    assert not any(t.name == "minillm-labs-serve" for t in threading.enumerate())
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/health", timeout=2)


def test_captured_stream_is_a_real_server_stream():
    text, usage = a3._parse_sse(a3.CAPTURED_CHAT_STREAM)
    assert text and usage["completion_tokens"] > 0
    assert [ln for ln in a3.CAPTURED_CHAT_STREAM if ln][-1] == "data: [DONE]"
    assert any('"choices": []' in ln for ln in a3.CAPTURED_CHAT_STREAM)   # the usage-only chunk


def test_checker_references_agree_with_the_keys():
    rng = random.Random(2)
    for _ in range(100):
        sizes = sorted(rng.sample(range(1, 40), rng.randint(1, 5)))
        batches = [rng.randint(1, max(sizes)) for _ in range(rng.randint(1, 8))]
        assert abs(package_waste(batches, sizes) - padding_waste(batches, sizes)) < 1e-12
    for lines in a3._sse_cases():
        assert a3._parse_sse(lines) == parse_sse(lines)


# --- the chapter's data and plots ----------------------------------------------------------------


def test_comparison_table_and_plots():
    import matplotlib

    matplotlib.use("Agg")
    from minillm.course import a3_runtimes as course
    from minillm.viz import a3 as v

    table = course.comparison_markdown()
    assert table.count("\n") == len(course.SYSTEMS) + 1
    assert all(name in table for name in course.SYSTEMS)
    assert all(src.startswith("https://") for s in course.SYSTEMS.values() for src in s["sources"])
    fig = v.plot_categories({"matmul": 2.0, "attention": 0.5, "other": 0.1})
    assert len(fig.axes) == 1
    report = {"results": [{"config": "fp32", "decode_tok_s": 10.0, "step_ms": 100.0},
                          {"config": "fp32+compile", "decode_tok_s": 20.0, "step_ms": 50.0}],
              "batch_sweep": [{"config": "fp32", "batch": b, "step_ms": 10.0 * b}
                              for b in (1, 4)]}
    assert len(v.plot_runtime(report).axes) == 2
    serve = {"slo": {"ttft_s": 2.0, "tpot_s": 0.2},
             "workload": {"num_requests": 2}, "machine": {"device": "cpu", "threads": 2},
             "servers": {"a": {"runs": [
                 {"rate": r, "ttft_p50": 0.1, "ttft_p99": 0.2, "tpot_p50": 0.05,
                  "tpot_p99": 0.06, "output_tok_s": 10 * r, "attainment": 1.0}
                 for r in (1.0, 2.0)]}, "vllm": {"skipped": "not installed"}}}
    assert len(v.plot_serving(serve).axes) == 4
