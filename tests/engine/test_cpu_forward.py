"""The engine's CPU fast path (``minillm.engine.cpu_forward``) against the model's own eager
forward over the same paged cache, and the runner's choice between them."""
from __future__ import annotations

import copy

import pytest
import torch

from minillm.attention.paged import build_metadata, get_paged_backend
from minillm.cache.pool import PagedBatch, PagedKVPool
from minillm.engine import EngineConfig, LLMEngine, cpu_forward
from minillm.engine.sequence import Draft
from minillm.model.packed import can_pack_linears, pack_linears
from minillm.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    not cpu_forward.supports(__import__("minillm").load_model("tiny")[0]),
    reason="the CPU kernels did not build")

# two steps over block tables of 16-token blocks: prompts, then decodes beside a chunk and a
# new prompt (sequence: cached, new tokens)
STEPS = [[(0, 40), (0, 7)], [(40, 1), (7, 5), (0, 3)]]
TABLES = [[0, 1, 2], [3], [4]]
# then a verification step: sequence 0 a tree draft (its last token and 4 nodes, two under the
# root and two under the first), sequence 1 a chain of 2
TREE = Draft([11, 12, 13, 14], [0, 0, 1, 1])
TREE_STEP = [(41, 5), (12, 3)]


@pytest.fixture(scope="module")
def models(real):
    """The real model in three dtypes, its linears packed as the engine packs them."""
    out = {dt: copy.deepcopy(real[0]).to(dt) for dt in (torch.float64, torch.float32,
                                                          torch.bfloat16)}
    for model in out.values():
        pack_linears(model)
    return out


def run_steps(model, fused: bool, keep=(3, 29), tree: bool = False):
    """The steps through one forward or the other (float64: the eager one with SDPA): the
    last step's final hidden states [N, D] and kept layers {layer: [N, D]}, and the pool.
    ``tree``: then the verification step with a tree mask."""
    cfg = model.cfg
    pool = PagedKVPool(cfg, 8, 16, model.device, model.dtype)
    backend = "sdpa" if model.dtype == torch.float64 else "cpu"
    g = torch.Generator().manual_seed(0)
    mask, tree_pos = TREE.tree_inputs(TREE_STEP[0][0])
    for step in STEPS + ([TREE_STEP] if tree else []):
        tables = TABLES[:len(step)]
        masks = [torch.tensor(mask), None] if step is TREE_STEP else None
        meta = build_metadata(tables, [c for c, _ in step], [n for _, n in step], 16,
                              model.device, masks, q_per_kv=cfg.n_heads // cfg.n_kv_heads,
                              direct=backend == "cpu")
        ids = torch.randint(0, cfg.vocab_size, (sum(n for _, n in step),), generator=g)
        pos = torch.cat([torch.tensor(tree_pos) if step is TREE_STEP and i == 0 else
                         torch.arange(c, c + n) for i, (c, n) in enumerate(step)])
        batch = PagedBatch(pool, meta, get_paged_backend(backend))
        with torch.inference_mode():
            if fused:
                forward = cpu_forward.CpuForward(model)
                assert forward.applies()
                h, kept = forward(ids, pos, batch, keep)
            else:
                h, kept = model.forward_layers(ids[None], batch, pos, keep)
                h, kept = h[0], {i: x[0] for i, x in kept.items()}
    return h, kept, pool


BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not can_pack_linears(torch.device("cpu"), torch.bfloat16),
    reason="oneDNN has no bf16 kernels for this CPU (the fast path does not apply)"))


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_fast_path_is_as_close_to_float64_as_the_eager_forward(models, dtype, tree):
    """The ops round like the eager ones but sum in another order, so an ulp here and there
    moves: the fast path's hidden states, kept layers and cached K/V must be no further from
    the float64 forward's than the eager path's (and float32's close to them); also for a
    step that verifies a tree draft beside a chain."""
    exact, exact_kept, exact_pool = run_steps(models[torch.float64], False, tree=tree)
    runs = {fused: run_steps(models[dtype], fused, tree=tree) for fused in (False, True)}

    def error(got, want):
        return (got.double() - want).abs().mean().item()

    for pick in (lambda r: r[0], lambda r: r[1][3], lambda r: r[1][29], lambda r: r[2].k,
                 lambda r: r[2].v):
        want = pick((exact, exact_kept, exact_pool))
        assert error(pick(runs[True]), want) <= 1.25 * error(pick(runs[False]), want) + 1e-9
    assert runs[True][1].keys() == {3, 29}
    if dtype == torch.float32:
        torch.testing.assert_close(runs[True][0], runs[False][0], rtol=0,
                                   atol=1e-5 * exact.abs().max().item())


def count_fast_steps(monkeypatch) -> list[int]:
    calls = []
    real_forward = cpu_forward.CpuForward.__call__

    def counted(*args, **kwargs):
        calls.append(1)
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(cpu_forward.CpuForward, "__call__", counted)
    return calls


def greedy(engine, prompts, n=12):
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0,
                                                ignore_eos=True)) for p in prompts]
    out = {}
    while engine.has_unfinished():
        out.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [out[i] for i in ids]


def test_the_engine_takes_the_fast_path_and_generates_what_eager_does(real, monkeypatch):
    model, tok = real
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fib(n):", "Once")]
    calls = count_fast_steps(monkeypatch)
    eager = LLMEngine(model, tok, EngineConfig(attention_backend="cpu"))
    eager.runner.fuse_ops = False
    expected = greedy(eager, prompts)
    assert not calls
    fast = LLMEngine(model, tok, EngineConfig(attention_backend="cpu"))
    assert greedy(fast, prompts) == expected
    assert len(calls) == len(fast.trace)                      # every step went the fast way


def test_hooks_need_fuse_ops_off_and_other_backends_take_the_eager_path(real, monkeypatch):
    model, tok = real
    calls = count_fast_steps(monkeypatch)
    seen = []
    hook = model.layers[5].register_forward_hook(lambda *args: seen.append(1))
    try:
        greedy(LLMEngine(model, tok, EngineConfig(attention_backend="cpu")), [[1, 2, 3]], 3)
        assert len(calls) == 3 and not seen       # the fast path runs no module hooks
        calls.clear()
        greedy(LLMEngine(model, tok, EngineConfig(attention_backend="cpu", fuse_ops=False)),
               [[1, 2, 3]], 3)
    finally:
        hook.remove()
    assert not calls and len(seen) == 3                        # the hook ran every step
    greedy(LLMEngine(model, tok, EngineConfig(attention_backend="sdpa")), [[1, 2, 3]], 3)
    assert not calls
    seen_attn = []

    class Counting:
        """The C++ kernel's backend, counting its calls: it must see each, so no fast path."""
        name, reads_direct, cpu_fast_path = "counting cpu", True, False

        def __call__(self, *args):
            seen_attn.append(1)
            return get_paged_backend("cpu")(*args)

    wrapped = LLMEngine(model, tok, EngineConfig(attention_backend=Counting()))
    assert wrapped.runner.attention_backend == "counting cpu"
    greedy(wrapped, [[1, 2, 3]], 3)
    assert not calls and len(seen_attn) == 3 * model.cfg.n_layers   # a wrapped backend runs


def test_without_a_compiler_the_engine_runs_the_eager_forward(real, monkeypatch, no_compiler):
    from minillm.kernels import cpu_fused_ops

    model, tok = real
    no_compiler(cpu_fused_ops.LIBRARY)
    assert not cpu_fused_ops.available()
    assert "no-such-compiler" in cpu_fused_ops.unavailable_reason()
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_fused_ops.silu_mul(torch.ones(1, 4), torch.ones(1, 4))
    calls = count_fast_steps(monkeypatch)
    engine = LLMEngine(model, tok, EngineConfig(attention_backend="cpu"))
    assert len(greedy(engine, [[1, 2, 3]], 3)[0]) == 3 and not calls
