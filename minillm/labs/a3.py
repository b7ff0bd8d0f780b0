"""Checkers for the exercises of appendix C (inference runtimes).

- :func:`check_matmul_launches`: matmuls one decode step of a dense decoder launches, counted
  from its layers (separate or fused Q/K/V and gate/up projections, the LM head).
- :func:`check_pad_to_captured`: the captured CUDA-graph size a batch runs in, compared with
  :func:`minillm.runtime.pad_to_captured` (including the sizes it must refuse).
- :func:`check_padding_waste`: the fraction of computed rows that are padding when batches of
  the given sizes run in the captured graphs, compared with :func:`minillm.runtime.padding_waste`.
- :func:`check_parse_sse`: an OpenAI chat-completion stream (raw ``data:`` lines) folded into
  the final text and usage; cases include lines captured from ``python -m minillm serve``.
- :func:`check_slo_attainment`: the share of one run's requests meeting both SLOs and those
  requests per second, compared with :func:`minillm.serving_metrics.slo_attainment`.
- :func:`check_poisson_arrivals`: seeded Poisson arrival times, checked by their statistics
  (mean gap 1/rate, exponential spread, first arrival at 0, seeded).
"""
from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Callable, Sequence

from ..runtime import pad_to_captured, padding_waste
from ..serving_metrics import SLO, slo_attainment
from .common import Result, check

# --- matmul launches per decode step --------------------------------------------------------


def _matmul_launches(num_layers: int, fused_qkv: bool, fused_gate_up: bool) -> int:
    """The checker's reference: per layer the attention projections (Q, K, V, O, or QKV and
    O when fused) and the MLP's (gate, up, down, or gate_up and down), plus the LM head."""
    return num_layers * ((2 if fused_qkv else 4) + (2 if fused_gate_up else 3)) + 1


def check_matmul_launches(fn: Callable) -> Result:
    """``fn(num_layers, fused_qkv, fused_gate_up)`` -> matmul launches of one batch-1 decode
    step of a dense Llama-style decoder (embedding lookup and attention itself not counted)."""
    cases = [(n, q, g) for n in (1, 2, 30, 32) for q in (False, True) for g in (False, True)]

    def attempt() -> None:
        for n, q, g in cases:
            want, got = _matmul_launches(n, q, g), fn(n, q, g)
            assert got == want, (f"num_layers={n}, fused_qkv={q}, fused_gate_up={g}: expected "
                                 f"{want} matmuls, got {got}")

    return check("matmul_launches", attempt)


# --- CUDA graphs: padding to a captured size ------------------------------------------------


def _pad_cases():
    rng = random.Random(3)
    cases = [(1, [1, 2, 4, 8]), (3, [1, 2, 4, 8]), (8, [1, 2, 4, 8]), (5, [8, 4, 2, 1]),
             (9, [1, 2, 4, 8]), (0, [1, 2]), (7, [16]), (16, [16, 8, 24])]
    for _ in range(80):
        sizes = rng.sample(range(1, 65), rng.randint(1, 6))
        cases.append((rng.randint(1, 70), sizes))
    return cases


def _outcome(fn: Callable, *args):
    try:
        return fn(*args)
    except ValueError:
        return ValueError


def _show(x) -> str:
    return "ValueError" if x is ValueError else repr(x)


def check_pad_to_captured(fn: Callable) -> Result:
    """``fn(n, sizes)`` -> the smallest captured size in ``sizes`` (any order) that holds a
    batch of ``n``; ValueError when none does or ``n`` < 1. Compared with the package on
    seeded cases."""
    cases = _pad_cases()

    def attempt() -> None:
        for n, sizes in cases:
            want = _outcome(pad_to_captured, n, list(sizes))
            got = _outcome(fn, n, list(sizes))
            assert got == want, (f"n={n}, sizes={sizes}: expected {_show(want)}, "
                                 f"got {_show(got)}")

    return check("pad_to_captured", attempt)


def check_padding_waste(fn: Callable) -> Result:
    """``fn(batch_sizes, sizes)`` -> the fraction of the rows the graphs compute that are
    padding (thrown away), over all the decode steps whose batch sizes are given."""
    rng = random.Random(11)
    cases = [([1, 3, 5], [1, 2, 4, 8]), ([8, 8], [1, 2, 4, 8]), ([1], [1]), ([5, 6, 7], [8]),
             ([9, 17, 33], [1, 2, 4, 8, 16, 24, 32, 40])]
    for _ in range(40):
        sizes = sorted(rng.sample(range(1, 49), rng.randint(1, 6)))
        cases.append(([rng.randint(1, max(sizes)) for _ in range(rng.randint(1, 12))], sizes))

    def attempt() -> None:
        for batches, sizes in cases:
            want, got = padding_waste(batches, sizes), fn(list(batches), list(sizes))
            assert isinstance(got, (int, float)) and math.isclose(got, want, abs_tol=1e-9), (
                f"batch_sizes={batches}, sizes={sizes}: expected {want:.4f}, got {got}")

    return check("padding_waste", attempt)


# --- a streamed chat completion -------------------------------------------------------------

