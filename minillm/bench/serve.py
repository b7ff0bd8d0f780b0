"""The serving benchmark (``python -m minillm bench serve``; chapter A3): real servers over HTTP.

Each server is started as a subprocess on 127.0.0.1 at a free port (:func:`server_process`),
given the same seeded workload (long-tailed prompt and output lengths, text prompts decoded from
token ids so every server reads the same bytes) at a sweep of Poisson rates, and stopped with
SIGTERM. The load generator (:func:`run_load`) is one asyncio loop with ``httpx``: request i is
sent at its arrival time whatever the state of the others (an open loop), streaming
``/v1/completions`` at temperature 0 with ``max_tokens`` = its output length and EOS ignored
(``ignore_eos``, vLLM's extension, for minillm; ``min_tokens`` for llama.cpp), and timed on the
client: TTFT (send to first token chunk), ITLs (gaps between token chunks), TPOT ((end - first
token) / (tokens - 1), :func:`minillm.serving_metrics.tpot`), end-to-end latency.

Per rate: p50/p90/p99 of each, output tokens/s over the run, failed requests, SLO attainment
and the requests meeting both SLOs (:class:`minillm.serving_metrics.SLO`) per second;
per server, DistServe's goodput rate (:func:`~minillm.serving_metrics.goodput_of`, the highest
rate whose attainment is at least 90%). After each rate minillm's ``/metrics`` must show every KV
block free (recorded). The peers: llama.cpp's OpenAI server (``llama_cpp.server`` from
llama-cpp-python, the same GGUF file, the same threads; it runs one request at a time), and
vLLM's OpenAI server (:mod:`minillm.bench.vllm_peer`: the same weights as an HF folder, the
serving dtype, the same threads, ``ignore_eos``; skipped, saying how to set it up, when its
venv is missing).

``--structured json`` sends every request with a small JSON schema (vLLM's
``structured_outputs`` field; minillm and vLLM only), so a rate can be run with and without
constrained decoding and the cost of the grammar (compile at intake, a mask per row per step)
read off TPOT and tokens/s. The schema, a list of at least ``max_tokens`` strings
(:func:`bench_schema`), cannot close before ``max_tokens`` tokens, so each request still
generates as many tokens as without it (``short_outputs`` would count those that did not).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..runinfo import available_cores, free_port, machine_info
from ..serving_metrics import SLO, goodput_of, slo_attainment, spread, tpot
from ..workloads import poisson_arrivals, sharegpt_like_workload
from .common import format_table, log_to_stderr, write_report
from .disagg import SLO_TPOT_S, SLO_TTFT_S
from .vllm_peer import vllm_missing, vllm_spec, vllm_version

#: Defaults of the full run (200 requests per rate, as the serving issue asks): about an hour
#: on 2 quiet cores with all three servers. A rate's run lasts about max(N / rate, N / capacity);
#: llama.cpp's server (one request at a time) manages ~1 req/s on this workload and takes half
#: the hour, the batching servers keep up to the highest rate here.
RATES = (0.5, 1.0, 2.0, 4.0, 8.0)
NUM_REQUESTS = 200
PROMPT_MEDIAN, PROMPT_MAX, OUTPUT_MEDIAN, OUTPUT_MAX = 96, 512, 32, 128
PEERS = ("minillm", "llama.cpp", "vllm")
SERVED_NAME = "smollm2-135m"
STARTUP_TIMEOUT = 180.0      # seconds a server may take to answer its readiness probe
REQUEST_TIMEOUT = 600.0      # seconds one request may take (a queue behind a serial server)
STRUCTURED = ("none", "json")
STRUCTURED_PEERS = ("minillm", "vllm")     # servers that take vLLM's structured_outputs field


def bench_schema(max_tokens: int) -> dict:
    """``--structured json``'s schema for a request of ``max_tokens``: a JSON array of at least
    that many strings (every item takes a token at least, so the JSON cannot close sooner)."""
    return {"type": "array", "items": {"type": "string"}, "minItems": max_tokens}


def structured_body(mode: str, max_tokens: int) -> dict:
    """The request fields of ``--structured mode`` (none: nothing)."""
    if mode not in STRUCTURED:
        raise ValueError(f"structured must be one of {list(STRUCTURED)}, got {mode!r}")
    return {} if mode == "none" else {"structured_outputs": {"json": bench_schema(max_tokens)}}


# ----------------------------------------------------------------------------- one request

@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds after the run's start."""

    arrival: float
    max_tokens: int
    first: float | None = None        # first chunk carrying a token
    finish: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first is not None and self.finish is not None

    @property
    def ttft(self) -> float:
        return self.first - self.arrival

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    @property
    def tpot(self) -> float:
        return tpot(self.first, self.finish, self.output_tokens)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def sse_events(line: str) -> dict | None:
    """The JSON of one server-sent ``data:`` line; None for [DONE], pings and blank lines."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return None if data in ("", "[DONE]") else json.loads(data)


def note_event(res: RequestResult, event: dict, now: float) -> None:
    """Fold one stream chunk into ``res``: a token chunk's time, usage, the final count."""
    if "error" in event:
        res.error = str(event["error"].get("message", event["error"]))
    for choice in event.get("choices") or []:
        if choice.get("text") or choice.get("token_ids"):
            res.first = now if res.first is None else res.first
            res.chunk_times.append(now)
            res.output_tokens += 1
        if choice.get("finish_reason") == "length":
            res.output_tokens = res.max_tokens   # exact even where chunks merged tokens
    if usage := event.get("usage"):
        res.output_tokens = usage["completion_tokens"]
        res.prompt_tokens = usage["prompt_tokens"]


