"""The speculative decoding benchmark (``python -m minillm bench spec``), chapter 06.

One target (SmolLM2), greedy, the same engine with and without a speculator. Prompts of three
kinds, held out from the drafters' training (:func:`minillm.spec_decode.prompts.benchmark_prompts`),
in the chat template: ``chat`` questions, ``grounded`` tasks (summarise, rewrite or extract from
a given passage, code edits) and ``free`` writing. Per method:

- at batch 1 (one request after another) per kind: output tokens/s, the speedup over the plain
  engine, acceptance by draft position, mean tokens per verification round (each speedup is
  over a plain run of the same prompts made just before the method's, the k sweep's over
  those of all kinds: the machine's speed drifts over the benchmark's minutes);
- the speedup against the lookahead k (batch 1, all kinds);
- the speedup at batch 4, 16, 64 (all requests at once);
- the drafter's cost per round at batch 1 next to the plain engine's time per token;
- the speedup Leviathan et al. (2023) predict from the measured acceptance and cost:
  (1 - a^(k+1)) / ((1 - a)(k c + 1)), with a solved from the mean tokens per round and k c the
  drafter's seconds per round over the plain engine's seconds per token. (For a tree, k is its
  depth: the formula's chain of i.i.d. acceptances is then only an approximation, and it
  assumes a verification pass costs one plain decode step, which ``nodes_per_round`` shows it
  does not for wide trees.)

Part I's methods are :data:`METHODS` (chapter 06); suffix decoding and the block drafters of
part II (:data:`BLOCK_METHODS`, chapter 06b) join them in :data:`ALL_METHODS`. Speculation
under load (acceptance at equal verification budgets, speedup against a Poisson request rate)
is :mod:`.spec_load`, run when ``load=True``.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass, field
from statistics import median

import torch

from ..checkpoint.loader import load_model
from ..config import SamplingParams
from ..device import resolve_device, serving_dtype
from ..engine import EngineConfig, LLMEngine
from ..runinfo import machine_info
from ..spec_decode.autotune import acceptance_rate, leviathan_speedup
from ..spec_decode.config import BLOCK_METHODS, MAX_TOKENS
from ..spec_decode.prompts import KINDS, benchmark_prompts
from ..spec_decode.speculator import SpecStats, build_speculator
from .common import dtype_name, format_table, log_to_stderr, write_report

METHODS = ("ngram", "draft_model", "medusa", "eagle", "eagle3", "mtp")   # part I (chapter 06)
ALL_METHODS = METHODS + ("suffix",) + BLOCK_METHODS   # + suffix decoding, part II's drafters
DEFAULT_K = {"ngram": 6, "suffix": 8, "draft_model": 4, "medusa": 4, "eagle": 5, "eagle3": 5,
             "mtp": 3, "dflash": 7, "ddtree": 7, "dspark": 7}
TREE_NODES = 16                  # the trees' node budget (medusa, eagle(3), ddtree) unless told


@dataclass
class Run:
    """One measured configuration: ``tokens`` output tokens in ``seconds``."""

    method: str
    k: int
    kind: str
    batch: int
    seconds: float
    tokens: int
    acceptance: list[float]
    mean_accepted: float
    propose_seconds: float
    rounds: int
    nodes_per_round: float = 0.0
    paired_speedups: list[float] = field(default_factory=list)   # over plain runs made beside
    #                                 it (:func:`measure_paired`; one for the fixed-k runs)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def chat_prompts(tok, kind: str, n: int) -> list[list[int]]:
    """``n`` held-out prompts of one kind as token ids, in the chat template."""
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": m}],
                                               add_generation_prompt=True))
            for m in benchmark_prompts(kind, n)]


def make_engine(model, tok, method: str | None, k: int, max_seqs: int, *,
                extra: dict | None = None, drafter=None,
                calibration_prompts: list[list[int]] | None = None) -> LLMEngine:
    """The engine of every measurement: ``max_seqs`` sequences at once, speculating with
    ``method`` (None: plain) at lookahead ``k``. ``extra``: more speculative_config keys
    (tree_nodes, default :data:`TREE_NODES`; verify_budget, ...); ``drafter``: (module, head,
    manifest) instead of the packaged weights (random-weight models in tests);
    ``calibration_prompts``: for k="auto" without a tokenizer."""
    options = {"method": method, "num_speculative_tokens": k, "tree_nodes": TREE_NODES,
               **(extra or {})}
    deepest = MAX_TOKENS.get(method, 0) if k == "auto" else k
    budget = max(4096, max_seqs * (1 + max(options["tree_nodes"], deepest)))
    # 40 blocks of 16 tokens per sequence (a held-out prompt, the output and a draft fit);
    # "auto" measures plain steps of up to 64 sequences when it is built, so it gets room for 64
    seqs = 64 if k == "auto" else max(4, max_seqs)
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=max_seqs, num_kv_blocks=40 * seqs,
                                                max_num_batched_tokens=budget))
    if method is not None:
        engine.use_speculator(build_speculator(options, engine, drafter=drafter,
                                               calibration_prompts=calibration_prompts))
    return engine


def warm_up(engine: LLMEngine, prompt: list[int]) -> None:
    """One short request (first-call costs out of the way), then fresh speculation counters
    (count the measured requests only), suffix decoding's outputs forgotten
    (:func:`forget_outputs`)."""
    run_in_batches(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=8), 1)
    if engine.speculator is not None:
        engine.speculator.stats = SpecStats()
        forget_outputs(engine)


def forget_outputs(engine: LLMEngine) -> None:
    """Make suffix decoding forget the outputs it has seen (a measured prompt must not find
    its own output from the warm-up or an earlier round); other methods keep none."""
    clear = getattr(engine.speculator.proposer, "clear_history", None)
    if clear is not None:
        clear()


def run_in_batches(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
          batch: int) -> tuple[float, int]:
    """Run ``prompts`` ``batch`` at a time (1: one after another); (seconds, output tokens)."""
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        for p in prompts[i:i + batch]:
            engine.add_request(p, params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - start, tokens


def measure(model, tok, method: str | None, k: int, kind: str, prompts: list[list[int]],
            batch: int, params: SamplingParams, *, extra: dict | None = None,
            drafter=None) -> Run:
    """``prompts`` ``batch`` at a time on a fresh, warmed-up engine (see :func:`make_engine`
    for ``extra`` and ``drafter``)."""
    engine = make_engine(model, tok, method, k, max(batch, 1), extra=extra, drafter=drafter)
    warm_up(engine, prompts[0])
    spec = engine.speculator
    seconds, tokens = run_in_batches(engine, prompts, params, batch)
    s = spec.stats if spec is not None else None
    if k == "auto":                   # the k it chose at batch 1 (fewer, or none, under load)
        method, k = f"{method} auto", spec.config.num_speculative_tokens
    return Run(method or "none", k, kind, batch, seconds, tokens,
               s.acceptance_by_position if s else [], s.mean_accepted if s else 1.0,
               s.propose_seconds if s else 0.0, s.rounds if s else 0,
               s.nodes / s.rounds if s and s.rounds else 0.0)


def measure_paired(model, tok, method: str, prompts: dict[str, list[list[int]]], batch: int,
                   params: SamplingParams, repeats: int, *,
                   calibration_prompts: list[list[int]] | None = None) -> list[Run]:
    """For each kind's ``prompts`` (kind -> token ids), ``repeats`` rounds of them ``batch``
    at a time, alternating between the plain engine and one speculating with ``method`` at
    num_speculative_tokens="auto" (each built, calibrated and warmed up once for all kinds):
    per kind the speculative run, totalled over the rounds, with ``paired_speedups``
    [repeats], each round's tokens/s over the plain round just before it. A slow moment of
    the machine then slows both halves of one pair, not one side of the comparison.
    ``calibration_prompts``: as in :func:`make_engine`."""
    plain = make_engine(model, tok, None, 0, batch)
    spec = make_engine(model, tok, method, "auto", batch,
                       calibration_prompts=calibration_prompts)
    first = next(iter(prompts.values()))[0]
    for engine in (plain, spec):
        warm_up(engine, first)
    return [paired_rounds(plain, spec, method, kind, batch_prompts, batch, params, repeats)
            for kind, batch_prompts in prompts.items()]


def paired_rounds(plain: LLMEngine, spec: LLMEngine, method: str, kind: str,
                  prompts: list[list[int]], batch: int, params: SamplingParams,
                  repeats: int) -> Run:
    """:func:`measure_paired`'s rounds of one kind's ``prompts`` on its two engines (suffix
    decoding forgets the earlier rounds' outputs before each)."""
    spec.speculator.stats = SpecStats()
    seconds = tokens = 0.0
    ratios = []
    for _ in range(repeats):
        p_s, p_t = run_in_batches(plain, prompts, params, batch)
        forget_outputs(spec)
        s_s, s_t = run_in_batches(spec, prompts, params, batch)
        ratios.append((s_t / s_s) / (p_t / p_s))
        seconds, tokens = seconds + s_s, tokens + s_t
    s = spec.speculator.stats
    return Run(f"{method} auto", spec.speculator.config.num_speculative_tokens, kind, batch,
               seconds, int(tokens), s.acceptance_by_position, s.mean_accepted,
               s.propose_seconds, s.rounds, s.nodes / s.rounds if s.rounds else 0.0, ratios)


def expected_speedup(run: Run, base_seconds_per_token: float) -> float:
    """Leviathan et al.'s formula from the run's measured acceptance and drafter cost."""
    if not run.rounds:
        return 1.0
    kc = run.propose_seconds / run.rounds / base_seconds_per_token
    return leviathan_speedup(acceptance_rate(run.mean_accepted, run.k), run.k, kc / run.k)


def run_spec_bench(model: str = "smollm2-135m", methods=ALL_METHODS, ks=(1, 2, 4, 6, 8),
                   batches=(1, 4, 16, 64), prompts_per_kind: int = 3, max_tokens: int = 64,
                   device=None, dtype=None, threads: int | None = None, log=print,
                   load: bool | dict = False, auto: bool = False, repeats: int = 1) -> dict:
    """Every measurement of the module docstring; returns the report (JSON-ready). ``load``:
    also speculation under load (:func:`.spec_load.run_load_sweeps`), True with its defaults
    or a dict of its keyword arguments (budgets, rates, num_requests, max_tokens, seed).
    ``auto``: instead of the fixed lookaheads, each method with num_speculative_tokens="auto"
    (chosen by measuring when its engine is built; see :mod:`minillm.spec_decode.autotune`):
    at batch 1 each kind and all kinds together, each right after a plain run of the same
    prompts (:func:`measure_paired`); at batch b > 1 all kinds, three rounds of b requests,
    with ``repeats`` > 1 alternating plain and speculative runs, the speedup the median of
    the pairs."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if threads:
        torch.set_num_threads(threads)
    dev = resolve_device(device)
    dtype, reason = serving_dtype(dtype, dev)
    target, tok = load_model(model, device=dev, dtype=dtype)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    by_kind = {kind: chat_prompts(tok, kind, prompts_per_kind) for kind in KINDS}
    mixed = [p for kind in KINDS for p in by_kind[kind]]
    runs: list[Run] = []

    def go(method, k, kind, prompts, batch):
        run = measure(target, tok, method, k, kind, prompts, batch, params)
        runs.append(run)
        log(f"{run.method:>11} k={run.k} {kind:>8} batch {batch:>2}: {run.rate:7.1f} tok/s, "
            f"{run.mean_accepted:.2f} tokens/round")
        return run

    waves = 3 if auto else 1          # auto: longer runs at batch > 1 (3 rounds of b requests)
    base = {kind: go(None, 0, kind, by_kind[kind], 1) for kind in KINDS}
    for b in batches:
        if b > 1:
            go(None, 0, "mixed", (mixed * waves * b)[:waves * b], b)
    for m in methods if auto else ():
        for b in batches:
            if b == 1 or repeats > 1:         # batch 1: each kind, and all of them together
                kinds = {**by_kind, "mixed": mixed} if b == 1 else \
                    {"mixed": (mixed * waves * b)[:waves * b]}
                for run in measure_paired(target, tok, m, kinds, b, params,
                                          1 if b == 1 else repeats):
                    runs.append(run)
                    log(f"{run.method:>11} k={run.k} {run.kind:>8} batch {b:>2}: paired "
                        "speedups " + " ".join(f"{x:.2f}" for x in run.paired_speedups))
            else:
                go(m, "auto", "mixed", (mixed * waves * b)[:waves * b], b)

    def paired(method, k, kind, prompts, batch, ref: Run | None = None) -> Run:
        """The plain run that ``method``'s run (its speedup set over it) is compared with:
        ``ref``, by default one of the same prompts made just before it. The machine's speed
        drifts over the benchmark's minutes, and a baseline measured once at the start would
        carry that drift into every ratio."""
        ref = ref or measure(target, tok, None, 0, kind, prompts, batch, params)
        run = go(method, k, kind, prompts, batch)
        run.paired_speedups = [run.rate / ref.rate]
        return ref

    for m in methods if not auto else ():
        sweep_ref = all_kinds([paired(m, DEFAULT_K[m], kind, by_kind[kind], 1)
                               for kind in KINDS])
        for k in sorted(set(ks) | {DEFAULT_K[m]}):      # the default k too, for the plots
            if k <= MAX_TOKENS[m] and not (m == "medusa" and k > 5):
                paired(m, k, "mixed", mixed, 1, sweep_ref)
        for b in batches:
            if b > 1:
                paired(m, DEFAULT_K[m], "mixed", (mixed * b)[:b], b)
    report = report_of(runs, base, machine_info(dev, torch.get_num_threads()),
                       {"model": model, "dtype": dtype_name(dtype), "dtype_reason": reason,
                        "max_tokens": max_tokens, "prompts_per_kind": prompts_per_kind,
                        "default_k": DEFAULT_K, "tree_nodes": TREE_NODES, "auto": auto,
                        "repeats": repeats,
                        "load_average": os.getloadavg()})
    if load:
        from .spec_load import run_load_sweeps  # it builds on this module

        options = load if isinstance(load, dict) else {}
        report["load"] = run_load_sweeps(target, tok, methods, log=log, **options)
        report["config"]["load_average_after"] = os.getloadavg()
    return report


def all_kinds(plain: list[Run]) -> Run:
    """Plain batch-1 runs of each kind as one run over all kinds (the k sweep's prompts)."""
    return Run("none", 0, "mixed", 1, sum(r.seconds for r in plain),
               sum(r.tokens for r in plain), [], 1.0, 0.0, 0)


def report_of(runs: list[Run], base: dict[str, Run], machine: dict, config: dict) -> dict:
    """Speedups against the plain engine of the same kind (batch 1) or batch."""
    plain = {(r.kind, r.batch): r for r in runs if r.method == "none"}
    plain[("mixed", 1)] = all_kinds(list(base.values()))
    rows = []
    for r in runs:
        ref = plain[(r.kind, r.batch)]
        speedup = median(r.paired_speedups) if r.paired_speedups else r.rate / ref.rate
        row = asdict(r) | {"tokens_per_s": r.rate, "speedup": speedup}
        if r.method != "none" and r.batch == 1:
            row["expected_speedup"] = expected_speedup(r, ref.seconds / ref.tokens)
        rows.append(row)
    return {"benchmark": "spec", "machine": machine, "config": config, "runs": rows,
            "drafter_cost": drafter_costs(rows, config["default_k"])}


def drafter_costs(rows: list[dict], default_k: dict[str, int]) -> list[dict]:
    """Per method, from its batch-1 run on all kinds at the default k: the drafter's ms per
    round (SpecStats.propose_seconds / rounds) next to the plain engine's ms per output
    token at batch 1, and their ratio (Leviathan's c x k)."""
    plain = [r for r in rows if r["method"] == "none" and r["batch"] == 1]
    ms_per_token = 1e3 * sum(r["seconds"] for r in plain) / max(1, sum(r["tokens"]
                                                                     for r in plain))
    out = []
    for r in rows:
        if r["method"] != "none" and r["kind"] == "mixed" and r["batch"] == 1 \
                and r["k"] == default_k.get(r["method"]) and r["rounds"]:
            ms = 1e3 * r["propose_seconds"] / r["rounds"]
            out.append({"method": r["method"], "k": r["k"], "draft_ms_per_round": ms,
                        "plain_ms_per_token": ms_per_token, "ratio": ms / ms_per_token,
                        "nodes_per_round": r["nodes_per_round"]})
    return out


def spec_table(report: dict) -> str:
    rows = [(r["method"], r["k"], r["kind"], r["batch"], r["tokens_per_s"], r["speedup"],
             r.get("expected_speedup", float("nan")), r["mean_accepted"],
             " ".join(f"{a:.2f}" for a in r["acceptance"][:6]))
            for r in report["runs"]]
    return format_table([("method", "<11"), ("k", ">2"), ("kind", "<8"), ("batch", ">5"),
                         ("tok/s", ">7.1f"), ("speedup", ">7.2f"), ("expected", ">8.2f"),
                         ("tok/round", ">9.2f"), ("acceptance by position", "<30")], rows)


# ----------------------------------------------------------------------------- command line

HELP = "speculative decoding: acceptance and speedup of every drafter"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``minillm bench spec``'s options (the shared ones: :func:`.common.add_common_args`)."""
    from .spec_load import BUDGETS, MAX_NEW_TOKENS, NUM_REQUESTS, RATES  # spec_load imports us

    parser.add_argument("--methods", nargs="+", default=None,
                        help=f"(default: {' '.join(ALL_METHODS)}; with --part1: "
                             f"{' '.join(METHODS)})")
    parser.add_argument("--part1", action="store_true",
                        help="chapter 06's run: part I's methods only (no block drafter weights "
                             "needed) and no load sweeps")
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 6, 8],
                        help=f"lookaheads of the k sweep (default: %(default)s; per-kind runs "
                             f"use {DEFAULT_K})")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64],
                        help="batch sizes (default: %(default)s)")
    parser.add_argument("--prompts-per-kind", type=int, default=3, help="(default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument("--dtype", default=None, help="default: what minillm.LLM picks")
    load = parser.add_argument_group("speculation under load (figure: the --figure path + _load)")
    parser.add_argument("--auto", action="store_true",
                        help="each method with num_speculative_tokens='auto' at every batch "
                             "size, instead of the fixed lookaheads (no load sweeps)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="with --auto: rounds of alternating plain and speculative runs at "
                             "batch > 1, speedup = their median (default: %(default)s)")
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


def main(args: argparse.Namespace) -> int:
    """Run ``minillm bench spec``; print the tables, write the JSON and the two plots."""
    from pathlib import Path

    import matplotlib.pyplot as plt

    from ..viz import save
    from ..viz.bench import plot_spec, plot_spec_load
    from .spec_load import spec_load_tables

    methods = args.methods or list(METHODS if args.part1 else ALL_METHODS)
    load = args.load and not args.part1 and not args.auto
    report = run_spec_bench(args.model, methods, args.ks, args.batches,
                            args.prompts_per_kind, args.max_tokens, args.device, args.dtype,
                            args.threads, log=log_to_stderr,
                            load=load and {"budgets": args.budgets, "rates": args.rates,
                                           "num_requests": args.load_requests,
                                           "max_tokens": args.load_tokens},
                            auto=args.auto, repeats=args.repeats)
    write_report(args, report, f"{spec_table(report)}\n\n{spec_load_tables(report)}", plot_spec)
    if load and args.figure != "none":
        path = Path(args.figure)
        fig = plot_spec_load(report)
        print(f"wrote {save(fig, path.with_name(f'{path.stem}_load{path.suffix}'), dpi=110)}")
        plt.close(fig)
    return 0
