"""Checkers for the exercises of chapter 09 (sharding the input: sequence parallelism).

Each ``check_*`` takes the student's function, compares it with the package on a few cases,
prints a one-line verdict and returns a :class:`~minillm.labs.common.Result` (``passed`` is None
while the exercise still raises NotImplementedError).

The ring and the Ulysses exercises are written as one rank runs them, talking to the others
through a function they are handed (``pass_on``, ``all_to_all``). Their first checkers run the
P ranks as threads of one process (:class:`~minillm.labs.ranks.SimulatedRanks`);
:func:`check_ring_attention_on_ranks` and :func:`check_ulysses_on_ranks` then run the same
functions on real ``torch.distributed`` processes (gloo, :func:`minillm.parallel.run`) over a
SmolLM2 attention layer, next to the package's versions. A function defined in a notebook
reaches those processes by value (:class:`~minillm.labs.ranks.ShippedFunction`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..config import get_preset
from ..parallel import comm
from ..parallel.sequence import (
    LAYOUTS,
    check_ulysses,
    gather_positions,
    heads_to_seq,
    masked_attention,
    merge_states,
    rank_work,
    ring_attention,
    ring_bytes,
    shard_positions,
    take,
    ulysses_attention,
    ulysses_bytes,
)
from .common import Result, check
from .ranks import Counted, SimulatedRanks, on_ranks, shippable, timed


def check_merge(fn: Callable) -> Result:
    """``fn(out_a, lse_a, out_b, lse_b)`` -> (out, lse): attention over keys A and B from the
    attention over A and over B alone (out [..., D], lse [...] natural log). Tested on real
    halves of an attention computation, and on rows where one side saw no key (lse = -inf)."""

    def attempt() -> None:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64)
        k = torch.randn(2, 3, 9, 8, generator=gen, dtype=torch.float64)
        v = torch.randn(2, 3, 9, 8, generator=gen, dtype=torch.float64)
        qp, kp = torch.arange(4, 9), torch.arange(9)
        full, full_lse = masked_attention(q, k, v, qp, kp, True)
        for cut in (1, 4, 6):
            a = masked_attention(q, k[:, :, :cut], v[:, :, :cut], qp, kp[:cut], True)
            b = masked_attention(q, k[:, :, cut:], v[:, :, cut:], qp, kp[cut:], True)
            out, lse = fn(*a, *b)
            assert torch.allclose(out, full, atol=1e-10), (
                f"keys split at {cut}: merged output differs from attention over all keys by "
                f"{(out - full).abs().max():.2e}")
            assert torch.allclose(lse, full_lse, atol=1e-10), f"keys split at {cut}: wrong lse"
        # one side empty for every row: the merge must return the other side unchanged
        none = masked_attention(q, k, v, qp, torch.full((9,), -1), True)
        out, lse = fn(*none, full, full_lse)
        want = merge_states(*none, full, full_lse)
        assert torch.allclose(out, want[0]) and torch.allclose(lse, want[1]), (
            "merging with a side that saw no key (lse = -inf, out 0) must return the other side")
        # both sides empty: no key at all, so out 0 and lse -inf, never NaN
        out, lse = fn(*none, *none)
        assert not out.isnan().any() and not lse.isnan().any(), (
            "merging two sides that saw no key gave NaN: guard the weights when both lse are "
            "-inf (out must be 0, lse -inf)")
        assert (out == 0).all() and (lse == float("-inf")).all(), (
            "merging two sides that saw no key must give out 0 and lse -inf")

    return check("merge", attempt)


# --- ranks simulated by threads -------------------------------------------------------------


def _simulated_ring(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    world_size: int, layout: str, causal: bool) -> tuple[list, list, list]:
    """``fn`` (exercise 2's contract) on ``world_size`` simulated ranks: (outs, positions,
    pass_on calls) per rank."""
    pos = shard_positions(q.shape[2], world_size, layout)
    ranks = SimulatedRanks(world_size)
    outs = ranks.run(lambda r: fn(take(q, pos[r]), take(k, pos[r]), take(v, pos[r]),
                                  pos[r].clone(), causal, world_size, ranks.pass_on(r)))
    return outs, pos, ranks.calls


def _assert_ring(outs: list, pos: list, calls: list, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, causal: bool, tol: float, case: str) -> float:
    """Each rank's output against float64 attention over every key, and P-1 passes per rank;
    returns the largest difference."""
    p, t = len(pos), q.shape[2]
    full = torch.arange(t)
    want, _ = masked_attention(q.double(), k.double(), v.double(), full, full, causal)
    worst = 0.0
    for r in range(p):
        mine = take(want, pos[r])
        assert isinstance(outs[r], torch.Tensor) and outs[r].shape == mine.shape, (
            f"{case}, rank {r}: out has shape {tuple(getattr(outs[r], 'shape', ()))}, "
            f"expected {tuple(mine.shape)}")
        real = pos[r] >= 0
        err = (outs[r].double() - mine)[:, :, real].abs().max().item() if real.any() else 0.0
        assert err < tol, (f"{case}, rank {r}: output differs from attention over all keys by "
                           f"{err:.2e}")
        worst = max(worst, err)
        assert calls[r] == p - 1, (
            f"{case}, rank {r}: pass_on called {calls[r]} times; the ring needs P-1 = {p - 1} "
            "passes (after the last step no block has to move)")
    return worst


def check_ring_attention(fn: Callable) -> Result:
    """``fn(q, k, v, pos, causal, world_size, pass_on)`` -> out [B, H, L, D]: ring attention as
    one rank runs it. q [B, H, L, D], k, v [B, Hkv, L, D] and pos [L] (-1 = padding) are this
    rank's shard; ``pass_on(tensors)`` sends a list of tensors to the next rank and returns
    the list the previous rank sent (every rank calls it at the same time). At each of the P
    steps the rank attends its queries to the K/V block it holds and merges the result into
    its running (out, lse); between steps every block moves one rank on. out must equal
    attention of the rank's queries over every key, after P-1 passes. Checked on P ranks run
    as threads of one process, contiguous and striped shards, causal or not, with padding."""

    def attempt() -> None:
        gen = torch.Generator().manual_seed(2)
        for t, p, layout, causal in ((8, 2, "contiguous", True), (12, 4, "striped", True),
                                     (13, 4, "contiguous", True), (10, 3, "striped", False),
                                     (6, 1, "contiguous", True)):
            q = torch.randn(1, 4, t, 8, generator=gen, dtype=torch.float64)
            k, v = (torch.randn(1, 2, t, 8, generator=gen, dtype=torch.float64) for _ in "kv")
            outs, pos, calls = _simulated_ring(fn, q, k, v, p, layout, causal)
            _assert_ring(outs, pos, calls, q, k, v, causal, 1e-10,
                         f"T={t}, P={p}, {layout}, causal={causal}")

    return check("ring_attention", attempt)


def check_shard_positions(fn: Callable[[int, int, str], list[torch.Tensor]]) -> Result:
    """``fn(seq_len, world_size, layout)`` -> list of world_size LongTensors [ceil(T/P)]: the
    positions each rank holds, -1 for padding. "contiguous": rank r holds [r L, (r+1) L) with
    L = ceil(T/P); "striped": r, r+P, r+2P, ... Positions past the sequence are -1."""

    def attempt() -> None:
        for t, p in ((8, 2), (12, 4), (13, 4), (10, 4), (5, 4), (7, 7), (9, 1)):
            for layout in ("contiguous", "striped"):
                got = [[int(i) for i in x] for x in fn(t, p, layout)]
                want = [x.tolist() for x in shard_positions(t, p, layout)]
                assert got == want, f"T={t}, P={p}, {layout}: got {got}, expected {want}"

    return check("shard_positions", attempt)


def check_rank_work(fn: Callable[[int, int, str], list[int]]) -> Result:
    """``fn(seq_len, world_size, layout)`` -> [world_size] ints: the causal (query, key) pairs
    each rank computes in ring attention, with "contiguous" shards (rank r holds the r-th block
    of ceil(T/P) tokens) or "striped" ones (rank r holds r, r+P, r+2P, ...)."""

    def attempt() -> None:
        for t, p in ((8, 2), (16, 4), (13, 4), (100, 8), (5, 5)):
            for layout in ("contiguous", "striped"):
                got = [int(x) for x in fn(t, p, layout)]
                want = rank_work(t, p, layout)
                assert got == want, f"T={t}, P={p}, {layout}: got {got}, expected {want}"

    return check("rank_work", attempt)


def _simulated_seq_to_heads(fn: Callable, shards: list[torch.Tensor]) -> tuple[list, list]:
    """``fn`` (exercise 5's contract) on len(shards) simulated ranks: (outputs, all_to_all
    calls) per rank."""
    p = len(shards)
    ranks = SimulatedRanks(p)
    outs = ranks.run(lambda r: fn(shards[r].clone(), p, ranks.all_to_all(r)))
    return outs, ranks.calls


def _assert_heads(outs: list, calls: list, full: torch.Tensor, case: str) -> None:
    """Rank r must hold heads r H/P .. (r+1) H/P - 1 of ``full`` [B, H, T, D], after one
    all-to-all."""
    p = len(outs)
    h = full.shape[1] // p
    for r, got in enumerate(outs):
        want = full[:, r * h:(r + 1) * h]
        assert isinstance(got, torch.Tensor) and got.shape == want.shape, (
            f"{case}, rank {r}: shape {tuple(getattr(got, 'shape', ()))}, expected "
            f"{tuple(want.shape)}")
        assert torch.equal(got, want), f"{case}, rank {r}: wrong heads or token order"
        assert calls[r] == 1, (f"{case}, rank {r}: {calls[r]} calls of all_to_all; one "
                               "all-to-all moves everything")


def check_ulysses_all_to_all(fn: Callable) -> Result:
    """``fn(x, world_size, all_to_all)`` -> [B, H/P, P L, D]: Ulysses' first all-to-all as one
    rank runs it. x [B, H, L, D] is this rank's shard (all heads, its L tokens);
    ``all_to_all(chunks)`` takes a list of P tensors, chunks[j] for rank j, and returns the P
    tensors the ranks sent to this one, in rank order. Rank r must end with heads r H/P ...
    (r+1) H/P - 1 over the whole sequence, tokens in rank order, after one all-to-all.
    Checked on P ranks run as threads of one process."""

    def attempt() -> None:
        gen = torch.Generator().manual_seed(1)
        for b, h, l, d, p in ((1, 4, 3, 2, 2), (2, 8, 5, 4, 4), (1, 9, 2, 3, 3),
                              (1, 2, 4, 2, 1)):
            full = torch.randn(b, h, l * p, d, generator=gen)
            outs, calls = _simulated_seq_to_heads(fn, list(full.split(l, dim=2)))
            _assert_heads(outs, calls, full, f"B={b}, H={h}, L={l}, D={d}, P={p}")

    return check("ulysses_all_to_all", attempt)


def check_comm_bytes(fn: Callable[[int, int, int, int, int, str], int]) -> Result:
    """``fn(seq_len, world_size, n_heads, n_kv_heads, head_dim, scheme)`` -> bytes one rank sends
    for one attention layer (batch 1, 4-byte numbers, shards of ceil(T/P) tokens). "ring": P-1
    K and V blocks plus their positions (one 8-byte int per token); "ulysses": what leaves the
    rank in the all-to-alls of q, k, v (before attention) and of the output (after)."""
    cases = ((1024, 2, 12, 12, 64), (1024, 4, 12, 12, 64), (1000, 3, 9, 3, 64),
             (256, 6, 12, 6, 32), (64, 1, 4, 2, 16), (100, 2, 8, 2, 64))

    def attempt() -> None:
        for t, p, h, hkv, d in cases:
            for scheme, want in (("ring", ring_bytes(t, p, hkv, d)),
                                 ("ulysses", ulysses_bytes(t, p, h, hkv, d))):
                got = int(fn(t, p, h, hkv, d, scheme))
                assert got == want, (f"T={t}, P={p}, H={h}, H_kv={hkv}, d={d}, {scheme}: got "
                                     f"{got:,} bytes, expected {want:,}")

    return check("comm_bytes", attempt)


# --- the student's code on real ranks ------------------------------------------------------


def _rank_pass_on(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``pass_on`` on a real rank: each tensor to rank r+1, one of the same shape from r-1
    (gloo point-to-point), the bytes logged in :mod:`minillm.parallel.comm`."""
    rank, p = comm.world()
    bufs = [torch.empty_like(t) for t in tensors]
    works = []
    for t, buf in zip(tensors, bufs):
        works.append(dist.isend(t.contiguous(), (rank + 1) % p))
        works.append(dist.irecv(buf, (rank - 1) % p))
        comm.log_p2p("send", t, "exercise ring")
    for w in works:
        w.wait()
    return bufs


