"""The tiered KV store (chapter 08): chunk keys, disk entries with checksums and atomic writes,
byte caps with LRU, and the engine serving from it: the same greedy tokens as a cold run, with the
store's KV, after eviction from the device, after a restart (a second process), and when disk
entries are corrupt, missing or cannot be written (recompute, never wrong KV, no leaked block)."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from engine_checks import assert_all_free, prompts_of, run_all, sharp_model
from hypothesis import given, settings
from hypothesis import strategies as st
from properties import examples

from minillm import SamplingParams
from minillm.cache import offload
from minillm.cache.offload import (
    DiskTier,
    MemoryTier,
    OffloadConfig,
    chunk_keys,
    decode_entry,
    encode_entry,
)
from minillm.engine import EngineConfig, LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SYSTEM = list(range(100, 197))                   # 96 shared tokens + 1
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model():
    return sharp_model(max_seq_len=512)


def prompts():
    return [SYSTEM + q for q in prompts_of([5, 9, 17, 3], seed=4)]


def cold(model, ps):
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=300, block_size=8))
    return [o.token_ids for o in run_all(engine, ps, GREEDY)]


def offload_engine(model, num_kv_blocks=20, **store):
    store = {"cpu_bytes": 1 << 26, "chunk_tokens": 16, **store}
    return LLMEngine(model, None, EngineConfig(num_kv_blocks=num_kv_blocks, block_size=8,
                                               enable_prefix_caching=True, kv_offload=store))


FILLER = prompts_of([140], seed=9)[0]             # takes most of a 20-block pool


def one_by_one(engine, ps, evict=True):
    """Each prompt run alone, in turn (so each can reuse what the previous ones stored); with
    ``evict``, an unrelated prompt runs in between and evicts the cached blocks from the device."""
    outs = []
    for p in ps:
        outs.append(run_all(engine, [p], GREEDY)[0])
        if evict:
            run_all(engine, [FILLER], GREEDY)
    return outs


# ---- keys and entries ------------------------------------------------------------------------
def test_chunk_keys_cover_the_prefix():
    a = chunk_keys(list(range(40)), 8)
    b = chunk_keys([999] + list(range(1, 40)), 8)
    assert len(a) == 5 and len(set(a)) == 5
    assert all(x != y for x, y in zip(a, b))      # equal later chunks, another first chunk
    assert chunk_keys(list(range(47)), 8) == a   # a partial chunk has no key
    assert chunk_keys(list(range(40)), 8, b"other model") != a


def test_chunk_keys_are_the_same_in_another_process():
    code = "from minillm.cache.offload import chunk_keys; print(chunk_keys(list(range(40)), 8))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=os.environ | {"PYTHONHASHSEED": "123"}).stdout
    assert out.strip() == str(chunk_keys(list(range(40)), 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_entry_round_trip_is_bitwise(dtype):
    kv = torch.randn(2, 3, 16, 2, 8).to(dtype)
    back = decode_entry(encode_entry(kv, "k"), "k")
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), kv.view(torch.uint8))


def test_a_damaged_entry_is_rejected():
    raw = encode_entry(torch.randn(2, 1, 4, 1, 8), "k")
    flipped = bytearray(raw)
    flipped[-5] ^= 1
    for bad, why in [(bytes(flipped), "checksum"), (raw[:-3], "truncated"), (b"junk", "entry")]:
        with pytest.raises(ValueError, match=why):
            decode_entry(bad, "k")
    with pytest.raises(ValueError, match="wrong key"):
        decode_entry(raw, "other")


# ---- tiers ---------------------------------------------------------------------------------
@settings(max_examples=examples(40))
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 6), st.booleans()), max_size=40),
       st.integers(4, 40))
def test_memory_tier_keeps_its_cap_and_evicts_lru(ops, capacity):
    tier, order = MemoryTier(capacity * 4), []     # float32: 4 bytes an element
    for key, size, read in ops:
        name = str(key)
        if read:
            if tier.get(name) is not None:
                order.remove(name)
                order.append(name)
            continue
        if name in tier or size > capacity:
            continue
        while sum(tier.entries[k].numel() for k in order) + size > capacity:
            order.pop(0)                           # the least recently used goes first
        tier.put(name, torch.zeros(size))
        order.append(name)
        assert list(tier.entries) == order and tier.used <= tier.capacity


def test_disk_tier_round_trip_eviction_and_restart(tmp_path):
    kvs = {f"{i:02d}": torch.randn(2, 2, 8, 1, 4).to(torch.bfloat16) for i in range(4)}
    size = len(encode_entry(kvs["00"], "00"))
    disk = DiskTier(tmp_path, capacity=3 * size)
    for key, kv in kvs.items():
        disk.put(key, kv)
        disk.flush()
    assert list(disk.index) == ["01", "02", "03"] and disk.stats.evictions == 1
    assert not (tmp_path / "00.kv").exists() and disk.used <= 3 * size
    assert torch.equal(disk.get("02").view(torch.uint8), kvs["02"].view(torch.uint8))
    (tmp_path / ".tmp-01-999").write_bytes(encode_entry(kvs["01"], "01")[:50])   # a crash
    again = DiskTier(tmp_path, capacity=3 * size)   # a restart finds the entries
    assert set(again.index) == {"01", "02", "03"}
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    assert torch.equal(again.get("03").view(torch.uint8), kvs["03"].view(torch.uint8))


def test_disk_tier_detects_corrupt_truncated_and_missing_files(tmp_path):
    disk = DiskTier(tmp_path, capacity=1 << 20)
    for key in "abc":
        disk.put(key, torch.randn(2, 1, 8, 1, 4))
    disk.flush()
    raw = bytearray((tmp_path / "a.kv").read_bytes())
    raw[-1] ^= 0xFF
    (tmp_path / "a.kv").write_bytes(bytes(raw))
    (tmp_path / "b.kv").write_bytes(bytes(raw[:40]))
    (tmp_path / "c.kv").unlink()
    assert disk.get("a") is None and disk.get("b") is None and disk.get("c") is None
    assert disk.stats.corrupt == 3 and not disk.index
    assert not list(tmp_path.glob("*.kv"))            # a bad entry is deleted


def test_a_full_disk_drops_writes_and_keeps_going(tmp_path, monkeypatch):
    def full(tmp, final, data):
        tmp.write_bytes(data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(offload, "write_atomic", full)
    disk = DiskTier(tmp_path, capacity=1 << 20)
    disk.put("a", torch.randn(2, 1, 8, 1, 4))
    disk.flush()
    assert disk.stats.write_errors == 1 and not disk.index and disk.get("a") is None
    assert not list(tmp_path.iterdir())               # the partial temporary file is gone


def test_a_write_that_raises_is_dropped_and_the_writer_goes_on(tmp_path, monkeypatch):
    """Any error while writing one entry (not only a full disk) drops that entry; the writer
    thread keeps going, so later writes land and flush returns."""
    real = offload.encode_entry
    calls = []

    def flaky(kv, key):
        calls.append(key)
        if key == "a":
            raise RuntimeError("encoding failed")
        return real(kv, key)

    monkeypatch.setattr(offload, "encode_entry", flaky)
    disk = DiskTier(tmp_path, capacity=1 << 20)
    disk.put("a", torch.randn(2, 1, 8, 1, 4))
    disk.put("b", torch.randn(2, 1, 8, 1, 4))
    flusher = threading.Thread(target=disk.flush, daemon=True)
    flusher.start()
    flusher.join(timeout=30)
    assert not flusher.is_alive(), "flush hung: the writer thread died"
    assert calls == ["a", "b"] and disk.stats.write_errors == 1
    assert disk.get("a") is None and disk.get("b") is not None


@pytest.mark.parametrize("options, match", [
    ({"cpu_bytes": -1}, "cpu_bytes"),
    ({"cpu_bytes": 0}, "stores nothing"),
    ({"cpu_bytes": 1 << 60}, "cpu_bytes.*memory"),
    ({"chunk_tokens": 0}, "chunk_tokens"),
    ({"disk_dir": "/tmp/x", "disk_bytes": 0}, "disk_bytes"),
    ({"cpu_size": 1}, "unknown option"),
])
def test_bad_offload_options_name_the_parameter(options, match):
    with pytest.raises(ValueError, match=match):
        OffloadConfig.from_options(options)


def test_bad_disk_directories_name_the_parameter(tmp_path, model):
    afile = tmp_path / "a_file"
    afile.write_text("x")
    for bad in (afile, afile / "below"):
        with pytest.raises(ValueError, match="disk_dir"):
            DiskTier(bad, 1 << 20)
    with pytest.raises(ValueError, match="disk_bytes.*larger than the disk"):
        DiskTier(tmp_path, 1 << 62)
    with pytest.raises(ValueError, match="multiple of block_size"):
        offload_engine(model, chunk_tokens=12)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_offload={"cpu_bytes": 1 << 20})
    with pytest.raises(ValueError, match="cpu_bytes .* holds no chunk"):
        offload_engine(model, cpu_bytes=100)


@pytest.mark.parametrize("options, match", [({"num_kv_blocks": 1 << 40}, "num_kv_blocks"),
                                            ({"kv_cache_memory": 1 << 60}, "kv_cache_memory"),
                                            ({"num_kv_blocks": 0}, "num_kv_blocks"),
                                            ({"preemption": "swap", "swap_space": 1e9},
                                             "swap_space")])
def test_pools_larger_than_memory_are_refused(model, options, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(model, None, EngineConfig(block_size=8, **options))


# ---- the engine ------------------------------------------------------------------------------
def test_pool_gather_and_scatter_are_bitwise(model):
    engine = offload_engine(model)
    pool = engine.runner.pool
    pool.k.normal_()
    pool.v.normal_()
    kv = pool.gather([3, 7, 1])
    pool.write_blocks(torch.tensor([10, 11, 12]), kv)
    assert torch.equal(pool.gather([10, 11, 12]), kv)
    for layer in range(pool.k.shape[0]):
        pool.write_layer(layer, torch.tensor([13, 14, 15]), kv[0, layer], kv[1, layer])
    assert torch.equal(pool.gather([13, 14, 15]), kv)


@pytest.mark.parametrize("layerwise", [False, True])
def test_served_from_the_store_after_device_eviction(model, layerwise):
    ps = prompts()
    engine = offload_engine(model, layerwise=layerwise)   # 20 blocks: one prompt's worth
    outs = one_by_one(engine, ps)
    assert [o.token_ids for o in outs] == cold(model, ps)
    stats = engine.offload.stats()
    assert stats["loads"] >= 2 and stats["store_to_device_bytes"] > 0
    assert all(o.metrics.cached_tokens >= 96 for o in outs[1:])
    assert engine.blocks.prefix_hit < sum(o.metrics.cached_tokens for o in outs)   # store hits
    assert_all_free(engine)


def test_corrupt_and_missing_disk_entries_are_recomputed(model, tmp_path):
    ps = prompts()
    first = offload_engine(model, disk_dir=str(tmp_path))
    one_by_one(first, ps[:1], evict=False)
    first.offload.flush()
    files = sorted(tmp_path.glob("*.kv"))
    assert len(files) == 6                                   # 96 tokens / 16 a chunk
    raw = bytearray(files[2].read_bytes())
    raw[len(raw) // 2] ^= 0x10
    files[2].write_bytes(bytes(raw))
    files[4].unlink()
    second = offload_engine(model, disk_dir=str(tmp_path))   # a fresh CPU tier
    outs = one_by_one(second, ps[1:])
    assert [o.token_ids for o in outs] == cold(model, ps[1:])
    stats = second.offload.stats()["disk"]
    assert stats["corrupt"] >= 1 and stats["hits"] >= 2
    assert_all_free(second)


def test_a_full_disk_does_not_stop_the_engine(model, tmp_path, monkeypatch):
    def full(tmp, final, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(offload, "write_atomic", full)
    engine = offload_engine(model, disk_dir=str(tmp_path))
    outs = one_by_one(engine, prompts())
    engine.offload.flush()
    assert [o.token_ids for o in outs] == cold(model, prompts())
    assert engine.offload.stats()["disk"]["write_errors"] > 0
    assert_all_free(engine)


RESTART = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from engine_checks import run_all, sharp_model
    from minillm import SamplingParams
    from minillm.engine import EngineConfig, LLMEngine
    engine = LLMEngine(sharp_model(max_seq_len=512, seed={seed}), None, EngineConfig(
        num_kv_blocks=20, block_size=8, enable_prefix_caching=True,
        kv_offload=dict(cpu_bytes=1 << 26, chunk_tokens=16, disk_dir={disk!r})))
    out = run_all(engine, [{prompt}], SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True))[0]
    print(json.dumps([out.token_ids, out.metrics.cached_tokens]))
""")