async def one_request(client, url: str, body: dict, res: RequestResult, start: float) -> None:
    """Send ``body`` at ``res.arrival`` (s after ``start``) and record its stream in ``res``."""
    await asyncio.sleep(max(0.0, start + res.arrival - time.perf_counter()))
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if (event := sse_events(line)) is not None:
                    note_event(res, event, time.perf_counter() - start)
        res.finish = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - any failure is a failed request, counted
        res.error = f"{type(e).__name__}: {e}"


async def run_load(base: str, prompts: Sequence[str], output_lens: Sequence[int],
                   arrivals: Sequence[float], extra: Callable[[int], dict]
                   ) -> list[RequestResult]:
    """Open-loop load: request i (prompt i, ``max_tokens`` output_lens[i], greedy, streamed)
    is sent at arrivals[i] s; ``extra(max_tokens)`` joins its body (how the server is told to
    ignore EOS)."""
    import httpx

    results = [RequestResult(a, n) for a, n in zip(arrivals, output_lens)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(
            one_request(client, f"{base}/v1/completions", completion_body(p, n, extra(n)), r,
                        start) for p, n, r in zip(prompts, output_lens, results)))
    return results


def completion_body(prompt: str, max_tokens: int, extra: dict) -> dict:
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, **extra}


# ----------------------------------------------------------------------------- summaries

def serve_summary(results: Sequence[RequestResult], slo: SLO) -> dict:
    """Percentiles of TTFT, TPOT, ITL and end-to-end latency (s), throughput, failures,
    completed requests with fewer tokens than asked (EOS not ignored), SLO attainment and the
    requests meeting both SLOs per second of the run
    (:func:`~minillm.serving_metrics.slo_attainment`)."""
    ok = [r for r in results if r.ok]
    span = (max(r.finish for r in ok) - min(r.arrival for r in results)) if ok else 0.0
    attainment, met_per_s = slo_attainment(((r.ttft, r.tpot) for r in ok), slo, len(results),
                                           span)
    per_s = (lambda x: x / span) if span > 0 else (lambda x: 0.0)
    return {"num_requests": len(results), "completed": len(ok),
            "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if r.error})[:5],
            "short_outputs": sum(r.output_tokens < r.max_tokens for r in ok),
            **spread([r.ttft for r in ok], "ttft"), **spread([r.tpot for r in ok], "tpot"),
            **spread([i for r in ok for i in r.itls], "itl"),
            **spread([r.e2e for r in ok], "e2e"),
            "output_tokens": sum(r.output_tokens for r in ok),
            "output_tok_s": per_s(sum(r.output_tokens for r in ok)),
            "request_s": per_s(len(ok)), "attainment": attainment,
            "slo_met_per_s": met_per_s, "duration_s": span}


# ----------------------------------------------------------------------------- servers


