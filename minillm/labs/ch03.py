"""Checkers for the exercises of chapter 03 (sharding a model).

Each ``check_*`` takes the student's function, compares it with the package on a few cases,
prints a one-line verdict and returns a :class:`~minillm.labs.common.Result` (``passed`` is None
while the exercise still raises NotImplementedError).

Two exercises are written as one rank of a tensor-parallel group runs a decoder layer's MLP or
attention (``mlp_on_rank``, ``attention_on_rank``). Their checkers run the function on ranks
simulated by threads first, then on real gloo processes (:mod:`minillm.labs.ranks`), where
it replaces that sub-layer in every layer of the package's tensor-parallel model
(:func:`tp_logits_with`); the logits are compared with one process and the package's TP is
timed on the same ranks.
"""
from __future__ import annotations

import copy
import math
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import PRESETS, ModelConfig
from ..model.layers import Attention, SwiGLU, rope_cos_sin
from ..model.transformer import Block, Transformer, _heads_axis
from ..parallel import comm
from ..parallel.pipeline import bubble_formula, simulate_pipeline
from ..parallel.tensor import check_tp, kv_heads_of_rank, tensor_parallel
from .common import Result, check
from .in_engine import demo_model
from .ranks import SimulatedRanks, on_ranks, shippable, timed


def _ffn_partial(ffn: SwiGLU, x: torch.Tensor, rank: int, p: int) -> torch.Tensor:
    """Rank ``rank``'s partial output: its columns of w_gate/w_up, its rows of w_down."""
    per = ffn.w_gate.weight.shape[0] // p
    cols = slice(rank * per, (rank + 1) * per)
    h = F.silu(x @ ffn.w_gate.weight[cols].T) * (x @ ffn.w_up.weight[cols].T)
    return h @ ffn.w_down.weight[:, cols].T


def check_ffn_partials(fn: Callable) -> Result:
    """``fn(ffn, x, world_size)`` -> list of world_size tensors [N, D]: each rank's partial
    output of a SwiGLU FFN split Megatron-style (w_gate, w_up by columns, w_down by rows).
    Their sum must be ffn(x); each must be what that rank alone can compute."""

    def attempt() -> None:
        gen = torch.Generator().manual_seed(0)
        for d, ffn_dim, p in ((16, 32, 2), (24, 48, 4), (8, 24, 3)):
            torch.manual_seed(p)
            ffn = SwiGLU(d, ffn_dim).double()
            x = torch.randn(5, d, generator=gen, dtype=torch.float64)
            with torch.no_grad():
                parts = fn(ffn, x, p)
                assert len(parts) == p, f"world_size={p}: expected {p} partials, got {len(parts)}"
                full = ffn(x)
                total = sum(parts)
                assert torch.allclose(total, full, atol=1e-10), (
                    f"d={d}, ffn_dim={ffn_dim}, world_size={p}: the partials do not add up to "
                    f"ffn(x) (max |diff| {(total - full).abs().max():.2e})")
                for r, part in enumerate(parts):
                    want = _ffn_partial(ffn, x, r, p)
                    assert torch.allclose(part, want, atol=1e-10), (
                        f"world_size={p}: partial {r} is not rank {r}'s share (its columns "
                        f"{r * ffn_dim // p}..{(r + 1) * ffn_dim // p - 1} of ffn_dim)")

    return check("ffn_partials", attempt)


