"""Decode steps padded to captured batch sizes (``minillm.engine.graphs.DecodeGraphs``).

On the CPU the path runs with ``capture=False``: the same padding, static buffers and forward
function as a CUDA graph, re-run instead of replayed. Checked against the plain eager engine
(the independent reference): the same greedy tokens over requests that finish at different
times (batches of 5 and 3 run padded to 8 and 4); padding rows write the scratch block and no
slot but the step's own new tokens changes in the pool; only pure decode steps take the path
(prefill, mixed, tree-masked, hidden-state and connector steps, and batches past the largest
size run eagerly). With CUDA, real graphs give the eager engine's tokens.
"""
from __future__ import annotations

import pytest
import torch
from engine_checks import prompts_of, run_all, sharp_model

from minillm import SamplingParams
from minillm.attention.paged import build_metadata
from minillm.cache.block_manager import BlockManager
from minillm.engine import EngineConfig, LLMEngine
from minillm.engine.connector import KVConnector
from minillm.engine.graphs import DecodeGraphs, capture_sizes
from minillm.engine.plan import ScheduledSeq, SchedulerOutput
from minillm.engine.runner import ModelRunner
from minillm.engine.sequence import Request

BS = 4
SIZES = (1, 2, 4, 8)
MAX_TOKENS = (3, 9, 5, 12, 7)      # five requests finishing at different steps


@pytest.fixture(scope="module")
def model():
    return sharp_model(torch.float64, max_seq_len=256, vocab_size=2048)


@pytest.fixture(scope="module")
def model32():
    return sharp_model(torch.float32, max_seq_len=256, vocab_size=2048)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def padded_engine(model, **options) -> tuple[LLMEngine, DecodeGraphs]:
    """An engine whose pure decode steps run padded to SIZES, replayed eagerly."""
    engine = LLMEngine(model, None, EngineConfig(**{"num_kv_blocks": 60, "block_size": BS,
                                                    "static_buffers": True, **options}))
    return engine, engine.runner.use_decode_graphs(SIZES, capture=False)


