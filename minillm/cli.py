"""The command line: ``python -m minillm generate|chat|serve|bench ...`` (also ``minillm``).

Each subcommand is a pair of functions: ``add_<name>(subparsers)`` declares its arguments and
sets ``func`` to ``cmd_<name>(args) -> exit code``. :data:`COMMANDS` and
:data:`BENCH_COMMANDS` list them; a new subcommand (``serve``, ``bench throughput``) is one more
entry there. A ``ValueError`` raised anywhere below (bad sampling parameters, an unknown model
name) becomes a one-line ``error: ...`` on stderr and exit code 2, like argparse's own errors.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Iterator

from .config import SamplingParams

AddParser = Callable[["argparse._SubParsersAction"], None]


# ----------------------------------------------------------------------------- helpers

def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype, --quantization: where the weights come from, how they are
    stored and where they run."""
    p.add_argument("--model", default="smollm2-135m",
                   help="preset name, .gguf file or HF checkpoint folder (default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--dtype", default=None,
                   help="float32, bfloat16 or float16 (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--quantization", "-q", default=None,
                   help="weights quantized at load time (vLLM's flag): int8, int4, gptq, awq, "
                        "hqq, q8_0, q4_1 or q4_k (default: none)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """--max-tokens, --temperature, --top-p, --top-k, --seed (vLLM's SamplingParams)."""
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="most new tokens per reply (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--no-chat-template", action="store_true",
                   help="feed the raw text instead of wrapping it in the chat template")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the parsed flags (raises ValueError naming a bad one)."""
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed)


def load(args: argparse.Namespace):
    """(model, tokenizer) for --model/--device/--dtype/--quantization; a model without a
    tokenizer is an error."""
    from .checkpoint.loader import load_model

    model, tok = load_model(args.model, device=args.device, dtype=args.dtype,
                            quantization=args.quantization)
    if tok is None:
        raise ValueError(f"--model {args.model!r} has no tokenizer, so it cannot read text")
    return model, tok


def stream_text(tok, token_ids: Iterable[int]) -> Iterator[str]:
    """Turn a stream of token ids into a stream of text pieces.

    The whole list is decoded each time and only the new suffix is yielded; a suffix that ends
    in U+FFFD (a multi-byte character cut between tokens) waits for the next token. EOS and
    other special tokens are not shown.
    """
    ids: list[int] = []
    shown = 0
    for i in token_ids:
        if i == tok.eos_token_id:
            break
        ids.append(i)
        text = tok.decode(ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            continue
        if len(text) > shown:
            yield text[shown:]
            shown = len(text)
    text = tok.decode(ids, skip_special_tokens=True)
    if len(text) > shown:
        yield text[shown:]


def prompt_ids(tok, messages: list[dict], raw: bool) -> list[int]:
    """Token ids of the conversation: chat template, or (``raw``) the contents one per line."""
    if raw:
        return tok.encode("\n".join(m["content"] for m in messages))
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def reply(model, tok, ids: list[int], params: SamplingParams, out=None) -> str:
    """Generate after ``ids``, printing text as it comes; return the whole reply."""
    from .generate import stream

    out = out or sys.stdout
    pieces = []
    for piece in stream_text(tok, stream(model, ids, params)):
        out.write(piece)
        out.flush()
        pieces.append(piece)
    out.write("\n")
    out.flush()
    return "".join(pieces)


# ----------------------------------------------------------------------------- generate

def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="complete one prompt, streaming tokens to stdout")
    p.add_argument("--prompt", required=True, help="the user message (or raw text)")
    add_sampling_args(p, max_tokens=128)
    add_model_args(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # check the flags before the (slow) model load
    model, tok = load(args)
    messages = [{"role": "user", "content": args.prompt}]
    reply(model, tok, prompt_ids(tok, messages, args.no_chat_template), params)
    return 0


# ----------------------------------------------------------------------------- chat

def add_chat(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat that keeps the conversation history")
    p.add_argument("--system", default=None, help="an optional system message")
    add_sampling_args(p, max_tokens=256)
    add_model_args(p)
    p.set_defaults(func=cmd_chat)


def fit_history(tok, messages: list[dict], budget: int) -> list[dict]:
    """Drop the oldest exchanges (keeping a system message) until the prompt fits ``budget``."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = messages[len(system):]
    while len(turns) > 1 and len(prompt_ids(tok, system + turns, raw=False)) > budget:
        turns = turns[2:] if len(turns) > 2 else turns[1:]
    return system + turns


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    model, tok = load(args)
    interactive = sys.stdin.isatty()
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    budget = model.cfg.max_seq_len - params.max_tokens
    if interactive:
        print("minillm chat: type a message, 'exit' or Ctrl-D to quit.")
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("exit", "quit"):
            return 0
        if not line.strip():
            continue
        messages = fit_history(tok, messages + [{"role": "user", "content": line.strip()}],
                               budget)
        answer = reply(model, tok, prompt_ids(tok, messages, args.no_chat_template), params)
        messages.append({"role": "assistant", "content": answer})


# ----------------------------------------------------------------------------- bench

def bench_parser(sub, name: str, help: str):
    """A ``bench NAME`` parser with the options every benchmark shares; it writes
    benchmarks/results/NAME.json and figures/bench_NAME.png unless told otherwise."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--model", default="smollm2-135m", help="model or preset (default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch (and llama.cpp) threads (default: the available cores)")
    p.add_argument("--out", default=f"benchmarks/results/{name}.json", help="JSON path")
    p.add_argument("--figure", default=f"figures/bench_{name}.png",
                   help="PNG path ('none' to skip the plot)")
    return p


def add_peers(p) -> None:
    p.add_argument("--peers", nargs="+", default=["hf", "llama.cpp"],
                   help="engines to compare with: hf, llama.cpp, vllm (make setup-vllm), or "
                        "none")


def peers_of(args: argparse.Namespace) -> list[str]:
    return [] if args.peers == ["none"] else args.peers


def write_report(args: argparse.Namespace, report: dict, table: str, plot) -> int:
    """Print the table, write the JSON and (unless --figure none) the plot."""
    import matplotlib.pyplot as plt

    from .bench.common import write_json
    from .viz import save

    print(table)
    print(f"wrote {write_json(report, args.out)}")
    if args.figure != "none":
        fig = plot(report)
        print(f"wrote {save(fig, args.figure, dpi=110)}")
        plt.close(fig)
    return 0


def log_to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def add_bench_decode(sub) -> None:
    p = bench_parser(sub, "decode", "prefill and batch-1 decode tokens/s vs HF and llama.cpp")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   help="dtypes of minillm and HF (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated (default: 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; median (default: 3)")
    add_peers(p)
    p.set_defaults(func=cmd_bench_decode)


def cmd_bench_decode(args: argparse.Namespace) -> int:
    from .bench.decode import decode_table, run_decode_bench
    from .viz.bench import plot_decode

    report = run_decode_bench(args.model, dtypes=args.dtypes, prompt_len=args.prompt_len,
                                    new_tokens=args.new_tokens, repeats=args.repeats,
                                    device=args.device, threads=args.threads,
                                    peers=peers_of(args), log=log_to_stderr)
    return write_report(args, report, decode_table(report), plot_decode)


def add_bench_throughput(sub) -> None:
    p = bench_parser(sub, "throughput", "serving throughput on mixed requests vs HF and "
                                        "llama.cpp")
    p.add_argument("--dtype", default=None,
                   help="dtype of minillm and HF (default: bfloat16 on CUDA; on a CPU the "
                        "faster of float32 and bfloat16 for it, as minillm.LLM picks)")
    p.add_argument("--num-requests", type=int, default=64, help="requests (default: 64)")
    p.add_argument("--hf-batch", type=int, default=32, help="HF static batch (default: 32)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine batch (default: 64)")
    p.add_argument("--profile-steps", type=int, default=5,
                   help="profile this many of minillm's batched decode steps (0: none)")
    p.add_argument("--attention-backend", default=None,
                   help="minillm's paged attention: sdpa, triton or cpu (default: as the "
                        "engine picks, the C++ kernel on a CPU that builds it)")
    add_peers(p)
    p.set_defaults(func=cmd_bench_throughput)


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from .bench.throughput import run_throughput_bench, throughput_table
    from .viz.bench import plot_throughput

    report = run_throughput_bench(args.model, args.num_requests, args.dtype, args.device,
                                        args.hf_batch, peers_of(args), threads=args.threads,
                                        say=log_to_stderr, profile_steps=args.profile_steps,
                                        max_num_seqs=args.max_num_seqs,
                                        **({"attention_backend": args.attention_backend}
                                           if args.attention_backend else {}))
    return write_report(args, report, throughput_table(report), plot_throughput)


def add_bench_quant(sub) -> None:
    from .bench.quant import DEFAULT_SPECS

    p = bench_parser(sub, "quant", "perplexity and batch-1 decode of every quantization format "
                                   "against bf16")
    p.add_argument("--dtype", default="bfloat16", help="the float reference and activation "
                                                      "dtype (default: %(default)s)")
    p.add_argument("--specs", nargs="+", default=list(DEFAULT_SPECS),
                   help="formats, method[:group_size] (default: %(default)s)")
    p.add_argument("--eval-tokens", type=int, default=512, help="held-out tokens for perplexity")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default: 64)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated (default: 32)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; median (default: 3)")
    p.set_defaults(func=cmd_bench_quant)


def cmd_bench_quant(args: argparse.Namespace) -> int:
    from .bench import quant as qbench
    from .viz.a1 import plot_quant_bench

    report = qbench.run_quant_bench(args.model, specs=args.specs, dtype=args.dtype,
                                    eval_tokens=args.eval_tokens, prompt_len=args.prompt_len,
                                    new_tokens=args.new_tokens, repeats=args.repeats,
                                    device=args.device, threads=args.threads, log=log_to_stderr)
    return write_report(args, report, qbench.quant_table(report), plot_quant_bench)


def add_bench_spec(sub) -> None:
    from .bench.spec import ALL_METHODS, DEFAULT_K, METHODS
    from .bench.spec_load import BUDGETS, MAX_NEW_TOKENS, NUM_REQUESTS, RATES

    p = bench_parser(sub, "spec", "speculative decoding: acceptance and speedup of every drafter")
    p.add_argument("--methods", nargs="+", default=None,
                   help=f"(default: {' '.join(ALL_METHODS)}; with --part1: {' '.join(METHODS)})")
    p.add_argument("--part1", action="store_true",
                   help="chapter 06's run: part I's methods only (no block drafter weights "
                        "needed) and no load sweeps")
    p.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 6, 8],
                   help=f"lookaheads of the k sweep (default: %(default)s; per-kind runs use "
                        f"{DEFAULT_K})")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64],
                   help="batch sizes (default: %(default)s)")
    p.add_argument("--prompts-per-kind", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--dtype", default=None, help="default: what minillm.LLM picks")
    load = p.add_argument_group("speculation under load (figure: the --figure path + _load)")
    load.add_argument("--load", action=argparse.BooleanOptionalAction, default=True,
                      help="equal-budget and request-rate sweeps (default: on, off with --part1)")
    load.add_argument("--budgets", nargs="+", type=int, default=list(BUDGETS),
                      help="draft tokens verified per sequence per round (default: %(default)s)")
    load.add_argument("--rates", nargs="+", type=float, default=list(RATES),
                      help="Poisson request rates, requests/s (default: %(default)s)")
    load.add_argument("--load-requests", type=int, default=NUM_REQUESTS,
                      help="requests of each load run (default: %(default)s)")
    load.add_argument("--load-tokens", type=int, default=MAX_NEW_TOKENS,
                      help="output tokens per request in the load runs (default: %(default)s)")
    p.set_defaults(func=cmd_bench_spec)


def cmd_bench_spec(args: argparse.Namespace) -> int:
    from pathlib import Path

    import matplotlib.pyplot as plt

    from .bench.spec import ALL_METHODS, METHODS, run_spec_bench, spec_table
    from .bench.spec_load import spec_load_tables
    from .viz import save
    from .viz.bench import plot_spec, plot_spec_load

    methods = args.methods or list(METHODS if args.part1 else ALL_METHODS)
    load = args.load and not args.part1
    report = run_spec_bench(args.model, methods, args.ks, args.batches,
                            args.prompts_per_kind, args.max_tokens, args.device, args.dtype,
                            args.threads, log=log_to_stderr,
                            load=load and {"budgets": args.budgets, "rates": args.rates,
                                           "num_requests": args.load_requests,
                                           "max_tokens": args.load_tokens})
    write_report(args, report, f"{spec_table(report)}\n\n{spec_load_tables(report)}", plot_spec)
    if load and args.figure != "none":
        path = Path(args.figure)
        fig = plot_spec_load(report)
        print(f"wrote {save(fig, path.with_name(f'{path.stem}_load{path.suffix}'), dpi=110)}")
        plt.close(fig)
    return 0


def add_bench_chunked(sub) -> None:
    from .bench.chunked import BUDGETS

    p = bench_parser(sub, "chunked", "chunked prefill vs prefill_first and decode_first: "
                                     "inter-token latency, TTFT and throughput")
    p.add_argument("--budgets", nargs="+", type=int, default=list(BUDGETS),
                   help="chunked prefill's tokens per step; the first is the headline "
                        "(default: %(default)s)")
    p.add_argument("--num-decodes", type=int, default=16,
                   help="running requests, short prompts and long outputs (default: 16)")
    p.add_argument("--num-long", type=int, default=8,
                   help="long prompts arriving while they decode (default: 8)")
    p.add_argument("--long-range", nargs=2, type=int, default=[1000, 2000], metavar=("MIN", "MAX"),
                   help="long prompt tokens (default: 1000 2000)")
    p.add_argument("--long-tokens", type=int, default=16,
                   help="output tokens of each long prompt (default: 16)")
    p.add_argument("--gap-steps", type=int, default=24,
                   help="decode steps between two long prompts besides one's prefill "
                        "(default: 24)")
    p.add_argument("--repeats", type=int, default=2,
                   help="rounds of every policy, interleaved; each keeps its shortest "
                        "(default: 2)")
    p.add_argument("--seed", type=int, default=0, help="(default: 0)")
    p.add_argument("--dtype", default=None, help="default: what minillm.LLM picks (the "
                                                 "equality check always runs in fp32)")
    p.set_defaults(func=cmd_bench_chunked)


def cmd_bench_chunked(args: argparse.Namespace) -> int:
    from .bench.chunked import chunked_table, run_chunked_bench
    from .viz.bench import plot_chunked

    report = run_chunked_bench(args.model, args.budgets, args.num_decodes, args.num_long,
                               tuple(args.long_range), args.dtype, args.device, args.threads,
                               log=log_to_stderr, long_tokens=args.long_tokens,
                               gap_steps=args.gap_steps, seed=args.seed,
                               repeats=args.repeats)
    return write_report(args, report, chunked_table(report), plot_chunked)


def use_threads(args: argparse.Namespace) -> None:
    """--threads for benchmarks that run on this process's torch threads (CPU only)."""
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)


