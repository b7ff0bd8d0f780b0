"""bench disagg's arithmetic on hand-made records (the run itself is the benchmark's)."""
from __future__ import annotations

import pytest

from minillm.bench.disagg import disagg_summary, transfer_summary
from minillm.cli import build_parser
from minillm.driver import RequestRecord


def test_summary_counts_only_requests_meeting_both_slos():
    rec = [RequestRecord("0", 0.0, 4, 0.5, 1.5, 11),     # TPOT 0.1: ok
           RequestRecord("1", 1.0, 4, 4.0, 5.0, 11),     # TTFT 3 s: late
           RequestRecord("2", 2.0, 4, 2.2, 8.2, 11)]     # TPOT 0.6: slow
    s = disagg_summary(rec, slo_ttft=2.0, slo_tpot=0.2)
    assert s["attainment"] == pytest.approx(1 / 3)
    assert s["slo_met_per_s"] == pytest.approx(1 / 8.2)
    assert s["ttft_mean"] == pytest.approx((0.5 + 3.0 + 0.2) / 3)
    assert s["output_tok_s"] == pytest.approx(33 / 8.2)


def test_transfer_time_splits_into_exposed_and_hidden():
    t = {"a": {"sent": {"start": 1.0, "kv_ready": 1.8, "error": None},
               "received": {"bytes": 100, "end": 2.0, "error": None}},
         "b": {"sent": {"start": 3.0, "kv_ready": 3.0, "error": None},
               "received": {"bytes": 50, "end": 3.5, "error": None}}}
    s = transfer_summary(t)
    assert s["kv_bytes"] == 150
    assert s["exposed_s_mean"] == pytest.approx((0.2 + 0.5) / 2)
    assert s["hidden_fraction"] == pytest.approx(1 - 0.7 / 1.5)


def test_the_cli_takes_the_options():
    args = build_parser().parse_args(["bench", "disagg", "--num-requests", "4", "--rate", "2"])
    assert args.num_requests == 4 and args.rate == 2.0


def test_bench_prefix_workload_shares_its_system_prompts():
    from minillm.checkpoint.loader import smollm2_tokenizer
    from minillm.workloads import shared_prompt_workload

    tok = smollm2_tokenizer()
    work = shared_prompt_workload(tok, 6, 120, num_systems=2)
    head = [len(p) for p in work.prompts]
    assert all(n > 120 for n in head)
    same = [p[:100] for p in work.prompts]
    assert same[0] == same[2] == same[4] and same[1] == same[3] and same[0] != same[1]
    args = build_parser().parse_args(["bench", "prefix", "--rates", "1", "4"])
    assert args.rates == [1.0, 4.0]
