"""Colocated against disaggregated serving (``python -m minillm bench disagg``; chapter 07).

One seeded workload (long-tailed prompt and output lengths, Poisson arrivals on the wall
clock) is served three ways on the same cores: the colocated engine (``minillm.LLM``, every
thread in one process, chunked prefill), and a 1P1D pair (:class:`minillm.disagg.DisaggLLM`,
one prefill and one decode process, the threads split) sending the prompt KV whole after the
prefill and layer by layer during it. Per run: TTFT and TPOT percentiles, the fraction of
requests meeting both SLOs and those requests per second of the run (``slo_met_per_s``), output
tokens/s; for the pairs, the KV bytes moved and per request the transfer time and the part of
it that was exposed (the decode side had the KV that long after the prefill ended) or hidden.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

from ..device import serving_dtype
from ..driver import RequestRecord, drive
from ..runinfo import machine_info
from ..serving_metrics import SLO, percentile, slo_attainment
from ..workloads import Workload, poisson_arrivals, sharegpt_like_workload
from .common import format_table, use_threads, write_report

SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.2


def disagg_summary(records: list[RequestRecord], slo_ttft: float, slo_tpot: float) -> dict:
    """Percentiles of TTFT and TPOT (s), SLO attainment and the requests meeting both SLOs per
    second of the run (:func:`~minillm.serving_metrics.slo_attainment`), tokens/s."""
    ttft, tpot = [r.ttft for r in records], [r.tpot for r in records]
    span = max(r.finished for r in records) - min(r.arrival for r in records)
    attainment, met_per_s = slo_attainment(zip(ttft, tpot), SLO(slo_ttft, slo_tpot),
                                           len(records), span)
    return {"ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "ttft_mean":
            statistics.fmean(ttft), "tpot_p50": percentile(tpot, 50),
            "tpot_p90": percentile(tpot, 90),
            "tpot_mean": statistics.fmean(tpot), "attainment": attainment,
            "slo_met_per_s": met_per_s, "output_tok_s": sum(r.output_len for r in records) / span,
            "makespan": span}


def serve_wall(server, work: Workload, arrivals: list[float]) -> list[RequestRecord]:
    """A warm-up of two short requests, then ``work`` at ``arrivals`` on the wall clock
    (:func:`minillm.driver.drive`); the per-request records."""
    drive(server, Workload(work.prompts[:2], [4, 4]), clock="wall")
    if hasattr(server, "transfers"):
        server.transfers.clear()
    return drive(server, work, arrivals=arrivals, clock="wall").records


def transfer_summary(transfers: dict[str, dict]) -> dict:
    """KV bytes moved and per-request transfer / exposed / hidden seconds (means)."""
    rows = []
    for t in transfers.values():
        sent, got = t.get("sent"), t.get("received")
        if not sent or not got or sent["error"] or got["error"] or sent["kv_ready"] is None:
            continue
        total = got["end"] - min(sent["start"], sent["kv_ready"])
        exposed = max(0.0, got["end"] - sent["kv_ready"])
        rows.append((got["bytes"], total, exposed))
    if not rows:
        return {"requests": 0}
    return {"requests": len(rows), "kv_bytes": sum(r[0] for r in rows),
            "transfer_s_mean": statistics.fmean(r[1] for r in rows),
            "exposed_s_mean": statistics.fmean(r[2] for r in rows),
            "hidden_fraction": 1 - sum(r[2] for r in rows) / max(1e-9, sum(r[1] for r in rows))}


def run_disagg_bench(model: str = "smollm2-135m", num_requests: int = 16, rate: float = 1.0,
                     prompt_median: int = 400, prompt_max: int = 1200, output_median: int = 32,
                     dtype=None, seed: int = 0, slo_ttft: float = SLO_TTFT_S,
                     slo_tpot: float = SLO_TPOT_S, random_weights: bool = False,
                     **engine_options) -> dict:
    """Serve one workload colocated and by 1P1D (whole and layerwise); see the module doc."""
    from ..checkpoint.loader import smollm2_tokenizer
    from ..disagg import DisaggLLM
    from ..engine.llm import LLM

    threads = torch.get_num_threads()
    dtype, reason = serving_dtype(dtype, torch.device("cpu"))
    work = sharegpt_like_workload(smollm2_tokenizer(), num_requests, prompt_median,
                                  output_median, prompt_max=prompt_max, output_max=128,
                                  seed=seed)
    arrivals = poisson_arrivals(num_requests, rate, seed)
    opts = {"max_num_seqs": 32, "max_num_batched_tokens": 512, **engine_options}
    load = [os.getloadavg()[0]]
    report = {"machine": machine_info(torch.device("cpu"), threads), "dtype": str(dtype),
              "dtype_reason": reason, "workload": {"num_requests": num_requests, "rate": rate,
              "prompt_lens": [len(p) for p in work.prompts], "output_lens": work.output_lens},
              "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot}, "options": opts, "runs": {}}
    llm = LLM(model, dtype=dtype, random_weights=random_weights, **opts)
    rec = serve_wall(llm, work, arrivals)
    report["runs"]["colocated"] = disagg_summary(rec, slo_ttft, slo_tpot)
    del llm
    for name, layerwise in (("1P1D whole", False), ("1P1D layerwise", True)):
        with DisaggLLM(model, num_decode=1, layerwise=layerwise, dtype=dtype,
                       random_weights=random_weights, threads=max(1, threads // 2),
                       **opts) as pair:
            rec = serve_wall(pair, work, arrivals)
            report["runs"][name] = {**disagg_summary(rec, slo_ttft, slo_tpot),
                                    **transfer_summary(pair.transfers)}
        load.append(os.getloadavg()[0])
    report["load_average"] = load
    return report


def disagg_table(report: dict) -> str:
    rows = [(name, r["ttft_p50"], r["ttft_p90"], r["tpot_p50"] * 1e3, r["tpot_p90"] * 1e3,
             r["attainment"], r["slo_met_per_s"], r["output_tok_s"], r.get("kv_bytes", 0) / 2**20,
             r.get("transfer_s_mean", 0) * 1e3, r.get("exposed_s_mean", 0) * 1e3)
            for name, r in report["runs"].items()]
    cols = [("run", "s"), ("TTFT p50 s", ".2f"), ("p90", ".2f"), ("TPOT p50 ms", ".1f"),
            ("p90", ".1f"), ("SLO met", ".2f"), ("SLO met req/s", ".2f"), ("tok/s", ".1f"),
            ("KV MiB", ".1f"), ("transfer ms", ".1f"), ("exposed ms", ".1f")]
    return format_table(cols, rows)


# ----------------------------------------------------------------------------- command line

HELP = ("colocated serving vs a 1P1D disaggregated pair (KV whole and layer by layer) on one "
        "Poisson workload")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``minillm bench disagg``'s options (the shared ones: :func:`.common.add_common_args`)."""
    parser.add_argument("--num-requests", type=int, default=16, help="(default: %(default)s)")
    parser.add_argument("--rate", type=float, default=1.0,
                        help="requests/s (default: %(default)s)")
    parser.add_argument("--prompt-median", type=int, default=400, help="(default: %(default)s)")
    parser.add_argument("--prompt-max", type=int, default=1200, help="(default: %(default)s)")
    parser.add_argument("--output-median", type=int, default=32, help="(default: %(default)s)")
    parser.add_argument("--dtype", default=None, help="default: what minillm.LLM picks")


def main(args: argparse.Namespace) -> int:
    """Run ``minillm bench disagg``; print the table, write the JSON and the plot."""
    from ..viz.bench import plot_disagg

    use_threads(args)
    report = run_disagg_bench(args.model, args.num_requests, args.rate, args.prompt_median,
                              args.prompt_max, args.output_median, args.dtype)
    return write_report(args, report, disagg_table(report), plot_disagg)