def add_bench_disagg(sub) -> None:
    p = bench_parser(sub, "disagg", "colocated serving vs a 1P1D disaggregated pair (KV whole "
                                    "and layer by layer) on one Poisson workload")
    p.add_argument("--num-requests", type=int, default=16, help="(default: %(default)s)")
    p.add_argument("--rate", type=float, default=1.0, help="requests/s (default: %(default)s)")
    p.add_argument("--prompt-median", type=int, default=400, help="(default: %(default)s)")
    p.add_argument("--prompt-max", type=int, default=1200, help="(default: %(default)s)")
    p.add_argument("--output-median", type=int, default=32, help="(default: %(default)s)")
    p.add_argument("--dtype", default=None, help="default: what minillm.LLM picks")
    p.set_defaults(func=cmd_bench_disagg)


def cmd_bench_disagg(args: argparse.Namespace) -> int:
    from .bench.disagg import disagg_table, run_disagg_bench
    from .viz.bench import plot_disagg

    use_threads(args)
    report = run_disagg_bench(args.model, args.num_requests, args.rate, args.prompt_median,
                              args.prompt_max, args.output_median, args.dtype)
    return write_report(args, report, disagg_table(report), plot_disagg)


def add_bench_prefix(sub) -> None:
    p = bench_parser(sub, "prefix", "prefix caching (hash, radix) on a shared system prompt, "
                                    "multi-turn chat and pool sizes")
    p.add_argument("--num-requests", type=int, default=32, help="(default: %(default)s)")
    p.add_argument("--system-tokens", type=int, default=1000, help="(default: %(default)s)")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 2.0, 8.0],
                   help="requests/s (default: %(default)s)")
    p.add_argument("--dtype", default=None, help="default: what minillm.LLM picks")
    p.add_argument("--parts", nargs="+", default=None,
                   help="any of shared_prompt multi_turn cache_size tiers blend (default: all)")
    p.set_defaults(func=cmd_bench_prefix)