def wait_ready(base: str, path: str, proc: subprocess.Popen, timeout: float) -> None:
    """Poll ``base + path`` until it answers 200 (RuntimeError if the process dies first)."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{base}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not answer {path} within {timeout:.0f} s")


@contextmanager
def server_process(command: Sequence[str], port: int, ready_path: str, threads: int,
                   timeout: float = STARTUP_TIMEOUT, record: dict | None = None,
                   extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """Run ``command`` (a server listening on 127.0.0.1:``port``) with ``threads`` OpenMP
    threads; yield its base URL once ``ready_path`` answers; SIGTERM it and wait after (its
    exit code and the first lines of its log go to ``record``). A failure to start raises
    RuntimeError with the end of the server's log."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           **(extra_env or {})}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=die_with_parent if sys.platform == "linux" else None)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, ready_path, proc, timeout)
            yield base
        except RuntimeError as e:
            log.seek(0)
            raise RuntimeError(f"{e}; its log ends:\n{log.read()[-2000:]}") from None
        finally:
            code = stop(proc)
            if record is not None:
                log.seek(0)
                record.update(exit_code=code, log_head=log.read(4000).splitlines()[:4])


def die_with_parent() -> None:
    """In the server's process (Linux): SIGTERM when the benchmark's process dies, so a
    killed benchmark leaves no server behind."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)   # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout`` s; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def kv_blocks(base: str, settle: float = 10.0) -> dict[str, float] | None:
    """minillm's ``minillm_kv_blocks_used`` / ``_free`` from ``/metrics`` once none is used
    (or ``settle`` s passed); None for a server without them."""
    import httpx

    deadline = time.time() + settle
    while True:
        r = httpx.get(f"{base}/metrics", timeout=10)
        found = {k: re.search(rf"^minillm_kv_blocks_{k} (\S+)$", r.text, re.M)
                 for k in ("used", "free")}
        if r.status_code != 200 or not all(found.values()):
            return None
        blocks = {k: float(m.group(1)) for k, m in found.items()}
        if blocks["used"] == 0 or time.time() > deadline:
            return blocks
        time.sleep(0.2)


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server and what its completion bodies need."""

    name: str
    command: list[str]
    ready_path: str
    extra: Callable[[int], dict]      # output length -> fields that make it ignore EOS
    env: dict[str, str] = field(default_factory=dict)   # added to the server's environment
    startup_timeout: float = STARTUP_TIMEOUT            # seconds until it must answer ready_path


def minillm_spec(model: str, port: int, max_num_seqs: int | None) -> ServerSpec:
    """``python -m minillm serve``; its torch threads come from OMP_NUM_THREADS."""
    cmd = [sys.executable, "-m", "minillm", "serve", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", SERVED_NAME, "--log-level", "warning"]
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    return ServerSpec("minillm", cmd, "/health", lambda n: {
        "ignore_eos": True, "stream_options": {"include_usage": True}})


def llama_cpp_spec(gguf: Path, port: int, threads: int, n_ctx: int) -> ServerSpec:
    """llama.cpp's server; ``--interrupt_requests False``, else each new request cuts the
    stream of the one being served (it serves one at a time)."""
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias",
           SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
           "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx), "--n_gpu_layers", "0",
           "--verbose", "False", "--interrupt_requests", "False"]
    return ServerSpec("llama.cpp", cmd, "/v1/models", lambda n: {"min_tokens": n})


def llama_cpp_server_missing() -> str | None:
    """Why llama.cpp's server cannot run here, or None."""
    try:
        import llama_cpp.server.app  # noqa: F401
    except ImportError as e:
        return f"skipped: llama_cpp.server does not import ({e}); pip install " \
               f"'llama-cpp-python[server]'"
    return None


# ----------------------------------------------------------------------------- the run

@dataclass
class Load:
    """The workload every server gets: text prompts per rate, output lengths, arrivals per rate.

    Each rate has its own prompts (same lengths, other text): a server that caches prefixes
    (vLLM does by default) must not find one rate's prompts already computed by an earlier rate.
    ``warmup`` prompts share no text with any rate's.
    """

    prompts: dict[float, list[str]]
    prompt_lens: list[int]
    output_lens: list[int]
    arrivals: dict[float, list[float]]
    slo: SLO
    warmup: list[str] = field(default_factory=list)


