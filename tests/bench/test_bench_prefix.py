"""bench prefix's tiers and CacheBlend parts on the tiny random model (fast): the numbers the
report holds are consistent with what each configuration can do."""
from __future__ import annotations

import pytest

from minillm.bench import prefix as bp
from minillm.viz.bench import plot_prefix
from minillm.workloads import shared_prompt_workload


@pytest.fixture(scope="module")
def tiers(tiny):
    model, tok = tiny
    work = shared_prompt_workload(tok, 8, 120, num_systems=4)
    # 0.01 req/s: each request ends before the next arrives, so hits do not hang on timing
    return bp.run_tiers(model, tok, work, 0.01, 0, {"max_num_seqs": 8}, device_blocks=20,
                        chunk_tokens=32)


def test_tiers_traffic_matches_each_configuration(tiers):
    runs = tiers["runs"]
    assert runs["device only"]["hit_rate"] == 0.0 and "store" not in runs["device only"]
    whole, layered = runs["CPU, loaded whole"]["store"], runs["CPU, layer by layer"]["store"]
    assert whole["store_to_device_bytes"] > 0 and whole["loads"] > 0
    assert whole["exposed_seconds"] == whole["load_seconds"]           # nothing overlaps
    assert layered["exposed_seconds"] <= layered["load_seconds"]
    assert runs["CPU, layer by layer"]["hit_rate"] > 0
    disk = runs["small CPU + disk"]["store"]["disk"]
    assert disk["bytes_in"] > 0 and disk["write_errors"] == 0
    restart = runs["restart: same disk"]
    assert restart["store"]["disk"]["bytes_out"] > 0
    assert restart["store"]["device_to_cpu_bytes"] == 0
    assert restart["hit_rate"] > runs["small CPU + disk"]["hit_rate"]  # its first visits hit


def test_blend_report_and_plot(tiny, tiers):
    model, tok = tiny
    blend = bp.run_blend(model, tok, num_queries=1, num_passages=3, passage_tokens=40,
                         per_query=2, ratios=(0.3, 1.0), answer_tokens=4)
    m = blend["methods"]
    for name in ("full recompute", "CacheBlend 100%", "prefix caching"):
        assert m[name]["agreement"] == 1.0 and m[name]["token_match"] == 1.0, name
    assert m["full KV reuse"]["recomputed_fraction"] == 0.0
    assert 0.3 < m["CacheBlend 30%"]["recomputed_fraction"] < 1.0
    report = {"tiers": tiers, "blend": blend}
    assert "restart: same disk" in bp.prefix_table(report)
    assert len(plot_prefix(report).axes) >= 2
