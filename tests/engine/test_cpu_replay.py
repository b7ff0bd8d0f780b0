"""Recorded decode steps (``minillm.engine.cpu_replay``): a replayed step computes exactly
what the CPU fast path computes eagerly (the same C++ calls on the same values), and a
recording is dropped or refused whenever it could read the wrong tensors."""
from __future__ import annotations

import pytest
import torch
from minillm.kernels import cpu_bf16_gemv as gemv

import minillm
from minillm.attention.paged import build_metadata, get_paged_backend
from minillm.cache.pool import PagedBatch, PagedKVPool
from minillm.engine import EngineConfig, LLMEngine, cpu_forward
from minillm.engine.cpu_replay import Buffers, StepShape
from minillm.quant import linear as qlinear
from minillm.quant import quantize_model
from minillm.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    not cpu_forward.supports(minillm.load_model("tiny")[0])
    or not qlinear._qmm().available(), reason="the CPU kernels did not build")


@pytest.fixture(autouse=True)
def kernel_rows(monkeypatch):
    """The integer kernels at the rows they take on a VNNI CPU, on any CPU (they run on AVX2
    and in plain C++ too, only slower): the steps below are then all C++."""
    monkeypatch.setattr(qlinear, "KERNEL_ROWS", dict(qlinear.VNNI_KERNEL_ROWS))


def tiny(kind: str) -> torch.nn.Module:
    """The tiny preset with int8 or int4 weights (float32 activations), or in bfloat16."""
    if kind == "bf16":
        return minillm.load_model("tiny", dtype=torch.bfloat16)[0]
    model, _ = minillm.load_model("tiny", dtype=torch.float32)
    return quantize_model(model, kind)


BF16 = pytest.param("bf16", 2, None, marks=pytest.mark.skipif(
    not gemv.available(), reason="no AVX-512 BF16: bfloat16 matmuls stay oneDNN's"))


def decode_steps(model, replay: bool, n_seqs: int, kv_dtype=None, steps: int = 20):
    """``steps`` decode steps of ``n_seqs`` sequences (prompts cached by a first eager step),
    crossing a 16-token block boundary, each block table as long as its sequence needs (as
    the engine grows them): each step's final hidden states, the pool and the forward."""
    cfg, g = model.cfg, torch.Generator().manual_seed(0)
    pool = PagedKVPool(cfg, 4 * n_seqs, 16, model.device, model.dtype, kv_dtype=kv_dtype)
    tables = [[4 * s, 4 * s + 1, 4 * s + 2] for s in range(n_seqs)]
    forward = cpu_forward.CpuForward(model)
    forward.replay = replay
    lens, out = [5 + 3 * s for s in range(n_seqs)], []
    with torch.inference_mode():
        for step in range(steps + 1):
            q_lens = lens if step == 0 else [1] * n_seqs
            ctx = [0] * n_seqs if step == 0 else lens
            grown = [t[:-(-(c + n) // 16)] for t, c, n in zip(tables, ctx, q_lens)]
            meta = build_metadata(grown, ctx, q_lens, 16, model.device,
                                  q_per_kv=cfg.n_heads // cfg.n_kv_heads, direct=True)
            ids = torch.randint(0, cfg.vocab_size, (sum(q_lens),), generator=g)
            pos = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, q_lens)])
            assert forward.applies()
            h, _ = forward(ids, pos, PagedBatch(pool, meta, get_paged_backend("cpu")))
            out.append(h.clone())
            if step:
                lens = [n + 1 for n in lens]
    return out, pool, forward


@pytest.mark.parametrize("kind,n_seqs,kv", [("int4", 1, None), ("int8", 1, None),
                                            ("int8", 3, None), ("int8", 2, torch.int8), BF16])
def test_replayed_steps_equal_the_eager_fast_path_exactly(kind, n_seqs, kv):
    """Every decode step's hidden states and every cached K/V the same to the bit: the
    replay copies each input that changes (embeddings, RoPE's positions, slots, lengths,
    block tables) into what the recording reads; one left stale moves them."""
    model = tiny(kind)
    eager, pool_e, _ = decode_steps(model, False, n_seqs, kv)
    replayed, pool_r, forward = decode_steps(model, True, n_seqs, kv)
    recorded = forward.recorded[StepShape.decode(n_seqs)]
    assert recorded.replays == len(replayed) - 2      # the prefill eager, one step recorded
    for a, b in zip(eager, replayed):
        assert torch.equal(a, b)
    assert torch.equal(pool_e.k, pool_r.k) and torch.equal(pool_e.v, pool_r.v)


def test_engine_serves_the_same_tokens_and_logprobs_replayed():
    """Through the engine (scheduler, sampler, output head), replay on and off: the same
    tokens and log-probabilities for batch 1 and a batch of three."""
    model = tiny("int8")
    engine = LLMEngine(model, None, EngineConfig())
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    results = []
    for replay in (False, True):
        engine.runner.cpu_forward.replay = replay
        ids = [engine.add_request([7 + i, 300, 42 * i + 1], params) for i in range(3)]
        done = {}
        while engine.has_unfinished():
            done |= {o.request_id: o for o in engine.step() if o.finished}
        results.append([(done[i].outputs[0].token_ids, done[i].outputs[0].logprobs)
                        for i in ids])
    assert results[0] == results[1]
    assert engine.runner.cpu_forward.recorded[StepShape.decode(3)].replays > 0


def test_a_recording_is_dropped_when_the_model_changes_and_refused_where_python_runs():
    model = tiny("int8")
    _, _, forward = decode_steps(model, True, 1, steps=3)
    assert forward.recorded
    model.layers[0].attn.wo = torch.nn.Linear(64, 64, bias=False)   # a float linear now
    assert forward.applies() and not forward.recorded
    _, _, forward = decode_steps(model, True, 1, steps=3)
    assert not forward.recorded            # a float matmul is a PyTorch op: not recorded


def test_buffers_of_a_recording_keep_their_shape():
    buffers = Buffers()
    a = buffers.put("x", torch.ones(2, 3))
    assert buffers.put("x", torch.zeros(2, 3)).data_ptr() == a.data_ptr()
    buffers.frozen = True
    with pytest.raises(RuntimeError, match="'x'"):
        buffers.put("x", torch.ones(3, 3))


TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)


