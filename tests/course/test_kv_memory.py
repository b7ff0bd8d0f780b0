"""KV memory calculator against numbers computed by hand."""
import pytest

from minillm.config import PRESETS
from minillm.course.ch02_kv_memory import DEEPSEEK_V2, kv_cache_bytes, kv_memory_table


def test_llama3_8b_by_hand():
    cfg = PRESETS["llama-3-8b"]
    assert kv_cache_bytes(cfg, tokens=1, batch=1) == 2 * 32 * 8 * 128 * 2 == 131072
    assert kv_cache_bytes(cfg, tokens=8192, batch=1) == 2**30          # 1 GiB at 8k context
    assert kv_cache_bytes(cfg, tokens=1000, batch=3, bytes_per_elem=4) == 131072 * 2 * 3000


def test_other_models_by_hand():
    assert kv_cache_bytes(PRESETS["llama-3-70b"], 1, 1) == 2 * 80 * 8 * 128 * 2
    assert kv_cache_bytes(PRESETS["smollm2-135m"], 1, 1) == 2 * 30 * 3 * 64 * 2
    assert kv_cache_bytes(DEEPSEEK_V2, 1, 1) == 60 * (512 + 64) * 2 == 69120


def test_table():
    rows = kv_memory_table(context_len=4096, batch=8)
    by_name = {row["model"]: row for row in rows}
    assert list(by_name) == ["smollm2-135m", "llama-3-8b", "llama-3-70b", "deepseek-v2"]
    llama = by_name["llama-3-8b"]
    assert llama["attention"] == "GQA 32q/8kv"
    assert llama["kv_bytes"] == 131072 * 4096 * 8
    assert llama["kv_gib"] == pytest.approx(4.0)
    assert llama["mha_bytes_per_token"] == 4 * llama["bytes_per_token"]
    ds = by_name["deepseek-v2"]
    assert ds["attention"] == "MLA 512+64"
    assert ds["bytes_per_token"] < llama["bytes_per_token"]
    assert ds["mha_bytes_per_token"] == 2 * 60 * 128 * 128 * 2


def test_bad_input():
    with pytest.raises(ValueError, match="tokens"):
        kv_cache_bytes(PRESETS["llama-3-8b"], tokens=-1, batch=1)
    with pytest.raises(ValueError, match="batch"):
        kv_cache_bytes(PRESETS["llama-3-8b"], tokens=1, batch=0)