def run_process(disk, prompt, seed=3):
    code = RESTART.format(tests=str(ROOT / "tests"), disk=str(disk), prompt=prompt, seed=seed)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    return eval(out.strip().splitlines()[-1])


def test_a_second_process_reuses_the_disk_tier(model, tmp_path):
    ps = prompts()
    tokens, cached = run_process(tmp_path, ps[0])          # writes, flushes at exit
    assert cached == 0 and len(list(tmp_path.glob("*.kv"))) == 6
    tokens, cached = run_process(tmp_path, ps[1])
    assert cached == 96 and tokens == cold(model, ps[1:2])[0]
    tokens, cached = run_process(tmp_path, ps[1], seed=5)  # another model: no match
    assert cached == 0


def test_a_failing_layerwise_load_raises_instead_of_hanging(model, monkeypatch):
    engine = offload_engine(model)
    one_by_one(engine, prompts()[:1])

    def broken(*args):
        raise OSError("device gone")

    monkeypatch.setattr(engine.runner.pool, "write_layer", broken)
    engine.add_request(prompts()[1], GREEDY)
    with pytest.raises(RuntimeError, match="loading stored KV failed"):
        while engine.has_unfinished():
            engine.step()


def test_a_disk_only_store_serves_from_files(model, tmp_path):
    ps = prompts()
    engine = offload_engine(model, cpu_bytes=0, disk_dir=str(tmp_path))
    outs = one_by_one(engine, ps)
    assert [o.token_ids for o in outs] == cold(model, ps)
    stats = engine.offload.stats()
    assert stats["cpu"]["puts"] == 0 and stats["disk"]["hits"] > 0 and stats["tokens_loaded"] > 0
    assert_all_free(engine)