def verify_steps(model, replay: bool, steps: int = 6):
    """A prompt each for two sequences, then ``steps`` verify steps: sequence 0 a chain of
    4 rows (1 + 3 drafts), sequence 1 a 4-node tree (``TREE``, as bits), the residual stream
    of layer 0 kept for a drafter. Each step's final states and kept states, the pool, the
    forward."""
    cfg, g = model.cfg, torch.Generator().manual_seed(1)
    pool = PagedKVPool(cfg, 8, 16, model.device, model.dtype)
    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]
    forward = cpu_forward.CpuForward(model)
    forward.replay = replay
    lens, out = [6, 9], []
    with torch.inference_mode():
        for step in range(steps + 1):
            q_lens, ctx = (lens, [0, 0]) if step == 0 else ([4, 4], lens)
            masks = [None, None] if step == 0 else [None, TREE]
            meta = build_metadata(tables, ctx, q_lens, 16, model.device, masks,
                                  q_per_kv=cfg.n_heads // cfg.n_kv_heads, direct=True)
            ids = torch.randint(0, cfg.vocab_size, (sum(q_lens),), generator=g)
            tree_pos = [0, 1, 1, 2]
            pos = torch.cat([torch.arange(ctx[0], ctx[0] + q_lens[0]),
                             torch.arange(ctx[1], ctx[1] + q_lens[1]) if step == 0
                             else torch.tensor([ctx[1] + p for p in tree_pos])])
            assert forward.applies()
            h, kept = forward(ids, pos, PagedBatch(pool, meta, get_paged_backend("cpu")),
                              keep=(0,))
            out.append((h.clone(), kept[0].clone()))
            if step:
                lens = [n + 2 for n in lens]      # two accepted a step
    return out, pool, forward


@pytest.mark.parametrize("kind", ["int4", pytest.param("bf16", marks=BF16.marks)])
def test_replayed_verify_steps_with_trees_and_kept_states_equal_the_eager_path(kind):
    """Verify steps (several rows a sequence, a tree mask as bits, a layer's states kept for
    the drafter) are recorded by their shape and replayed: final and kept states and every
    cached K/V the same to the bit as the fast path run eagerly."""
    model = tiny(kind)
    eager, pool_e, _ = verify_steps(model, False)
    replayed, pool_r, forward = verify_steps(model, True)
    recorded = forward.recorded[StepShape(2, 8, masked=True, keep=(0,))]
    assert recorded.replays == len(replayed) - 2
    assert len(forward.recorded) == 1                 # the prompts are not recorded
    for (h_e, k_e), (h_r, k_r) in zip(eager, replayed):
        assert torch.equal(h_e, h_r) and torch.equal(k_e, k_r)
    assert torch.equal(pool_e.k, pool_r.k) and torch.equal(pool_e.v, pool_r.v)


def test_recordings_beyond_the_row_budget_drop_the_least_recently_used(monkeypatch):
    """Each recording keeps its step's activations: past ``MAX_RECORDED_ROWS`` rows in all
    the least recently used goes first (a recording used again moves to the back)."""
    model = tiny("int4")
    _, pool, forward = decode_steps(model, True, 3, steps=2)
    cfg = model.cfg
    shape3 = StepShape.decode(3)
    recorded = forward.recorded[shape3]            # serves this pool: stands in for the others
    forward.recorded = {StepShape.decode(1): recorded, StepShape.decode(2): recorded,
                        shape3: recorded}
    monkeypatch.setattr(cpu_forward, "MAX_RECORDED_ROWS", 9)

    def batch(n: int) -> PagedBatch:
        meta = build_metadata([[4 * s] for s in range(n)], [3] * n, [1] * n, 16, model.device,
                              q_per_kv=cfg.n_heads // cfg.n_kv_heads, direct=True)
        return PagedBatch(pool, meta, get_paged_backend("cpu"))

    assert forward._recording(batch(1), ()) is recorded       # used again: now the newest
    assert forward._recording(batch(4), ()) is not None       # 2 + 3 + 1 + 4 rows > 9
    assert list(forward.recorded) == [shape3, StepShape.decode(1), StepShape.decode(4)]