def sweep(spec: ServerSpec, port: int, threads: int, load: Load,
          say: Callable[[str], None]) -> dict:
    """Start ``spec``'s server, warm it up, run every rate, check its KV blocks, stop it."""
    runs: list[dict] = []
    out = {"command": spec.command, "runs": runs}
    with server_process(spec.command, port, spec.ready_path, threads, spec.startup_timeout,
                        record=out, extra_env=spec.env) as base:
        asyncio.run(run_load(base, load.warmup, [4] * len(load.warmup),
                             [0.0] * len(load.warmup), spec.extra))
        for rate, arrivals in load.arrivals.items():
            results = asyncio.run(run_load(base, load.prompts[rate], load.output_lens, arrivals,
                                           spec.extra))
            run = {"rate": rate, **serve_summary(results, load.slo),
                   "kv_blocks_after": kv_blocks(base)}
            say(f"  {spec.name} at {rate} req/s: {run['completed']} done, {run['failed']} "
                f"failed, TTFT p50 {fmt(run['ttft_p50'])} s, {run['output_tok_s']:.1f} tok/s")
            runs.append(run)
    out["goodput_rate"] = goodput_of((r["rate"], r["attainment"]) for r in runs)
    return out


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def make_load(num_requests: int, rates: Sequence[float], prompt_median: int, prompt_max: int,
              output_median: int, output_max: int, seed: int, slo: SLO) -> Load:
    """The seeded workload (sharegpt-like lengths) with Poisson arrivals for each rate.

    Every rate gets the same lengths; its prompts are windows (distinct starts) of its own
    stretch of prose, so no prompt shares its first KV block with another prompt of any rate.
    """
    from ..checkpoint.loader import smollm2_tokenizer
    from ..evaluate import sample_ids

    tok = smollm2_tokenizer()
    work = sharegpt_like_workload(tok, num_requests, prompt_median, output_median,
                                  prompt_max=prompt_max, output_max=output_max, seed=seed)
    lens = [len(p) for p in work.prompts]
    stretch = max(4 * prompt_max, 2 * num_requests)
    text = sample_ids((len(rates) + 1) * stretch, tok)
    rng = random.Random(seed)
    prompts = {}
    for k, rate in enumerate(rates):
        own = text[k * stretch:(k + 1) * stretch]
        starts = distinct_starts(lens, stretch, rng)
        prompts[float(rate)] = [tok.decode(own[s:s + n]) for s, n in zip(starts, lens)]
    spare = text[len(rates) * stretch:]
    warmup = [tok.decode(spare[:16]), tok.decode(spare[32:48])]
    return Load(prompts, lens, list(work.output_lens),
                {float(r): poisson_arrivals(num_requests, r, seed) for r in rates}, slo, warmup)


def distinct_starts(lens: Sequence[int], stretch: int, rng: random.Random) -> list[int]:
    """A start in ``range(stretch - n)`` for each length n, no two alike."""
    taken: set[int] = set()
    starts = []
    for n in lens:
        s = rng.randrange(0, stretch - n)
        while s in taken:
            s = rng.randrange(0, stretch - n)
        taken.add(s)
        starts.append(s)
    return starts


def run_serve_bench(model: str = "smollm2-135m", rates: Sequence[float] = RATES,
                    num_requests: int = NUM_REQUESTS, peers: Sequence[str] = PEERS,
                    threads: int | None = None, max_num_seqs: int | None = None,
                    prompt_median: int = PROMPT_MEDIAN, prompt_max: int = PROMPT_MAX,
                    output_median: int = OUTPUT_MEDIAN, output_max: int = OUTPUT_MAX,
                    seed: int = 0, slo_ttft: float = SLO_TTFT_S, slo_tpot: float = SLO_TPOT_S,
                    say: Callable[[str], None] = print, structured: str = "none") -> dict:
    """Run the sweep against every server in ``peers`` (minillm, llama.cpp); the report.
    ``structured`` "json": every request carries :func:`bench_schema`."""
    from ..checkpoint.gguf import find_smollm2_gguf

    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"peers must be among {list(PEERS)}, got {sorted(unknown)}")
    structured_body(structured, 1)                    # ValueError for an unknown mode
    threads = threads or available_cores()
    slo = SLO(slo_ttft, slo_tpot)
    load = make_load(num_requests, rates, prompt_median, prompt_max, output_median,
                     output_max, seed, slo)
    report = {"machine": machine_info(torch.device("cpu"), threads), "model": model,
              "gguf": str(find_smollm2_gguf()), "rates": list(load.arrivals),
              "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
              "workload": {"num_requests": num_requests, "seed": seed,
                           "prompt_median": prompt_median, "prompt_max": prompt_max,
                           "output_median": output_median, "output_max": output_max,
                           "prompt_lens": load.prompt_lens, "output_lens": load.output_lens,
                           "structured": structured,
                           "structured_schema": {**bench_schema(0), "minItems": "max_tokens"}
                           if structured == "json" else None},
              "servers": {}, "vllm": vllm_version() or vllm_missing(),
              "load_average": [os.getloadavg()[0]]}
    for name in peers:
        say(f"{name}: {len(load.arrivals)} rates x {num_requests} requests")
        try:
            report["servers"][name] = server_run(name, model, threads, max_num_seqs, load, say,
                                                 structured)
        except RuntimeError as e:          # a server that does not start: say so, go on
            say(f"  {name} failed: {str(e)[:300]}")
            report["servers"][name] = {"skipped": f"failed: {e}"}
        report["load_average"].append(os.getloadavg()[0])
    return report