def cmd_bench_prefix(args: argparse.Namespace) -> int:
    from .bench.prefix import PARTS, prefix_table, run_prefix_bench
    from .viz.bench import plot_prefix

    use_threads(args)
    report = run_prefix_bench(args.model, args.num_requests, args.system_tokens,
                              tuple(args.rates), dtype=args.dtype,
                              parts=tuple(args.parts or PARTS))
    return write_report(args, report, prefix_table(report), plot_prefix)


def add_bench_serve(sub) -> None:
    from .bench.serve import NUM_REQUESTS, PEERS, RATES

    p = bench_parser(sub, "serve", "the OpenAI server under Poisson load against llama.cpp's "
                                   "server: TTFT, TPOT, ITL, goodput per request rate")
    p.add_argument("--rates", type=float, nargs="+", default=list(RATES),
                   help="requests/s (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=NUM_REQUESTS,
                   help="requests per rate (default: %(default)s)")
    p.add_argument("--peers", nargs="+", default=list(PEERS),
                   help="servers: minillm, llama.cpp, vllm (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="minillm's batch (default: "
                                                                  "the server's)")
    p.add_argument("--seed", type=int, default=0, help="(default: 0)")
    p.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from .bench.serve import run_serve_bench, serve_table
    from .viz.bench import plot_serve

    report = run_serve_bench(args.model, tuple(args.rates), args.num_requests,
                             tuple(args.peers), args.threads, args.max_num_seqs,
                             seed=args.seed, say=log_to_stderr)
    return write_report(args, report, serve_table(report), plot_serve)