def _linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free nn.Linear holding ``weight`` [out, in]."""
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    out.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return out


def _attention_partial(attn: Attention, cfg, x: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, rank: int, p: int) -> torch.Tensor:
    """Rank ``rank``'s partial output [B, T, D]: the package's Attention on its query heads,
    the KV heads they read, and its rows of wo (the columns of wo's weight)."""
    hd, per = cfg.head_dim, cfg.n_heads // p
    q_rows = slice(rank * per * hd, (rank + 1) * per * hd)
    kv = kv_heads_of_rank(cfg, rank, p)
    kv_rows = slice(kv.start * hd, kv.stop * hd)
    shard = copy.deepcopy(attn)
    shard.wq, shard.wo = _linear(attn.wq.weight[q_rows]), _linear(attn.wo.weight[:, q_rows])
    shard.wk, shard.wv = _linear(attn.wk.weight[kv_rows]), _linear(attn.wv.weight[kv_rows])
    shard.n_heads, shard.n_kv_heads = per, len(kv)
    return shard(x, cos, sin)


def check_attention_partials(fn: Callable) -> Result:
    """``fn(attn, x, cos, sin, world_size)`` -> list of world_size tensors [B, T, D]: each
    rank's partial output of a causal grouped-query attention layer split by heads. Rank r
    keeps query heads [r H/P, (r+1) H/P), the KV heads those read (query head h reads KV head
    h // (H / H_kv), so a KV head is copied when P > H_kv), and the matching columns of wo's
    weight. x is [B, T, D], cos/sin [1, 1, T, head_dim] (RoPE). The sum of the partials must be
    attn(x, cos, sin), and each partial what that rank alone computes."""
    base = PRESETS["tiny"]
    shapes = ((4, 2, 2), (4, 2, 4), (6, 3, 3), (8, 2, 2), (4, 4, 1))  # (H, H_kv, P)

    def attempt() -> None:
        gen = torch.Generator().manual_seed(0)
        for hq, hkv, p in shapes:
            cfg = base.with_(n_heads=hq, n_kv_heads=hkv, d_model=8 * hq, head_dim=8)
            torch.manual_seed(hq + hkv + p)
            attn = Attention(cfg, 0).double().eval()
            x = torch.randn(2, 5, cfg.d_model, generator=gen, dtype=torch.float64)
            cos, sin = (_heads_axis(t) for t in rope_cos_sin(torch.arange(5), cfg.head_dim,
                                                              cfg.rope_theta, torch.float64))
            case = f"H={hq}, H_kv={hkv}, world_size={p}"
            with torch.no_grad():
                parts = fn(attn, x, cos, sin, p)
                assert len(parts) == p, f"{case}: expected {p} partials, got {len(parts)}"
                full = attn(x, cos, sin)
                total = sum(parts)
                assert torch.allclose(total, full, atol=1e-10), (
                    f"{case}: the partials do not add up to attn(x) (max |diff| "
                    f"{(total - full).abs().max():.2e})")
                for r, part in enumerate(parts):
                    want = _attention_partial(attn, cfg, x, cos, sin, r, p)
                    assert torch.allclose(part, want, atol=1e-10), (
                        f"{case}: partial {r} is not rank {r}'s share (query heads "
                        f"{r * hq // p}..{(r + 1) * hq // p - 1})")

    return check("attention_partials", attempt)


def check_gpipe_slots(fn: Callable[[int, int], list[list[int]]]) -> Result:
    """``fn(p, m)`` -> start[s][i]: the time slot in which stage s runs micro-batch i on a GPipe
    forward schedule where every stage takes one slot per micro-batch and starts as early as
    it can. The bubble fraction of your schedule is compared with (p-1)/(m+p-1)."""

    def attempt() -> None:
        for p in (1, 2, 3, 4, 8):
            for m in (1, 2, 4, 7, 16):
                start = [list(row) for row in fn(p, m)]
                want = [[s + i for i in range(m)] for s in range(p)]
                assert start == want, f"p={p}, m={m}: got {start}, expected {want}"
                span = max(max(row) for row in start) + 1
                bubble = 1 - p * m / (p * span)
                assert abs(bubble - bubble_formula(p, m)) < 1e-12

    return check("gpipe_slots", attempt)


def check_gpipe_times(fn: Callable[[list[list[float]]], list[list[float]]]) -> Result:
    """``fn(costs)`` -> start[s][i]: when stage s starts micro-batch i, where costs[s][i] is
    the time stage s spends on micro-batch i ([p][m], stages of unequal speed allowed). Each
    stage takes its micro-batches in order and starts one as soon as the stage is free and the
    previous stage has finished that micro-batch (transfers are free)."""
    gen = torch.Generator().manual_seed(0)
    tables = {"equal stages p=2, m=4": [[1.0] * 4] * 2,
              "slow first stage": [[3.0] * 4, [1.0] * 4],
              "slow last stage": [[1.0] * 5, [2.0] * 5, [4.0] * 5],
              "one stage": [[0.5, 2.0, 1.0]], "one micro-batch": [[1.0], [2.0], [0.5]],
              "random p=4, m=6": (torch.rand(4, 6, generator=gen, dtype=torch.float64)
                                  + 0.1).tolist(),
              "zero-cost stage": [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [2.0, 0.5, 1.0]]}

    def attempt() -> None:
        for name, costs in tables.items():
            got = [[float(t) for t in row] for row in fn([list(row) for row in costs])]
            want = [[start for _, start, _ in tl] for tl in simulate_pipeline(costs)]
            assert len(got) == len(want) and all(len(g) == len(w) for g, w in zip(got, want)), (
                f"{name}: expected {len(want)} rows of {len(want[0])} start times")
            for s, (g, w) in enumerate(zip(got, want)):
                for i, (a, b) in enumerate(zip(g, w)):
                    assert abs(a - b) < 1e-9, (f"{name} (costs {costs}): stage {s} starts "
                                               f"micro-batch {i} at {a:.3g}, expected {b:.3g}")

    return check("gpipe_times", attempt)


def check_dispatch_counts(fn: Callable[[torch.Tensor, int, int], list[int]]) -> Result:
    """``fn(experts, n_experts, world_size)`` -> [world_size] ints: how many token slots this
    rank sends to each rank, where experts [N, k] are the chosen expert ids and rank r holds the
    contiguous block of experts [r E/P, (r+1) E/P)."""

    def attempt() -> None:
        gen = torch.Generator().manual_seed(0)
        for n, k, e, p in ((10, 2, 8, 2), (33, 2, 8, 4), (7, 1, 6, 3), (50, 4, 16, 8)):
            experts = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
            got = [int(c) for c in fn(experts, e, p)]
            want = torch.bincount(experts.flatten() // (e // p), minlength=p).tolist()
            assert got == want, f"N={n}, k={k}, E={e}, P={p}: got {got}, expected {want}"
            assert sum(got) == n * k, "every (token, expert) slot must go somewhere"

    return check("dispatch_counts", attempt)


def check_kv_heads(fn: Callable[[object, int, int], list[int]]) -> Result:
    """``fn(cfg, rank, world_size)`` -> the KV heads that rank keeps under tensor parallelism:
    its share when world_size divides n_kv_heads, the one head it replicates when world_size is
    a multiple of n_kv_heads; raise ValueError when the heads cannot be split."""
    base = PRESETS["tiny"]
    shapes = ((9, 3), (8, 8), (4, 2), (16, 4), (12, 6), (32, 8), (6, 2))

    def attempt() -> None:
        for hq, hkv in shapes:
            cfg = base.with_(n_heads=hq, n_kv_heads=hkv, ffn_dim=48 * 8, vocab_size=48 * 64)
            for p in (1, 2, 3, 4, 8):
                try:
                    check_tp(cfg, p)
                except ValueError:
                    try:
                        got = fn(cfg, 0, p)
                    except ValueError:
                        continue
                    raise AssertionError(f"n_heads={hq}, n_kv_heads={hkv}, world_size={p} "
                                         f"cannot be split, but you returned {got}") from None
                for r in range(p):
                    got = [int(h) for h in fn(cfg, r, p)]
                    want = list(kv_heads_of_rank(cfg, r, p))
                    assert got == want, (f"n_heads={hq}, n_kv_heads={hkv}, world_size={p}, "
                                         f"rank {r}: got {got}, expected {want}")

    return check("kv_heads", attempt)


# --- one rank's layer, inside the model on real ranks --------------------------------------

KINDS = {"mlp": "x + ffn(ffn_norm(x))", "attention": "x + attn(attn_norm(x), cos, sin)"}


def numbers_held(obj: object, skip: tuple = ()) -> int:
    """How many numbers ``obj`` keeps alive: every tensor reachable from it (a function's
    closure and defaults, a partial's arguments, an object's attributes, a module's parameters,
    the items of lists, tuples, sets and dicts), each counted by its whole storage (a slice is
    a view that keeps all of its matrix alive), each storage once. Module globals and the
    objects in ``skip`` (say, the communication function it was handed) are not followed."""
    seen: set[int] = {id(o) for o in skip}
    storages: dict[int, int] = {}
    todo = [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, str, bytes, int, float)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            storages[st.data_ptr()] = st.nbytes() // o.element_size()
        elif isinstance(o, types.FunctionType):
            todo += [c.cell_contents for c in o.__closure__ or () if _filled(c)]
            todo += list(o.__defaults__ or ()) + list((o.__kwdefaults__ or {}).values())
        elif isinstance(o, types.MethodType):
            todo += [o.__self__, o.__func__]
        elif isinstance(o, dict):
            todo += list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            todo += list(o)
        elif hasattr(o, "__dict__") or hasattr(o, "func"):  # objects, modules, partials
            todo += list(getattr(o, "__dict__", {}).values())
            todo += [getattr(o, a) for a in ("func", "args", "keywords") if hasattr(o, a)]
    return sum(storages.values())


def _filled(cell: types.CellType) -> bool:
    """Whether a closure cell holds a value (a name assigned later leaves it empty)."""
    try:
        cell.cell_contents  # noqa: B018 - reading it is the test
    except ValueError:
        return False
    return True


def share(kind: str, cfg: ModelConfig, world_size: int) -> int:
    """The most numbers one rank's ``kind`` step ("mlp" or "attention") needs to keep: its
    largest share of the layer's matrices (hidden units of w_gate, w_up and w_down; query
    heads of wq and wo and the KV heads they read in wk and wv) and the layer's norm."""
    d, p = cfg.d_model, world_size
    if kind == "mlp":
        return 3 * d * math.ceil(cfg.ffn_dim / p) + d
    kv = max(cfg.n_kv_heads // p, 1)
    return 2 * d * cfg.head_dim * (cfg.n_heads // p + kv) + d


def _package_step(kind: str, block: Block) -> Callable[..., torch.Tensor]:
    """The package's sub-layer of ``block`` as a step on the residual stream (the package's
    TP sub-layer when ``block`` is a tensor-parallel shard)."""
    if kind == "mlp":
        return lambda x: x + block.ffn(block.ffn_norm(x))
    return lambda x, cos, sin: x + block.attn(block.attn_norm(x), cos, sin)


class _Steps(nn.Module):
    """A decoder layer as two steps on the residual stream x [B, T, D]: ``attention(x, cos,
    sin)`` then ``mlp(x)``, each returning the stream with its sub-layer added."""

    def __init__(self, attention: Callable, mlp: Callable) -> None:
        super().__init__()
        self.attention, self.mlp = attention, mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: object = None) -> torch.Tensor:
        if cache is not None:
            raise ValueError("the steps of the tensor-parallel exercises run without a KV cache")
        return self.mlp(self.attention(x, cos, sin))


def _tp_splits(cfg: ModelConfig, world_size: int) -> bool:
    """Whether the package's TP splits ``cfg`` over ``world_size`` ranks."""
    try:
        check_tp(cfg, world_size)
    except ValueError:
        return False
    return True


@torch.inference_mode()
def tp_layers_on_rank(model: Transformer, input_ids: torch.Tensor, mlp: Callable | None,
                      attention: Callable | None, repeats: int = 1) -> dict:
    """What one rank runs for :func:`tp_logits_with`: the package's TP shard of ``model``
    (:func:`~minillm.parallel.tensor.tensor_parallel`; the whole model where it does not
    split), its logits and time; then the same shard with every layer's MLP and/or attention
    replaced by the step ``mlp(block, rank, world_size, all_reduce)`` /
    ``attention(...)`` makes of the model's whole layer, its logits, time, the shapes of the
    steps' all-reduces in one forward pass and the numbers each step keeps."""
    rank, p = comm.world()
    reduces: list[tuple[int, ...]] = []

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        reduces.append(tuple(t.shape))
        return comm.all_reduce(t, tag="exercise")

    out: dict = {"package_logits": None, "package_seconds": None}
    shard = model
    if _tp_splits(model.cfg, p):
        shard = tensor_parallel(model)
        out["package_logits"], out["package_seconds"] = timed(shard, input_ids, repeats=repeats)
    layers, held = [], {"mlp": [], "attention": []}
    for block, base in zip(model.layers, shard.layers):
        steps = {}
        for kind, fn in (("attention", attention), ("mlp", mlp)):
            steps[kind] = _package_step(kind, base) if fn is None else \
                fn(block, rank, p, all_reduce)
            if fn is not None:
                held[kind].append(numbers_held(steps[kind], skip=(all_reduce,)))
        layers.append(_Steps(steps["attention"], steps["mlp"]))
    shard.layers = nn.ModuleList(layers)
    out["logits"], out["seconds"] = timed(shard, input_ids, repeats=repeats)
    out["reduces"] = reduces[:len(reduces) // max(1, repeats)]  # those of one forward pass
    return {**out, "held": held}


def tp_logits_with(model: Transformer, input_ids: torch.Tensor, world_size: int,
                   mlp: Callable | None = None, attention: Callable | None = None,
                   repeats: int = 1) -> list[dict]:
    """``model`` on ``world_size`` gloo processes with your ``mlp_on_rank`` and/or
    ``attention_on_rank`` as that sub-layer of every layer, the package's tensor parallelism
    for the rest (the rest whole on every rank where the package's TP does not split the model
    over ``world_size``); before it, the package's TP alone on the same processes. Per rank:
    "logits" [B, T, V], "seconds" (one forward pass, best of ``repeats``), "reduces" (the shapes
    your steps all-reduced in one pass), "held" ({"mlp": [...], "attention": [...]}: numbers
    your step keeps, per layer), "package_logits" and "package_seconds" (None where the
    package's TP does not split the model)."""
    return on_ranks(tp_layers_on_rank, world_size, model, input_ids, shippable(mlp),
                    shippable(attention), repeats, timeout_s=300.0)


def _tol(dtype: torch.dtype) -> float:
    """Relative tolerance of a sharded result against one process in ``dtype``."""
    return {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 1e-2)


def _simulated_step(kind: str, fn: Callable, model: Transformer, input_ids: torch.Tensor,
                    world_size: int) -> None:
    """``fn`` (the ``kind`` step's contract) for layer 0 of ``model`` on ``world_size`` ranks
    simulated by threads, on the embedded ``input_ids``: one all-reduce of [B, T, D] per rank,
    each rank's output equal to the whole sub-layer's, and no more numbers kept than
    :func:`share` (AssertionError naming the first wrong rank)."""
    block, cfg, p = model.layers[0], model.cfg, world_size
    with torch.inference_mode():
        x = model.embed(input_ids)
        cos, sin = (_heads_axis(t) for t in rope_cos_sin(
            torch.arange(input_ids.shape[1]), cfg.head_dim, cfg.rope_theta, model.dtype))
        args = (x, cos, sin) if kind == "attention" else (x,)
        want = _package_step(kind, block)(*args)
    ranks = SimulatedRanks(p)

    def body(rank: int) -> tuple:
        reduces: list[tuple[int, ...]] = []
        reduce = ranks.all_reduce(rank)

        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            reduces.append(tuple(t.shape))
            return reduce(t)

        with torch.inference_mode():
            step = fn(block, rank, p, all_reduce)
            out = step(*(a.clone() for a in args))
        return out, reduces, numbers_held(step, skip=(all_reduce,))

    results = ranks.run(body)
    case = f"layer 0 on {p} simulated ranks"
    tol = _tol(model.dtype) * max(1.0, want.abs().max().item())
    for rank, (out, reduces, held) in enumerate(results):
        where = f"{case}, rank {rank}"
        assert len(reduces) == 1, (
            f"{where}: your step called all_reduce {len(reduces)} times in one forward pass; "
            "the partial outputs are summed once per sub-layer")
        assert reduces[0] == tuple(x.shape), (
            f"{where}: your step all-reduced a tensor of shape {reduces[0]}; the partial "
            f"outputs to sum are [B, T, D] = {tuple(x.shape)}")
        assert isinstance(out, torch.Tensor) and out.shape == want.shape, (
            f"{where}: forward returned {tuple(getattr(out, 'shape', ()))}, expected "
            f"{tuple(want.shape)}")
        err = (out - want).abs().max().item()
        if err > tol:
            raise AssertionError(f"{where}: the output differs from {KINDS[kind]} by "
                                 f"{err:.2e}{_hint(kind, cfg, p, out - want, x, tol)}")
        limit = share(kind, cfg, p) + cfg.d_model
        assert held <= limit, (
            f"{where}: your step keeps {held:,} numbers alive, more than this rank's share of "
            f"the layer ({share(kind, cfg, p):,} with the norm): keep copies (.clone()) of "
            "this rank's slices and the norm, not the block, its whole matrices or views of "
            "them")


def _hint(kind: str, cfg: ModelConfig, p: int, diff: torch.Tensor, x: torch.Tensor,
          tol: float) -> str:
    """A likely cause of a step's wrong output, or ""."""
    if p > 1 and (diff - (p - 1) * x).abs().max().item() <= tol * p:
        return (f" ({p - 1} x the residual x too much: added on every rank before the "
                f"all-reduce, the residual is counted {p} times in the sum)")
    if kind == "mlp" and cfg.ffn_dim % p:
        return (f" ({p} ranks do not divide ffn_dim={cfg.ffn_dim}: do the shares cover every "
                "hidden unit exactly once?)")
    if kind == "attention" and p > cfg.n_kv_heads:
        return (f" ({p} ranks, {cfg.n_kv_heads} KV heads: does each rank keep the KV head its "
                "query heads read?)")
    return ""


def _on_ranks_check(kind: str, fn: Callable, model: Transformer, input_ids: torch.Tensor,
                    world_sizes: tuple[int, ...], repeats: int) -> None:
    """``fn`` as every layer's ``kind`` sub-layer of the model on real gloo ranks
    (:func:`tp_logits_with`): the logits must equal one process's; prints a line per world
    size with the numbers kept, the all-reduces and both versions' times."""
    cfg = model.cfg
    with torch.inference_mode():
        want = model(input_ids)
    tol = _tol(model.dtype) * max(1.0, want.abs().max().item())
    whole = share(kind, cfg, 1)
    lines = []
    for p in world_sizes:
        res = tp_logits_with(model, input_ids, p, repeats=repeats, **{kind: fn})
        err = max((r["logits"] - want).abs().max().item() for r in res)
        assert err <= tol, (f"on {p} gloo ranks, your {kind} in every layer: the logits differ "
                            f"from one process by {err:.2e}")
        calls = [len(r["reduces"]) for r in res]
        assert calls == [cfg.n_layers] * p, (
            f"on {p} gloo ranks: your steps made {calls} all-reduces per rank in one forward "
            f"pass, expected one per layer ({cfg.n_layers})")
        same = (res[0]["logits"].argmax(-1) == want.argmax(-1)).sum().item()
        held = max(max(r["held"][kind]) for r in res)
        package = (f"the package's TP {1e3 * max(r['package_seconds'] for r in res):.1f} ms"
                   if res[0]["package_seconds"] is not None else
                   f"the package's TP does not split this model over {p} ranks, so the rest of "
                   "the model ran whole on every rank")
        lines.append(f"{p} ranks: logits max |diff| {err:.1e} (next token the same at {same} of "
                     f"{input_ids.numel()} positions); a rank keeps at most {held:,} of the "
                     f"{whole:,} numbers of a layer's {kind}; {cfg.n_layers} all-reduces of "
                     f"yours per forward pass; {1e3 * max(r['seconds'] for r in res):.1f} ms "
                     f"per forward pass ({package})")
    print(f"your {kind} in every layer of {cfg.name}, on gloo processes:\n  "
          + "\n  ".join(lines))


def _demo_ids() -> torch.Tensor:
    """The default input of the checks on ranks: 2 seeded random prompts of 9 tokens."""
    return torch.randint(5, 2000, (2, 9), generator=torch.Generator().manual_seed(5))


def check_mlp_on_ranks(fn: Callable, model: Transformer | None = None,
                       input_ids: torch.Tensor | None = None, world_sizes: tuple[int, ...] = (2,),
                       repeats: int = 1) -> Result:
    """``fn(block, rank, world_size, all_reduce)`` -> ``forward(x)``: one rank's MLP of a
    decoder layer under tensor parallelism. ``block`` is the model's whole layer (its
    ``ffn_norm`` and SwiGLU ``ffn``); the rank keeps copies of its hidden units
    [r F // P, (r+1) F // P) of w_gate, w_up and w_down (F = ffn_dim) and the norm, and
    ``forward`` maps the residual stream x [B, T, D] (the same on every rank) to
    x + ffn(ffn_norm(x)) on every rank, with one ``all_reduce(t)`` (the sum of t over the
    ranks). First on ranks simulated by threads for layer 0, at each of ``world_sizes`` and at
    the smallest P that does not divide F; then on real gloo processes for each of
    ``world_sizes``, as every layer's MLP of ``model`` (default: the tiny float64 demo model;
    its logits on ``input_ids`` [B, T] must equal one process's) next to the package's TP."""
    model = demo_model() if model is None else model
    input_ids = _demo_ids() if input_ids is None else input_ids
    ffn_dim = model.cfg.ffn_dim
    bad = [p for p in world_sizes if not (isinstance(p, int) and 1 <= p <= ffn_dim)]
    if bad or not world_sizes:
        raise ValueError(f"world_sizes must be ints in [1, ffn_dim={ffn_dim}], got {world_sizes}")
    uneven = next((p for p in range(2, ffn_dim + 1) if ffn_dim % p), None)

    def attempt() -> None:
        for p in sorted(set(world_sizes) | ({uneven} if uneven else set())):
            _simulated_step("mlp", fn, model, input_ids, p)
        _on_ranks_check("mlp", fn, model, input_ids, tuple(world_sizes), repeats)

    return check("mlp_on_ranks", attempt)


def _head_splits(cfg: ModelConfig, p: int) -> bool:
    """Whether ``p`` ranks split the query heads evenly and the KV heads split or copy."""
    return cfg.n_heads % p == 0 and (cfg.n_kv_heads % p == 0 or p % cfg.n_kv_heads == 0)


def check_attention_on_ranks(fn: Callable, model: Transformer | None = None,
                             input_ids: torch.Tensor | None = None,
                             world_sizes: tuple[int, ...] = (2,), repeats: int = 1) -> Result:
    """``fn(block, rank, world_size, all_reduce)`` -> ``forward(x, cos, sin)``: one rank's
    attention of a decoder layer under tensor parallelism. ``block`` is the model's whole
    layer (its ``attn_norm`` and ``attn``); the rank keeps copies of its query heads
    [r H/P, (r+1) H/P) of wq, the KV heads those read of wk and wv (query head h reads KV head
    h // (H / H_kv)), the matching columns of wo's weight and the norm, and ``forward`` maps
    the residual stream x [B, T, D] (the same on every rank; cos, sin [1, 1, T, head_dim]) to
    x + attn(attn_norm(x), cos, sin) on every rank, with one ``all_reduce(t)``. First on ranks
    simulated by threads for layer 0, at each of ``world_sizes`` and at the smallest P that
    copies KV heads (P > H_kv); then on real gloo processes for each of ``world_sizes``, as
    every layer's attention of ``model`` (default: the tiny float64 demo model; its logits on
    ``input_ids`` [B, T] must equal one process's) next to the package's TP."""
    model = demo_model() if model is None else model
    input_ids = _demo_ids() if input_ids is None else input_ids
    cfg = model.cfg
    bad = [p for p in world_sizes if not (isinstance(p, int) and p >= 1 and _head_splits(cfg, p))]
    if bad or not world_sizes:
        allowed = [p for p in range(1, cfg.n_heads + 1) if _head_splits(cfg, p)]
        raise ValueError(f"world_sizes must split the {cfg.n_heads} query heads evenly and the "
                         f"{cfg.n_kv_heads} KV heads (or copy them): allowed {allowed}, got "
                         f"{world_sizes}")
    copies = next((p for p in range(cfg.n_kv_heads + 1, cfg.n_heads + 1)
                   if _head_splits(cfg, p)), None)

    def attempt() -> None:
        for p in sorted(set(world_sizes) | ({copies} if copies else set())):
            _simulated_step("attention", fn, model, input_ids, p)
        _on_ranks_check("attention", fn, model, input_ids, tuple(world_sizes), repeats)

    return check("attention_on_ranks", attempt)