#: ``data:`` lines of one streamed chat completion captured from ``python -m minillm serve``
#: (stream_options include_usage; the server's role chunk, content chunks, the finish chunk,
#: the usage-only chunk and [DONE], blank separator lines kept) for "Say hi.", max_tokens=6.
CAPTURED_CHAT_STREAM: tuple[str, ...] = (
    ('data: {"id": "chatcmpl-b5f12ed7f7a842da9ef39a137ca6d1d4", "object": "chat.comple'
     'tion.chunk", "created": 1796166145, "model": "smollm2-135m", "choices": [{"index'
     '": 0, "delta": {"role": "assistant", "content": "Hello"}, "logprobs": null, "fin'
     'ish_reason": null}], "usage": null}'),
    '',
    ('data: {"id": "chatcmpl-b5f12ed7f7a842da9ef39a137ca6d1d4", "object": "chat.comple'
     'tion.chunk", "created": 1796166145, "model": "smollm2-135m", "choices": [{"index'
     '": 0, "delta": {"content": " there"}, "logprobs": null, "finish_reason": null}],'
     ' "usage": null}'),
    '',
    ('data: {"id": "chatcmpl-b5f12ed7f7a842da9ef39a137ca6d1d4", "object": "chat.comple'
     'tion.chunk", "created": 1796166145, "model": "smollm2-135m", "choices": [{"index'
     '": 0, "delta": {"content": "!"}, "logprobs": null, "finish_reason": null}], "usa'
     'ge": null}'),
    '',
    ('data: {"id": "chatcmpl-b5f12ed7f7a842da9ef39a137ca6d1d4", "object": "chat.comple'
     'tion.chunk", "created": 1796166145, "model": "smollm2-135m", "choices": [{"index'
     '": 0, "delta": {"content": " I"}, "logprobs": null, "finish_reason": null}], "us'
     'age": null}'),
    '',
    ('data: {"id": "chatcmpl-b5f12ed7f7a842da9ef39a137ca6d1d4", "object": "chat.comple'
     'tion.chunk", "created": 1796166145, "model": "smollm2-135m", "choices": [{"index'
     '": 0, "delta": {"content": "\'m"}, "logprobs": null, "finish_reason": null}], "us'
     'age": null}'),
    '',
    ('data: {"id": "chatcmpl-b5f12ed7f7a842da9ef39a137ca6d1d4", "object": "chat.comple'
     'tion.chunk", "created": 1796166145, "model": "smollm2-135m", "choices": [{"index'
     '": 0, "delta": {"content": " here"}, "logprobs": null, "finish_reason": "length"'
     '}], "usage": null}'),
    '',
    ('data: {"id": "chatcmpl-b5f12ed7f7a842da9ef39a137ca6d1d4", "object": "chat.comple'
     'tion.chunk", "created": 1796166145, "model": "smollm2-135m", "choices": [], "usa'
     'ge": {"prompt_tokens": 33, "completion_tokens": 6, "total_tokens": 39}}'),
    '',
    'data: [DONE]',
    '',
)


def _chunk(content=None, role=None, finish=None, usage=None, choices=True, index=0,
           null_usage=False) -> str:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    body = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0,
            "model": "m", "choices": ([{"index": index, "delta": delta, "finish_reason": finish}]
                                      if choices else [])}
    if usage is not None or null_usage:
        body["usage"] = usage
    return "data: " + json.dumps(body)


def _parse_sse(lines: Sequence[str]) -> tuple[str, dict | None]:
    """The checker's reference: the concatenated ``delta.content`` of choice 0 and the last
    ``usage`` seen; blank lines, comments, other fields and what follows ``[DONE]`` ignored."""
    text, usage = [], None
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        if not data:
            continue
        event = json.loads(data)
        for choice in event.get("choices") or []:
            if choice.get("index", 0) == 0:
                text.append((choice.get("delta") or {}).get("content") or "")
        if event.get("usage"):
            usage = event["usage"]
    return "".join(text), usage


def _sse_cases():
    u = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    cases = [
        [_chunk(role="assistant", content=""), _chunk("Hel"), _chunk("lo"),
         _chunk("", finish="stop"), "data: [DONE]"],
        [_chunk(role="assistant"), "", _chunk("a"), ": ping", _chunk(" b"), "",
         _chunk(finish="length"), _chunk(choices=False, usage=u), "data: [DONE]"],
        [_chunk("x"), "data: [DONE]", _chunk("after done")],
        [_chunk("data: [DONE] is text"), _chunk("!"), "data:[DONE]"],
        ["data: [DONE]"],
        [_chunk("é✓"), _chunk(" \n"), _chunk(choices=False, usage=u)],
        # n = 2: choice 1's text is not choice 0's
        [_chunk("A", role="assistant"), _chunk("x", index=1), _chunk("B"), _chunk("y", index=1),
         _chunk(finish="stop"), _chunk(finish="stop", index=1), "data: [DONE]"],
        # a chunk after the usage chunk with "usage": null keeps the usage
        [_chunk("hi"), _chunk(choices=False, usage=u), _chunk(finish="stop", null_usage=True),
         "data: [DONE]"],
    ]
    if CAPTURED_CHAT_STREAM:
        cases.insert(0, list(CAPTURED_CHAT_STREAM))
    return cases


