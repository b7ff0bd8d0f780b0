"""The serving benchmark: the load generator against a real ``python -m minillm serve``
subprocess (8 requests, short outputs), and its bookkeeping on hand-made streams."""
from __future__ import annotations

import asyncio
import signal

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from minillm.bench.serve import (  # noqa: E402
    RequestResult,
    free_port,
    make_load,
    note_event,
    run_load,
    run_serve_bench,
    serve_summary,
    sse_events,
)
from minillm.serving_metrics import SLO  # noqa: E402

NUM, OUT_MAX = 8, 6


@pytest.fixture(scope="module")
def report():
    return run_serve_bench(rates=(8.0,), num_requests=NUM, peers=("minillm",), prompt_median=16,
                           prompt_max=48, output_median=4, output_max=OUT_MAX,
                           say=lambda msg: None)


@pytest.mark.slow
def test_every_request_served_and_counted(report):
    run = report["servers"]["minillm"]["runs"][0]
    assert (run["completed"], run["failed"], run["errors"]) == (NUM, 0, [])
    assert run["short_outputs"] == 0
    # ignore_eos: each request got exactly its max_tokens (counted from the usage chunk)
    assert run["output_tokens"] == sum(report["workload"]["output_lens"])
    assert len(report["workload"]["prompt_lens"]) == NUM
    assert run["attainment"] * NUM == pytest.approx(round(run["attainment"] * NUM))
    assert run["slo_met_per_s"] <= run["request_s"]


@pytest.mark.slow
def test_percentiles_ordered(report):
    run = report["servers"]["minillm"]["runs"][0]
    for what in ("ttft", "tpot", "itl", "e2e"):
        assert 0 <= run[f"{what}_p50"] <= run[f"{what}_p90"] <= run[f"{what}_p99"], what
    assert run["ttft_p50"] <= run["e2e_p50"]


@pytest.mark.slow
def test_blocks_free_and_graceful_exit(report):
    srv = report["servers"]["minillm"]
    blocks = srv["runs"][0]["kv_blocks_after"]
    assert blocks["used"] == 0 and blocks["free"] > 0
    assert srv["exit_code"] in (0, -signal.SIGTERM)     # uvicorn re-raises the signal
    assert report["vllm"].startswith("skipped") or report["vllm"][0].isdigit()  # or a version


@pytest.mark.slow
def test_plot(report):
    from minillm.viz.bench import plot_serve

    assert len(plot_serve(report).axes) == 3


def test_stream_bookkeeping():
    res = RequestResult(arrival=0.0, max_tokens=3)
    for line, now in (("data: " + '{"choices": [{"text": "a"}]}', 0.5), (": ping", 0.6),
                      ("data: " + '{"choices": [{"text": ""}]}', 0.7),
                      ("data: " + '{"choices": [{"text": "b"}]}', 0.8),
                      ("data: " + '{"choices": [{"text": "cd", "finish_reason": "length"}]}',
                       1.0), ("data: [DONE]", 1.0)):
        if (event := sse_events(line)) is not None:
            note_event(res, event, now)
    res.finish = 1.0
    # "cd" may be two tokens merged in one chunk: finish_reason "length" gives the count
    assert (res.ttft, res.output_tokens, res.chunk_times) == (0.5, 3, [0.5, 0.8, 1.0])
    assert res.tpot == pytest.approx(0.25) and res.itls == pytest.approx([0.3, 0.2])
    note_event(res, {"choices": [], "usage": {"completion_tokens": 4, "prompt_tokens": 9}}, 1)
    assert (res.output_tokens, res.prompt_tokens) == (4, 9)


def test_summary_counts_failures_and_slo():
    fast = RequestResult(0.0, 3, first=0.1, finish=0.3, output_tokens=3)
    slow = RequestResult(0.5, 3, first=3.0, finish=3.2, output_tokens=3)   # TTFT 2.5 s
    failed = RequestResult(1.0, 3, error="HTTP 503")
    s = serve_summary([fast, slow, failed], SLO(ttft_s=2.0, tpot_s=0.2))
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 503"])
    assert s["attainment"] == pytest.approx(1 / 3)
    assert s["slo_met_per_s"] == pytest.approx(1 / 3.2)
    assert s["output_tok_s"] == pytest.approx(6 / 3.2)


def test_unreachable_server_fails_every_request():
    base = f"http://127.0.0.1:{free_port()}"
    results = asyncio.run(run_load(base, ["a", "b"], [2, 2], [0.0, 0.01], lambda n: {}))
    assert all(not r.ok and "Connect" in r.error for r in results)
    assert serve_summary(results, SLO(1.0, 1.0))["failed"] == 2


def test_each_rate_has_its_own_prompts():
    """No prompt shares its first 16 tokens with another of any rate or with the warm-up: a
    prefix-caching server (vLLM) must not find an earlier rate's prompts already computed."""
    from minillm.checkpoint.loader import smollm2_tokenizer

    load = make_load(32, (1.0, 2.0, 4.0), 24, 64, 4, 8, 0, SLO(1.0, 0.1))
    assert set(load.prompts) == set(load.arrivals) == {1.0, 2.0, 4.0}
    tok = smollm2_tokenizer()
    heads = [tuple(tok.encode(p)[:16]) for rate in load.prompts for p in load.prompts[rate]]
    heads += [tuple(tok.encode(p)[:16]) for p in load.warmup]
    assert len(heads) == 3 * 32 + 2 and len(set(heads)) == len(heads)
    for prompts in load.prompts.values():     # same lengths at every rate (to a token or two:
        lens = [len(tok.encode(p)) for p in prompts]     # decoded text is re-tokenised)
        assert all(abs(n - m) <= 2 for n, m in zip(lens, load.prompt_lens))


def test_the_structured_bench_schema_cannot_close_early():
    """``--structured json``'s schema (checked by jsonschema) refuses an array shorter than
    max_tokens, so constrained requests generate as many tokens as plain ones."""
    import jsonschema

    from minillm.bench.serve import structured_body

    schema = structured_body("json", 3)["structured_outputs"]["json"]
    jsonschema.validate(["a", "b", "c"], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(["a", "b"], schema)
    assert structured_body("none", 3) == {}
    with pytest.raises(ValueError, match="structured"):
        structured_body("xml", 3)
