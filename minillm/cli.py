"""The command line: ``python -m minillm generate|chat|serve|bench ...`` (also ``minillm``).

Each top-level subcommand is a pair of functions here: ``add_<name>(subparsers)`` declares its
arguments and sets ``func`` to ``cmd_<name>(args) -> exit code``; :data:`COMMANDS` lists them.
Each ``bench`` subcommand registers itself, as ``vllm bench`` does: the module
``minillm.bench.<name>`` (listed in :data:`BENCHMARKS`) has ``HELP``, ``add_arguments(parser)``
(its own options) and ``main(args) -> exit code``; :func:`add_bench` adds the options every
benchmark shares (:func:`minillm.bench.common.add_common_args`, beside the other helpers
``add_peers``, ``peers_of``, ``write_report``, ``log_to_stderr`` and ``use_threads``). A new
benchmark is a module with those three names and one more entry in :data:`BENCHMARKS`. A
``ValueError`` raised anywhere below (bad sampling parameters, an unknown model name) becomes a
one-line ``error: ...`` on stderr and exit code 2, like argparse's own errors.
"""
from __future__ import annotations

import argparse
import importlib
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

#: ``bench`` subcommands, in ``bench --help`` order: each is the module minillm.bench.NAME, which
#: has ``HELP`` (the one-line help), ``add_arguments(parser)`` and ``main(args) -> exit code``.
BENCHMARKS = ("decode", "throughput", "quant", "kvcache", "spec", "chunked", "disagg", "prefix",
              "serve", "runtime")


def add_bench(sub) -> None:
    from .bench.common import add_common_args

    p = sub.add_parser("bench", help="benchmarks that compare minillm with its peers")
    inner = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name in BENCHMARKS:
        module = importlib.import_module(f"minillm.bench.{name}")
        bench = inner.add_parser(name, help=module.HELP)
        add_common_args(bench, name)
        module.add_arguments(bench)
        bench.set_defaults(func=module.main)


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
                       ("--max-num-batched-tokens", int), ("--kv-cache-dtype", str)):
        engine.add_argument(flag, type=kind, default=None)
    for flag in ("--enable-chunked-prefill", "--enable-prefix-caching"):
        engine.add_argument(flag, action="store_true", default=None)
    p.set_defaults(func=cmd_serve)


ENGINE_FLAGS = ("max_num_seqs", "num_kv_blocks", "block_size", "max_num_batched_tokens",
                "kv_cache_dtype", "enable_chunked_prefill", "enable_prefix_caching")


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