@pytest.mark.parametrize("backend, lengths, max_tokens, padded", [
    ("sdpa", [7, 30, 12, 5, 19], MAX_TOKENS, {4, 8}),
    ("cpu", [7, 30, 12, 5, 19], MAX_TOKENS, {4, 8}),
    ("triton", [7, 12, 5], (2, 5, 3), {4}),          # interpreted: a smaller run
])
def test_padded_decode_gives_the_plain_engines_tokens(model, model32, backend, lengths,
                                                      max_tokens, padded):
    """Requests with different output lengths: the padded path's greedy tokens equal the
    plain engine's, for each paged backend (the Triton one as a captured step would call it:
    per-sequence tensors only). Steps of 5 and 3 sequences ran at 8 and 4 rows, and exactly
    the engine's decode-only steps took the path. Catches: padding rows read or written as a
    real sequence's, rows picked from the wrong place, the buffers left stale."""
    prompts = prompts_of(lengths, seed=1)
    params = [greedy(n) for n in max_tokens]
    options = {"num_kv_blocks": 60, "block_size": BS, "attention_backend": backend}
    model = model if backend == "sdpa" else model32     # the kernels: fp32, bf16 (fp16)
    plain = run_all(LLMEngine(model, None, EngineConfig(**options)), prompts, params)
    engine, graphs = padded_engine(model, attention_backend=backend)
    got = run_all(engine, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert padded <= set(graphs.steps) <= set(SIZES)
    decode_only = sum(r.prefill_tokens == 0 for r in engine.trace)
    assert sum(graphs.steps.values()) == decode_only > 0


def test_padding_rows_write_only_the_scratch_block(model):
    """Around every forward pass: the pool slots that changed are the step's own new tokens'
    or the scratch block's, which no sequence owns; and every padded step overwrote the
    scratch block (poisoned before each step). Catches: padding rows given a real sequence's
    block (or slot 0 of block 0)."""
    engine, graphs = padded_engine(model, attention_backend="sdpa")
    runner = engine.runner
    scratch = runner.scratch_block
    assert scratch == graphs.scratch_block >= engine.blocks.num_blocks
    forward = runner.forward
    padded_steps = []

    def checked(plan, tables, *args, **kwargs):
        slots = {tables[w.seq.seq_id][p // BS] * BS + p % BS for w in plan.seqs
                 for p in range(w.seq.num_computed, w.seq.num_computed + w.num_tokens)}
        assert all(scratch not in tables[w.seq.seq_id] for w in plan.seqs)
        runner.pool.k[:, scratch], runner.pool.v[:, scratch] = 1e4, 1e4     # seen overwritten
        before = torch.stack([runner.pool.k, runner.pool.v]).clone()
        steps = sum(graphs.steps.values())
        result = forward(plan, tables, *args, **kwargs)
        after = torch.stack([runner.pool.k, runner.pool.v])
        diff = (after != before).permute(2, 3, 0, 1, 4, 5)        # [blocks, BS, 2, L, H, D]
        changed = set(torch.nonzero(diff.flatten(0, 1).flatten(1).any(1)).flatten().tolist())
        allowed = slots | set(range(scratch * BS, (scratch + 1) * BS))
        assert changed <= allowed, f"slots written outside the step: {changed - allowed}"
        if sum(graphs.steps.values()) > steps and len(plan.seqs) not in SIZES:
            padded_steps.append(bool(changed & set(range(scratch * BS, (scratch + 1) * BS))))
        return result

    runner.forward = checked
    run_all(engine, prompts_of([7, 30, 12, 5, 19], seed=2), [greedy(n) for n in MAX_TOKENS])
    assert padded_steps and all(padded_steps)


# ---- which steps take the path: hand-built plans (no scheduler), as tests/engine/test_runner.py

def runner_with_graphs(model, connector: KVConnector | None = None, sizes=(1, 2, 4)):
    blocks = BlockManager(32, BS, watermark=0)
    runner = ModelRunner(model, 32, BS, attention_backend="sdpa", tables=blocks.tables,
                         static_buffers=True, connector=connector)
    return runner, blocks, runner.use_decode_graphs(sizes, capture=False)


def prefilled(runner, blocks, n: int, seed: int) -> Request:
    """A request whose prompt of n tokens is computed and that has sampled its first token."""
    req = Request(f"r{seed}", prompts_of([n], seed=seed)[0], greedy(8))
    seq = req.seqs[0]
    blocks.allocate(seq.seq_id, n)
    out = runner.execute(SchedulerOutput(requests=[req], seqs=[ScheduledSeq(seq, n)]))
    seq.num_computed += n
    seq.token_ids.append(out.samples[seq.seq_id][0].tokens[0])
    blocks.reserve(seq.seq_id, n + 1)
    return req


def plan_of(*work: tuple[Request, int]) -> SchedulerOutput:
    return SchedulerOutput(requests=[r for r, _ in work],
                           seqs=[ScheduledSeq(r.seqs[0], n) for r, n in work])


def graph_steps(graphs: DecodeGraphs) -> int:
    return sum(graphs.steps.values())


def test_only_pure_decode_steps_take_the_path(model):
    """Prefill steps run eagerly; a decode of 2 takes the path with the logits of the eager
    runner; a mixed step (a prompt chunk beside a decode), a tree mask, hidden states wanted
    and a batch past the largest size (5 > 4) run eagerly. Catches: a graph replayed for a
    step whose shapes or extra outputs it cannot give."""
    runner, blocks, graphs = runner_with_graphs(model)
    reqs = [prefilled(runner, blocks, 5 + i, seed=i) for i in range(5)]
    assert graph_steps(graphs) == 0                          # five prefill steps
    a, b = reqs[:2]
    replayed = runner.forward(plan_of((a, 1), (b, 1)), runner.tables)
    assert graphs.steps == {2: 1}
    runner.graphs = None
    eager = runner.forward(plan_of((a, 1), (b, 1)), runner.tables)
    runner.graphs = graphs
    torch.testing.assert_close(replayed.logits, eager.logits, atol=1e-9, rtol=0)
    assert replayed.logit_rows == eager.logit_rows and replayed.rows == eager.rows

    c = Request("c", prompts_of([9], seed=9)[0], greedy(8))
    blocks.allocate(c.seqs[0].seq_id, 6)
    runner.forward(plan_of((c, 6), (a, 1)), runner.tables)                    # mixed
    tree = {a.seqs[0].seq_id: torch.ones(1, 1, dtype=torch.bool)}
    runner.forward(plan_of((a, 1)), runner.tables, masks=tree)                # tree mask
    runner.forward(plan_of((a, 1)), runner.tables, hidden_layers=(0, -1))    # a drafter's
    runner.forward(plan_of(*((r, 1) for r in reqs)), runner.tables)          # 5 > 4
    assert graph_steps(graphs) == 1
    runner.forward(plan_of(*((r, 1) for r in reqs[:3])), runner.tables)      # 3 -> 4
    assert graphs.steps == {2: 1, 4: 1}


def test_a_kv_connector_keeps_decode_steps_eager(model):
    """A KV connector's per-layer calls run on the host between layers: with one, a decode
    step runs eagerly (and the connector sees each layer). Catches: a replayed step that
    skips the connector's waits and saves."""

    class Counting(KVConnector):
        layers = 0

        def save_layer(self, layer):
            self.layers += 1

    connector = Counting()
    runner, blocks, graphs = runner_with_graphs(model, connector)
    a = prefilled(runner, blocks, 6, seed=1)
    before = connector.layers
    runner.execute(plan_of((a, 1)))
    assert graph_steps(graphs) == 0 and connector.layers - before == model.cfg.n_layers


def test_sizes_and_options():
    """vLLM's capture sizes; the padded size of a batch; bad sizes and a graph without CUDA
    are refused; ``cuda_graphs`` is ignored on the CPU (no graphs, the pool unchanged)."""
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20] and capture_sizes(3) == [1, 2]
    model = sharp_model(torch.float32, max_seq_len=64, vocab_size=256)
    runner = ModelRunner(model, 16, BS, attention_backend="sdpa", max_rows=16, max_seqs=8,
                         static_buffers=True)
    graphs = runner.use_decode_graphs(capture=False)
    assert graphs.sizes == [1, 2, 4, 8] and runner.scratch_block == 16
    assert [graphs.padded_size(n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]
    assert graphs.fits([[0], [1, 2]], [1, 1]) and not graphs.fits([[0]], [2])
    assert not graphs.fits([[0]] * 9, [1] * 9)
    with pytest.raises(ValueError, match="sizes"):
        runner.use_decode_graphs((1, 16), capture=False)
    with pytest.raises(ValueError, match="capture=True"):
        runner.use_decode_graphs(capture=True)
    with pytest.raises(ValueError, match="static_buffers"):
        ModelRunner(model, 16, BS, attention_backend="sdpa").use_decode_graphs(capture=False)
    plain = ModelRunner(model, 16, BS, attention_backend="sdpa", cuda_graphs=True)
    assert plain.graphs is None and plain.buffers is None and plain.pool.k.shape[1] == 16


def test_metadata_without_groups_has_the_same_tensors():
    """``build_metadata(groups=False)`` (a captured step's) fills the same per-sequence
    tensors and no groups; with a tree mask it refuses."""
    args = ([[3, 4], [7]], [5, 2], [1, 1], BS, torch.device("cpu"))
    full, bare = build_metadata(*args), build_metadata(*args, groups=False)
    assert full.groups and not bare.groups and not bare.singles and bare.direct is None
    for name in ("slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q"):
        assert torch.equal(getattr(full, name), getattr(bare, name))
    with pytest.raises(ValueError, match="groups=True"):
        build_metadata(*args, masks=[None, torch.ones(1, 1, dtype=torch.bool)], groups=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_give_the_eager_engines_tokens():
    """On CUDA: captured graphs (Triton backend, float32, TF32 off) give the eager engine's
    greedy tokens, and every decode-only step replayed a graph."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = sharp_model(torch.float32, max_seq_len=256).cuda()
    prompts = prompts_of([7, 30, 12, 5, 19], seed=1)
    params = [greedy(n) for n in MAX_TOKENS]
    options = {"num_kv_blocks": 60, "block_size": BS, "attention_backend": "triton"}
    plain = run_all(LLMEngine(model, None, EngineConfig(**options)), prompts, params)
    engine = LLMEngine(model, None, EngineConfig(**options))
    graphs = engine.runner.use_decode_graphs(SIZES)
    assert graphs.capture and set(graphs.graphs) == set(SIZES)
    got = run_all(engine, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert sum(graphs.steps.values()) == sum(r.prefill_tokens == 0 for r in engine.trace)