def add_bench_runtime(sub) -> None:
    p = bench_parser(sub, "runtime", "batch-1 decode eager / compiled / CUDA graphs / int8 / "
                     "int4 vs llama.cpp; decode step time by batch size")
    p.add_argument("--configs", nargs="+", default=None,
                   help="WEIGHTS[@fp32|@bf16][+compile][+graphs] or WEIGHTS[@fp32|@bf16]+engine, "
                        "WEIGHTS fp32, bf16, int8 or int4 (default: a CPU or a GPU set)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated (default: 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; median (default: 3)")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[],
                   help="also time the decode step at these batch sizes")
    p.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    p.set_defaults(func=cmd_bench_runtime)


def cmd_bench_runtime(args: argparse.Namespace) -> int:
    from .bench.runtime import run_runtime_bench, runtime_table
    from .viz.a3 import plot_runtime

    report = run_runtime_bench(args.model, args.configs, args.prompt_len, args.new_tokens,
                               args.repeats, args.batch_sizes, args.device, args.threads,
                               llama=not args.no_llama, log=log_to_stderr)
    return write_report(args, report, runtime_table(report), plot_runtime)


#: ``bench`` subcommands.
BENCH_COMMANDS: dict[str, AddParser] = {"decode": add_bench_decode,
                                        "throughput": add_bench_throughput,
                                        "quant": add_bench_quant, "spec": add_bench_spec,
                                        "chunked": add_bench_chunked,
                                        "disagg": add_bench_disagg,
                                        "prefix": add_bench_prefix,
                                        "serve": add_bench_serve,
                                        "runtime": add_bench_runtime}


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that compare minillm with its peers")
    inner = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for add in BENCH_COMMANDS.values():
        add(inner)