def _rank_all_to_all(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """``all_to_all`` on a real rank: chunks[j] to rank j (one all-to-all of the stacked
    chunks, logged in :mod:`minillm.parallel.comm`); the chunks received, in rank order."""
    _, p = comm.world()
    if len(chunks) != p:
        raise ValueError(f"all_to_all takes one tensor per rank ({p}), got {len(chunks)}")
    got = comm.all_to_all(torch.stack([c.contiguous() for c in chunks]), [1] * p, [1] * p,
                          tag="exercise all-to-all")
    return list(got.unbind(0))


@torch.inference_mode()
def ring_on_rank(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 causal: bool) -> list[dict]:
    """What one rank runs for :func:`check_ring_attention_on_ranks`: for each layout its shard
    of the full q, k, v, the student's ring on it, then the package's; per layout "out",
    "pos", "calls" (of pass_on), "sent" (bytes), "seconds" and "package_seconds"."""
    rank, p = comm.world()
    results = []
    for layout in LAYOUTS:
        pos = shard_positions(q.shape[2], p, layout)[rank]
        ql, kl, vl = (take(x, pos) for x in (q, k, v))
        pass_on = Counted(_rank_pass_on)
        comm.reset()
        out, seconds = timed(fn, ql, kl, vl, pos.clone(), causal, p, pass_on)
        sent = sum(e.sent for e in comm.events())
        _, package_seconds = timed(ring_attention, ql, kl, vl, pos, pos, causal)
        results.append({"out": out, "pos": pos, "calls": pass_on.calls, "sent": sent,
                        "seconds": seconds, "package_seconds": package_seconds})
    return results


@torch.inference_mode()
def ulysses_on_rank(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    causal: bool) -> dict:
    """What one rank runs for :func:`check_ulysses_on_ranks`: its contiguous shard of the full
    q, k, v, the student's ``seq_to_heads`` for each of them, local attention over the whole
    sequence on its heads, the package's ``heads_to_seq`` back; then the package's Ulysses.
    Returns "out", "pos", "heads" (the shapes it got), "calls", "sent" (bytes of the
    student's all-to-alls), "seconds" and "package_seconds"."""
    rank, p = comm.world()
    pos = shard_positions(q.shape[2], p, "contiguous")[rank]
    ql, kl, vl = (take(x, pos) for x in (q, k, v))
    all_pos = gather_positions(pos)
    a2a = Counted(_rank_all_to_all)
    comm.reset()

    def ulysses() -> tuple[torch.Tensor | None, list]:
        heads = [fn(x, p, a2a) for x in (ql, kl, vl)]
        shapes = [tuple(getattr(h, "shape", ())) for h in heads]
        want = [(x.shape[0], x.shape[1] // p, x.shape[2] * p, x.shape[3]) for x in (ql, kl, vl)]
        if shapes != want:
            return None, shapes
        out, _ = masked_attention(*heads, all_pos, all_pos, causal)
        return heads_to_seq(out), shapes

    (out, shapes), seconds = timed(ulysses)
    sent = sum(e.sent for e in comm.events() if e.tag == "exercise all-to-all")
    _, package_seconds = timed(ulysses_attention, ql, kl, vl, pos, causal)
    return {"out": out, "pos": pos, "heads": shapes, "calls": a2a.calls, "sent": sent,
            "seconds": seconds, "package_seconds": package_seconds}


def layer_qkv(seq_len: int = 37, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q [1, H, T, D], k, v [1, Hkv, T, D] in float32 with SmolLM2-135M's attention shape (9
    query heads, 3 KV heads of 64), random: the default input of the checks on ranks."""
    cfg = get_preset("smollm2-135m")
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, cfg.n_heads, seq_len, cfg.head_dim, generator=gen),
            *(torch.randn(1, cfg.n_kv_heads, seq_len, cfg.head_dim, generator=gen)
              for _ in "kv"))


def check_ring_attention_on_ranks(fn: Callable, q: torch.Tensor | None = None,
                                  k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                                  world_sizes: tuple[int, ...] = (2, 4),
                                  causal: bool = True) -> Result:
    """Exercise 2's ``ring_attention`` on real processes: for each world size, gloo ranks
    (:func:`minillm.parallel.run`) each take their shard of q [B, H, T, D], k, v [B, Hkv, T,
    D] (default: :func:`layer_qkv`, SmolLM2's attention shape; the notebook passes a real
    layer's), contiguous and striped, and run ``fn`` with a ``pass_on`` that sends to the next
    process; then the package's ring on the same shard. First the same function runs on
    simulated ranks on the same data (a rank that skips a pass would hang real processes).
    Passes when the outputs put together equal float64 attention over the whole sequence and
    no rank sent more than the ring's P-1 K/V blocks and positions
    (:func:`~minillm.parallel.sequence.ring_bytes`); prints both versions' seconds."""
    if q is None:
        q, k, v = layer_qkv()
    t = q.shape[2]
    full = torch.arange(t)

    def attempt() -> None:
        for p in world_sizes:
            for layout in LAYOUTS:
                outs, pos, calls = _simulated_ring(fn, q, k, v, p, layout, causal)
                _assert_ring(outs, pos, calls, q, k, v, causal, 1e-4,
                             f"simulated, P={p}, {layout}")
        want, _ = masked_attention(q.double(), k.double(), v.double(), full, full, causal)
        lines = []
        for p in world_sizes:
            ranks = on_ranks(ring_on_rank, p, shippable(fn), q, k, v, causal)
            for i, layout in enumerate(LAYOUTS):
                out = torch.zeros_like(want)
                for r in ranks:
                    real = r[i]["pos"] >= 0
                    out[:, :, r[i]["pos"][real]] = r[i]["out"][:, :, real].double()
                err = (out - want).abs().max().item()
                assert err < 1e-4, (f"{p} gloo ranks, {layout} shards: the ranks' outputs put "
                                    f"together differ from attention over all {t} tokens by "
                                    f"{err:.2e}")
                sent = max(r[i]["sent"] for r in ranks)
                bound = ring_bytes(t, p, k.shape[1], k.shape[3], k.shape[0], k.element_size())
                assert sent <= bound, (
                    f"{p} gloo ranks, {layout} shards: a rank sent {sent:,} bytes, more than "
                    f"the ring's P-1 K/V blocks and positions ({bound:,} bytes)")
                lines.append(f"{p} ranks, {layout}: max |diff| {err:.1e}, {sent:,} bytes sent "
                             f"per rank, {max(r[i]['seconds'] for r in ranks) * 1e3:.1f} ms "
                             f"(the package's ring "
                             f"{max(r[i]['package_seconds'] for r in ranks) * 1e3:.1f} ms)")
        print(f"your ring on gloo processes, {t} tokens:\n  " + "\n  ".join(lines))

    return check("ring_attention_on_ranks", attempt)


def check_ulysses_on_ranks(fn: Callable, q: torch.Tensor | None = None,
                           k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                           world_size: int = 3, causal: bool = True) -> Result:
    """Exercise 5's ``seq_to_heads`` in Ulysses attention on real processes: ``world_size``
    gloo ranks each take their contiguous shard of q [B, H, T, D], k, v [B, Hkv, T, D]
    (default: :func:`layer_qkv`, SmolLM2's attention shape; the notebook passes a real layer's),
    turn q, k and v into head shards with ``fn`` (an ``all_to_all`` between the processes),
    attend over the whole sequence on their heads and go back with the package's
    ``heads_to_seq``; then the package's Ulysses on the same shard. First the same function
    runs on simulated ranks. Passes when the outputs put together equal float64 attention over
    the whole sequence; prints the bytes each rank sent in its all-to-alls and both versions'
    seconds. ``world_size`` must divide the query and the KV heads."""
    if q is None:
        q, k, v = layer_qkv()
    check_ulysses(q.shape[1], k.shape[1], world_size)
    t, p = q.shape[2], world_size
    full = torch.arange(t)

    def attempt() -> None:
        for x, name in ((q, "q"), (k, "k"), (v, "v")):
            pos = shard_positions(t, p, "contiguous")
            outs, calls = _simulated_seq_to_heads(fn, [take(x, r) for r in pos])
            _assert_heads(outs, calls, take(x, torch.cat(pos)), f"simulated, {name}, P={p}")
        want, _ = masked_attention(q.double(), k.double(), v.double(), full, full, causal)
        ranks = on_ranks(ulysses_on_rank, p, shippable(fn), q, k, v, causal)
        for r, res in enumerate(ranks):
            assert res["out"] is not None, (f"{p} gloo ranks, rank {r}: seq_to_heads gave "
                                            f"shapes {res['heads']} for q, k, v")
        out = torch.zeros_like(want)
        for res in ranks:
            real = res["pos"] >= 0
            out[:, :, res["pos"][real]] = res["out"][:, :, real].double()
        err = (out - want).abs().max().item()
        assert err < 1e-4, (f"{p} gloo ranks: the ranks' outputs put together differ from "
                            f"attention over all {t} tokens by {err:.2e}")
        sent = max(res["sent"] for res in ranks)
        total = ulysses_bytes(t, p, q.shape[1], k.shape[1], q.shape[3], q.shape[0],
                              q.element_size())
        print(f"your all-to-all in Ulysses on {p} gloo processes, {t} tokens: max |diff| "
              f"{err:.1e}; each rank sent {sent:,} bytes in its all-to-alls of q, k, v "
              f"(ulysses_bytes, which adds the output's all-to-all: {total:,}); "
              f"{max(res['seconds'] for res in ranks) * 1e3:.1f} ms, the package's Ulysses "
              f"{max(res['package_seconds'] for res in ranks) * 1e3:.1f} ms")

    return check("ulysses_on_ranks", attempt)