def server_run(name: str, model: str, threads: int, max_num_seqs: int | None, load: Load,
               say: Callable[[str], None], structured: str = "none") -> dict:
    """One server's sweep, or ``{"skipped": why}`` when llama.cpp's or vLLM's cannot run (or
    cannot take ``structured`` outputs)."""
    from ..checkpoint.gguf import find_smollm2_gguf

    port = free_port()
    if structured != "none" and name not in STRUCTURED_PEERS:
        why = f"skipped: --structured {structured} is sent to {list(STRUCTURED_PEERS)} only"
        say(f"  {why}")
        return {"skipped": why}

    def run(spec: ServerSpec) -> dict:
        ignore_eos = spec.extra
        return sweep(replace(spec, extra=lambda n: {**ignore_eos(n),
                                                    **structured_body(structured, n)}),
                     port, threads, load, say)

    if name == "minillm":
        return run(minillm_spec(model, port, max_num_seqs))
    why = llama_cpp_server_missing() if name == "llama.cpp" else vllm_missing()
    if why is not None:
        say(f"  {why}")
        return {"skipped": why}
    n_ctx = max(load.prompt_lens) + max(load.output_lens) + 64
    if name == "vllm":
        return run(vllm_spec(port, threads, max(2048, n_ctx), max_num_seqs, model))
    return run(llama_cpp_spec(find_smollm2_gguf(), port, threads, max(2048, n_ctx)))


def serve_table(report: dict) -> str:
    """One row per server and rate."""
    rows = []
    for name, srv in report["servers"].items():
        for r in srv.get("runs", []):
            blocks = r["kv_blocks_after"]
            rows.append((name, r["rate"], f"{r['completed']}/{r['num_requests']}",
                         r["ttft_p50"] or 0, r["ttft_p99"] or 0, 1e3 * (r["tpot_p50"] or 0),
                         1e3 * (r["tpot_p99"] or 0), 1e3 * (r["itl_p99"] or 0),
                         r["e2e_p50"] or 0, r["output_tok_s"], r["attainment"], r["slo_met_per_s"],
                         "-" if blocks is None else f"{blocks['used']:.0f}"))
    cols = [("server", "<10"), ("req/s", ">5.2f"), ("ok", ">7"), ("TTFT p50 s", ">10.2f"),
            ("p99", ">6.2f"), ("TPOT p50 ms", ">11.1f"), ("p99", ">6.1f"), ("ITL p99 ms", ">10.1f"),
            ("e2e p50 s", ">9.2f"), ("tok/s", ">7.1f"), ("SLO met", ">7.2f"),
            ("SLO met/s", ">9.2f"), ("KV used", ">7")]
    skipped = [f"{n}: {s['skipped']}" for n, s in report["servers"].items() if "skipped" in s]
    return "\n".join([format_table(cols, rows), *skipped, f"vllm: {report['vllm']}"])


# ----------------------------------------------------------------------------- command line

HELP = ("the OpenAI server under Poisson load against llama.cpp's server: TTFT, TPOT, ITL, "
        "SLO attainment per request rate, DistServe's goodput")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``minillm bench serve``'s options (the shared ones: :func:`.common.add_common_args`)."""
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES),
                        help="requests/s (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=NUM_REQUESTS,
                        help="requests per rate (default: %(default)s)")
    parser.add_argument("--peers", nargs="+", default=list(PEERS),
                        help="servers: minillm, llama.cpp, vllm (default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="minillm's batch (default: the server's)")
    parser.add_argument("--seed", type=int, default=0, help="(default: 0)")
    parser.add_argument("--structured", choices=STRUCTURED, default="none",
                        help="json: every request carries a small JSON schema "
                             "(structured_outputs; minillm and vllm only) (default: none)")


def main(args: argparse.Namespace) -> int:
    """Run ``minillm bench serve``; print the table, write the JSON and the plot."""
    from ..viz.bench import plot_serve

    report = run_serve_bench(args.model, tuple(args.rates), args.num_requests,
                             tuple(args.peers), args.threads, args.max_num_seqs,
                             seed=args.seed, say=log_to_stderr, structured=args.structured)
    return write_report(args, report, serve_table(report), plot_serve)