# ----------------------------------------------------------------------------- serve

def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, "
                                     "/v1/chat/completions, /metrics)")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="requests that may wait beyond a full batch before 503 (default: "
                        "%(default)s)")
    p.add_argument("--served-model-name", default=None, help="(default: --model)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get after SIGTERM (default: %(default)s)")
    p.add_argument("--log-level", default="info", help="uvicorn's (default: %(default)s)")
    engine = p.add_argument_group("engine options (minillm.LLM's; default: the engine's, "
                                  "except --max-num-seqs: vLLM's CPU server default, "
                                  "minillm.serve.api.SERVER_MAX_NUM_SEQS)")
    for flag, kind in (("--max-num-seqs", int), ("--num-kv-blocks", int), ("--block-size", int),
                       ("--max-num-batched-tokens", int)):
        engine.add_argument(flag, type=kind, default=None)
    for flag in ("--enable-chunked-prefill", "--enable-prefix-caching"):
        engine.add_argument(flag, action="store_true", default=None)
    p.set_defaults(func=cmd_serve)


ENGINE_FLAGS = ("max_num_seqs", "num_kv_blocks", "block_size", "max_num_batched_tokens",
                "enable_chunked_prefill", "enable_prefix_caching")


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve.api import serve

    options = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    serve(args.model, args.host, args.port, api_key=args.api_key, max_queue=args.max_queue,
          shutdown_timeout=args.shutdown_timeout, device=args.device, dtype=args.dtype,
          quantization=args.quantization, log_level=args.log_level,
          served_model_name=args.served_model_name, **options)
    return 0


#: Top-level subcommands.
COMMANDS: dict[str, AddParser] = {"generate": add_generate, "chat": add_chat, "serve": add_serve,
                                  "bench": add_bench}


# ----------------------------------------------------------------------------- entry point

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minillm", description="minillm: a small LLM engine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the subcommand, return its exit code (2 for bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"minillm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"minillm {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
