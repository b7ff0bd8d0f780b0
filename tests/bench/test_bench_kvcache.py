"""bench kvcache's parts on the tiny random model (fast): the perplexity rows are the
contiguous reference's, and with the same KV memory an int8 cache holds more tokens and runs
more requests at once than one in the model's dtype."""
from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from minillm.bench import kvcache as bk
from minillm.cache import KVCache
from minillm.evaluate import perplexity, sample_text
from minillm.viz.bench import plot_kvcache


def test_perplexity_rows_start_from_the_plain_cache(tiny):
    model, tok = tiny
    rows = bk.perplexity_rows(model, tok, 96)
    ids = tok.encode(sample_text(96, tok))[:96]
    plain = perplexity(model, ids, lambda n: KVCache(model.cfg, 1, n))
    assert [r["kv_cache_dtype"] for r in rows] == list(bk.PPL_FORMATS)
    assert abs(rows[0]["ppl"] - plain) < 1e-9 * plain and rows[0]["ppl_change"] == 0.0
    assert rows[2]["ppl"] != rows[0]["ppl"]                      # int8 changes the numbers


def test_serving_rows_and_the_report(tiny):
    model, tok = tiny
    rows = bk.serving_rows(model, tok, bk.serving_formats(torch.float32), 1 << 17, 12,
                           (40, 60), (8, 12), max_num_seqs=12, say=lambda _: None)
    by = {r["kv_cache_dtype"]: r for r in rows}
    assert set(by) == {"auto", "bfloat16", "int8"}
    assert by["int8"]["bytes_per_token"] < by["bfloat16"]["bytes_per_token"] \
        < by["auto"]["bytes_per_token"]
    assert by["int8"]["token_capacity"] > 2 * by["auto"]["token_capacity"]
    assert by["int8"]["peak_running"] > by["auto"]["peak_running"]
    report = {"perplexity": bk.perplexity_rows(model, tok, 64), "serving": rows,
              "dtype": "float32", "workload": {"num_requests": 12, "kv_memory_mib": 0.125}}
    assert "int8" in bk.kvcache_table(report)
    plt.close(plot_kvcache(report))
