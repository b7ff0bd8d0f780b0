"""The KV connector seam (``minillm.engine.connector``): the runner calls its worker half
around the forward pass and around every layer, on the eager path and the CPU fast path alike;
a connector written here (prompt KV kept in a dict) serves later requests the same greedy tokens
as a cold engine; a load that comes short sits the step out and is recomputed; a connector that
breaks its contract fails that request alone; and no feature hooks the model's modules."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_checks import assert_all_free, prompts_of, run_all, sharp_model

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine, cpu_forward
from minillm.engine.connector import KVConnector

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BS = 8
SYSTEM = list(range(100, 141))                  # 40 shared tokens + 1
ROOT = Path(__file__).resolve().parents[2]


class DictConnector(KVConnector):
    """Every full block a step computes, kept by the tokens up to its end; later prompts that
    start with them are loaded from here. ``short``: loads keep only their first block (as a
    store with a lost entry would), once. ``calls``: what the runner called, in order."""

    def __init__(self, short: bool = False) -> None:
        self.kv: dict[tuple[int, ...], torch.Tensor] = {}
        self.pending: dict[int, tuple] = {}
        self.calls: list = []
        self.short = short
        self.loaded = 0
        self.scramble = False           # load each block's KV plus noise (wrong KV)

    def num_external_tokens(self, seq, device_tokens):
        n, ids = 0, seq.token_ids
        while (n + 1) * BS <= len(ids) - 1 and tuple(ids[:(n + 1) * BS]) in self.kv:
            n += 1
        return n * BS

    def on_allocated(self, seq, device_tokens):
        if seq.num_computed > device_tokens:
            self.pending[seq.seq_id] = (seq, device_tokens)

    def build_meta(self, plan):
        meta = [self.pending[w.seq.seq_id] for w in plan.seqs if w.seq.seq_id in self.pending]
        self.pending.clear()
        return meta

    def register_kv_pool(self, pool, tables):
        self.pool, self.tables = pool, tables

    def start_load(self, plan):
        self.calls.append("start")
        self.plan, self.sat_out = plan, {}
        for seq, device_tokens in plan.connector_meta:
            end = seq.num_computed
            if self.short:
                end, self.short = device_tokens + BS, False
                self.sat_out[seq.seq_id] = self.short_end = end
            for pos in range(device_tokens, end, BS):
                block = self.tables[seq.seq_id][pos // BS]
                kv = self.kv[tuple(seq.token_ids[:pos + BS])]
                if self.scramble:
                    kv = kv + torch.randn_like(kv)
                self.pool.write_blocks(torch.tensor([block]), kv)
                self.loaded += BS
        return dict(self.sat_out)

    def wait_for_layer(self, layer):
        self.calls.append(("wait", layer))

    def save_layer(self, layer):
        self.calls.append(("save", layer))

    def wait_for_save(self):
        self.calls.append("done")
        for w in self.plan.seqs:
            s = w.seq
            if s.seq_id in self.sat_out:
                continue
            for b in range((s.num_computed + w.num_tokens) // BS):
                key = tuple(s.token_ids[:(b + 1) * BS])
                if key not in self.kv:
                    self.kv[key] = self.pool.gather([self.tables[s.seq_id][b]])


def engine_with(model, connector, **kw):
    return LLMEngine(model, None, EngineConfig(num_kv_blocks=24, block_size=BS,
                                               enable_prefix_caching=True,
                                               kv_connector=connector, **kw))


def prompts():
    return [SYSTEM + q for q in prompts_of([5, 9, 13], seed=4)]


FILLER = prompts_of([180], seed=9)[0]        # evicts the cached blocks from a 24-block pool


def one_by_one(engine, ps):
    outs = []
    for p in ps:
        outs.append(run_all(engine, [p], GREEDY)[0])
        run_all(engine, [FILLER], GREEDY)
    return outs


@pytest.fixture(scope="module")
def model():
    return sharp_model(max_seq_len=512, vocab_size=2048)      # float64: context shows


@pytest.fixture(scope="module")
def model32():
    return sharp_model(torch.float32, max_seq_len=512)         # the CPU fast path's dtype


@pytest.fixture(scope="module")
def cold(model):
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=200, block_size=BS))
    return [o.token_ids for o in run_all(engine, prompts(), GREEDY)]


@pytest.mark.parametrize("fuse_ops", [True, False])
def test_the_runner_calls_the_connector_around_every_layer(model32, monkeypatch, fuse_ops):
    model = model32
    fast = []
    real = cpu_forward.CpuForward.__call__
    monkeypatch.setattr(cpu_forward.CpuForward, "__call__",
                        lambda *a, **k: fast.append(1) or real(*a, **k))
    connector = DictConnector()
    engine = engine_with(model, connector, attention_backend="cpu", fuse_ops=fuse_ops)
    run_all(engine, prompts()[:1], GREEDY)
    layers = [c for i in range(model.cfg.n_layers) for c in (("wait", i), ("save", i))]
    steps = len(engine.trace)
    assert connector.calls == (["start"] + layers + ["done"]) * steps
    if fuse_ops and engine.runner.cpu_forward.applies():
        assert len(fast) == steps                 # the fast path calls the connector too
    else:
        assert not fast


def test_a_connector_of_our_own_serves_the_same_greedy_tokens(model, cold):
    connector = DictConnector()
    engine = engine_with(model, connector)
    outs = one_by_one(engine, prompts())
    assert [o.token_ids for o in outs] == cold
    assert connector.loaded >= 2 * 32                 # most of the 40 shared tokens, twice
    assert all(o.metrics.cached_tokens >= 40 for o in outs[1:])
    assert_all_free(engine)


def test_wrong_loaded_kv_changes_the_tokens(model, cold):
    """The check above can fail: the same connector adding noise to the KV it loads gives
    other tokens."""
    connector = DictConnector()
    engine = engine_with(model, connector)
    one_by_one(engine, prompts()[:1])
    connector.scramble = True
    assert run_all(engine, prompts()[1:2], GREEDY)[0].token_ids != cold[1]
    assert connector.loaded >= 32


def test_a_short_load_sits_the_step_out_and_is_recomputed(model, cold):
    connector = DictConnector()
    engine = engine_with(model, connector)
    one_by_one(engine, prompts()[:1])
    connector.short = True
    out = run_all(engine, prompts()[1:2], GREEDY)[0]
    assert not connector.short                         # the short load happened
    assert out.token_ids == cold[1]
    assert out.metrics.cached_tokens == connector.short_end < 40
    assert_all_free(engine)


class Overclaiming(DictConnector):
    def num_external_tokens(self, seq, device_tokens):
        return len(seq.token_ids)                      # the last token too: not allowed


def test_a_connector_breaking_its_contract_fails_that_request_alone(model, cold):
    engine = engine_with(model, Overclaiming())
    bad = engine.add_request(prompts()[0], GREEDY)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs[bad].outputs[0].finish_reason == "error"
    assert "Overclaiming.num_external_tokens" in outs[bad].error
    assert "never the last token" in outs[bad].error
    assert_all_free(engine)
    good = LLMEngine(model, None, EngineConfig(num_kv_blocks=24, block_size=BS,
                                               kv_connector=Overclaiming()))
    # without a prefix cache the connector's scheduler half is never asked: no failure
    assert run_all(good, prompts()[:1], GREEDY)[0].token_ids == cold[0]


def test_kv_offload_and_kv_connector_are_exclusive():
    with pytest.raises(ValueError, match="kv_offload or kv_connector"):
        EngineConfig(enable_prefix_caching=True, kv_offload={"cpu_bytes": 1 << 20},
                     kv_connector=DictConnector())
    with pytest.raises(ValueError, match="kv_connector must be"):
        EngineConfig(kv_connector=object())


def test_no_feature_hooks_the_models_modules():
    """Features talk to the forward pass through the runner's explicit calls; only the
    quantizer's calibration (outside any engine) hooks modules."""
    hooked = [str(p.relative_to(ROOT)) for p in (ROOT / "minillm").rglob("*.py")
              if "register_forward" in p.read_text() or "_forward_hooks" in p.read_text()]
    assert hooked == ["minillm/quant/quantize.py"]