def check_parse_sse(fn: Callable) -> Result:
    """``fn(lines)`` -> ``(text, usage)``: the assistant's text (every ``delta.content`` of
    choice 0, in order) and the ``usage`` dict of the stream (None if it has none), from the
    raw lines of a ``/v1/chat/completions`` stream. Lines not starting with ``data:`` are
    ignored; ``data: [DONE]`` ends the stream."""
    cases = _sse_cases()

    def attempt() -> None:
        for lines in cases:
            want, got = _parse_sse(lines), fn(list(lines))
            assert tuple(got) == want, (f"lines={[ln[:90] for ln in lines]}: expected "
                                        f"{want}, got {tuple(got)}")

    return check("parse_sse", attempt)


# --- SLO attainment -------------------------------------------------------------


def check_slo_attainment(fn: Callable) -> Result:
    """``fn(ttft, tpot, slo, duration_s)`` -> ``(attainment, slo_met_per_s)``: the fraction of
    requests whose TTFT <= ``slo.ttft_s`` and TPOT <= ``slo.tpot_s`` (a
    :class:`~minillm.serving_metrics.SLO`), and how many such requests per second of the
    run. Compared with :func:`minillm.serving_metrics.slo_attainment` on seeded runs and on
    requests exactly at the limits."""
    rng = random.Random(7)
    slo = SLO(2.0, 0.2)
    cases = [([2.0, 1.0, 3.0], [0.2, 0.25, 0.1], slo, 10.0),
             ([0.5, 2.5], [0.1, 0.1], slo, 4.0), ([1.0], [0.0], slo, 1.0)]
    for _ in range(40):
        n = rng.randint(1, 30)
        s = SLO(rng.choice([0.5, 1.0, 2.0]), rng.choice([0.05, 0.1, 0.2]))
        cases.append(([rng.uniform(0, 3 * s.ttft_s) for _ in range(n)],
                      [rng.uniform(0, 2 * s.tpot_s) for _ in range(n)], s,
                      rng.uniform(5, 60)))

    def attempt() -> None:
        for ttft, tpot, s, dur in cases:
            want = slo_attainment(zip(ttft, tpot), s, len(ttft), dur)
            got = fn(list(ttft), list(tpot), s, dur)
            what = (f"ttft={[round(x, 3) for x in ttft[:6]]}..., "
                    f"tpot={[round(x, 3) for x in tpot[:6]]}..., {s}, duration_s={dur:.2f}")
            assert len(got) == 2 and all(math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12)
                                         for g, w in zip(got, want)), (
                f"{what}: expected (attainment, slo_met_per_s) = {want}, got {tuple(got)}")

    return check("slo_attainment", attempt)


# --- Poisson arrivals -----------------------------------------------------------------------


def check_poisson_arrivals(fn: Callable) -> Result:
    """``fn(num_requests, rate, seed)`` -> arrival times (s) of a Poisson process of ``rate``
    requests/s: the first at 0, then exponential gaps of mean 1/``rate``; the same seed gives
    the same times. Checked by statistics over many arrivals: the mean gap, the coefficient of
    variation (1 for exponential gaps) and the fraction of gaps below the median ln 2 / rate."""
    def attempt() -> None:
        for rate in (0.5, 4.0):
            times = list(fn(20000, rate, 1))
            assert len(times) == 20000, f"rate={rate}: expected 20000 times, got {len(times)}"
            assert times[0] == 0, f"rate={rate}: the first request arrives at 0, got {times[0]}"
            gaps = [b - a for a, b in zip(times, times[1:])]
            assert min(gaps) >= 0, f"rate={rate}: arrival times must not decrease"
            mean = statistics.fmean(gaps)
            assert abs(mean * rate - 1) < 0.04, (
                f"rate={rate}: the mean gap should be 1/rate = {1 / rate:.3f} s, got "
                f"{mean:.3f} s")
            cv = statistics.pstdev(gaps) / mean
            assert abs(cv - 1) < 0.05, (
                f"rate={rate}: exponential gaps have std/mean = 1, got {cv:.3f} (uniform gaps "
                f"give about 0.58, constant gaps 0)")
            below = sum(g < math.log(2) / rate for g in gaps) / len(gaps)
            assert abs(below - 0.5) < 0.02, (
                f"rate={rate}: half the gaps should be below ln2/rate, got {below:.3f}")
        a, b, c = fn(50, 2.0, 5), fn(50, 2.0, 5), fn(50, 2.0, 6)
        assert list(a) == list(b), "the same seed must give the same arrival times"
        assert list(a) != list(c), "different seeds should give different arrival times"

    return check("poisson_arrivals", attempt)


__all__ = ["CAPTURED_CHAT_STREAM", "check_matmul_launches", "check_pad_to_captured",
           "check_padding_waste", "check_parse_sse", "check_poisson_arrivals",
           "check_slo_attainment"]
