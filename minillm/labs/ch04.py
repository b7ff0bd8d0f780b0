"""Checkers for the exercises of chapter 04 (batching, scheduling and paging).

Each ``check_*`` compares the student's function (or class) with the package's block manager
or scheduler, or with float64 attention, on several cases including edge cases, prints a
one-line verdict and returns a :class:`~minillm.labs.common.Result` (``passed`` is None while the
exercise still raises NotImplementedError).
"""
from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from ..attention.paged import PagedMetadata
from ..cache.block_manager import BlockManager, blocks_for
from ..config import SamplingParams
from ..engine import EngineConfig, LLMEngine
from ..engine.outputs import EngineStats
from ..engine.plan import ScheduledSeq, SchedulerOutput
from ..engine.scheduler import Scheduler, SchedulerConfig
from ..engine.sequence import Request, Status
from ..model.transformer import Transformer
from .common import Result, check
from .in_engine import assert_same_tokens, demo_model, demo_prompts, serve_greedy


def check_blocks_needed(fn: Callable[[int, int], int]) -> Result:
    """``fn(num_tokens, block_size)`` -> blocks a paged cache allocates for that many tokens.
    Compared with the blocks a :class:`BlockManager` takes for one sequence."""

    def attempt() -> None:
        for bs in (1, 4, 16, 7):
            for n in (1, 2, bs - 1, bs, bs + 1, 3 * bs, 100):
                if n < 1:
                    continue
                bm = BlockManager(1000, bs, watermark=0)
                bm.allocate(0, n)
                got, want = fn(n, bs), len(bm.tables[0])
                assert got == want, f"num_tokens={n}, block_size={bs}: got {got}, expected {want}"

    return check("blocks_needed", attempt)


def _admitted(prompt_lens, num_blocks, block_size, max_num_seqs, max_batched_tokens) -> int:
    blocks = BlockManager(num_blocks, block_size, watermark=0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_batched_tokens,
                                      enable_chunked_prefill=False), blocks, 10**6)
    for i, n in enumerate(prompt_lens):
        sched.add(Request(str(i), [1] * n, SamplingParams(max_tokens=1)))
    return len(sched.schedule().requests)


def check_fcfs_admit(fn: Callable[..., int]) -> Result:
    """``fn(prompt_lens, num_free_blocks, block_size, max_num_seqs, max_batched_tokens)`` ->
    how many requests at the head of a FCFS queue (prompt lengths in arrival order) the
    package's scheduler admits into an empty paged engine in one step: in order, no skipping,
    while sequences, the token budget (the first request is always let in) and blocks allow;
    whole prompts only (chunked prefill off: chapter 07 splits them).
    Compared with :class:`~minillm.engine.scheduler.Scheduler` on random queues."""
    rng = random.Random(0)
    cases = [([10, 20, 30], 100, 16, 8, 4096), ([40, 1, 1], 2, 16, 8, 4096),
             ([5] * 10, 100, 4, 3, 4096), ([100, 10], 100, 16, 8, 50), ([300], 100, 16, 8, 64)]
    for _ in range(40):
        cases.append(([rng.randint(1, 80) for _ in range(rng.randint(1, 8))],
                      rng.randint(1, 30), rng.choice([1, 4, 16]), rng.randint(1, 6),
                      rng.choice([64, 128, 4096])))

    def attempt() -> None:
        for lens, free, bs, seqs, budget in cases:
            got = fn(list(lens), free, bs, seqs, budget)
            want = _admitted(lens, free, bs, seqs, budget)
            assert got == want, (f"prompt_lens={lens}, num_free_blocks={free}, block_size={bs}, "
                                 f"max_num_seqs={seqs}, max_batched_tokens={budget}: got {got}, "
                                 f"expected {want}")

    return check("fcfs_admit", attempt)


def _waste(seq_lens, reserved, block_size) -> float:
    bm = BlockManager(10**5, block_size, watermark=0)
    for i, (n, r) in enumerate(zip(seq_lens, reserved)):
        bm.allocate(i, n, reserve_tokens=r)
    return EngineStats(0, 0, 0, bm.num_used, bm.num_free, bm.slots_in_use(), block_size).kv_waste


def check_kv_waste(fn: Callable[..., float]) -> Result:
    """``fn(seq_lens, max_lens, block_size, reserve)`` -> fraction of allocated KV slots that
    hold nothing, for sequences of ``seq_lens`` tokens now: paged (``reserve=False``: blocks
    for what each has) or Orca-style (``reserve=True``: blocks for ``max_lens[i]`` tokens
    reserved at admission). Compared with a :class:`BlockManager` and ``EngineStats.kv_waste``."""
    rng = random.Random(1)
    cases = [([1], [1], 16), ([16, 17], [64, 64], 16), ([100, 3, 50], [356, 259, 306], 8)]
    for _ in range(20):
        lens = [rng.randint(1, 300) for _ in range(rng.randint(1, 6))]
        cases.append((lens, [n + rng.randint(0, 512) for n in lens], rng.choice([1, 8, 16, 32])))

    def attempt() -> None:
        for lens, maxes, bs in cases:
            for reserve in (False, True):
                got = fn(list(lens), list(maxes), bs, reserve)
                want = _waste(lens, maxes if reserve else [None] * len(lens), bs)
                assert abs(got - want) < 1e-9, (f"seq_lens={lens}, max_lens={maxes}, "
                                                f"block_size={bs}, reserve={reserve}: got {got}, "
                                                f"expected {want}")

    return check("kv_waste", attempt)


def _running_request(i: int, num_tokens: int, blocks: BlockManager) -> Request:
    """A request decoding after ``num_tokens`` cached tokens (one sampled token to compute)."""
    req = Request(f"r{i}", [1] * (num_tokens + 1), SamplingParams(max_tokens=10**6))
    seq = req.seqs[0]
    blocks.allocate(seq.seq_id, num_tokens)
    seq.num_computed = num_tokens
    req.status = Status.RUNNING
    return req


def _schedule(running, waiting, free, block_size, max_num_seqs, max_batched_tokens):
    """(decoded, admitted, preempted) indices from the package's scheduler for one step."""
    held = sum(blocks_for(n, block_size) for n in running)
    blocks = BlockManager(held + free, block_size, watermark=0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_batched_tokens,
                                      enable_chunked_prefill=False), blocks, 10**6)
    sched.running = [_running_request(i, n, blocks) for i, n in enumerate(running)]
    for i, n in enumerate(waiting):
        sched.add(Request(f"w{i}", [1] * n, SamplingParams(max_tokens=1)))
    out = sched.schedule()

    def ids(reqs, prefix):
        return [int(r.request_id[1:]) for r in reqs if r.request_id[0] == prefix]

    return ids(out.requests, "r"), ids(out.requests, "w"), ids(out.preempted, "r")


def check_schedule_step(fn: Callable[..., tuple]) -> Result:
    """``fn(running, waiting, num_free_blocks, block_size, max_num_seqs, max_batched_tokens)``
    -> (decoded, admitted, preempted): one continuous-batching step. ``running[i]``: tokens
    cached for running request i (oldest first; each holds ceil(running[i] / block_size)
    blocks and now decodes one token); ``waiting[j]``: prompt length of waiting request j
    (arrival order). Returns three lists of indices, in order: the running requests that decode
    this step, the waiting requests admitted (whole prompts), the running requests preempted
    (by recompute: their blocks are freed). Compared with
    :class:`~minillm.engine.scheduler.Scheduler` (chunked prefill off, watermark 0)."""
    rng = random.Random(2)
    cases = [([5, 9], [3, 4], 10, 4, 8, 64),      # room for all
             ([4, 8], [], 1, 4, 8, 64),           # two need a block, one is free: preempt r1
             ([4], [], 0, 4, 8, 64),              # the only request preempts itself
             ([4, 8, 3], [2], 1, 4, 8, 64),       # preempt the newest, no admission after it
             ([3, 3], [5, 5, 5], 20, 4, 3, 64),   # max_num_seqs stops admission
             ([3], [30, 2], 20, 4, 8, 16),        # the token budget stops it, no skipping
             ([], [40, 2], 20, 4, 8, 16),         # an empty step always admits the first
             ([2, 2], [9, 2], 2, 4, 8, 64)]       # blocks stop it
    for _ in range(60):
        bs = rng.choice([1, 2, 4, 8])
        cases.append(([rng.randint(1, 24) for _ in range(rng.randint(0, 5))],
                      [rng.randint(1, 30) for _ in range(rng.randint(0, 4))],
                      rng.randint(0, 8), bs, rng.randint(1, 6), rng.choice([8, 16, 64])))
    cases = [(r, w, f, bs, max(seqs, len(r)), max(budget, seqs, len(r)))
             for r, w, f, bs, seqs, budget in cases if r or w]

    def attempt() -> None:
        for running, waiting, free, bs, seqs, budget in cases:
            got = tuple(list(x) for x in fn(list(running), list(waiting), free, bs, seqs, budget))
            want = _schedule(running, waiting, free, bs, seqs, budget)
            assert got == want, (
                f"running={running}, waiting={waiting}, num_free_blocks={free}, block_size={bs}, "
                f"max_num_seqs={seqs}, max_batched_tokens={budget}: got (decoded, admitted, "
                f"preempted) = {got}, expected {want}")

    return check("schedule_step", attempt)


def _canonical(tables: dict[int, list[int]]) -> dict[int, list[int]]:
    """Tables with physical ids renumbered by first appearance (which block is which does not
    matter; which entries share a block does)."""
    names: dict[int, int] = {}
    return {s: [names.setdefault(b, len(names)) for b in t] for s, t in sorted(tables.items())}


def _block_ops(rng: random.Random, n: int) -> list[tuple]:
    ops: list[tuple] = []
    for _ in range(n):
        ops.append((rng.choice(["allocate", "append", "append", "append", "fork", "free"]),
                    rng.randint(0, 5), rng.randint(0, 5), rng.randint(1, 9)))
    return ops


def check_block_manager(cls: Callable[[int, int], Any]) -> Result:
    """``cls(num_blocks, block_size)``: a block manager with reference counts and
    copy-on-write. Methods: ``allocate(seq_id, num_tokens)`` (a new table for that many
    tokens), ``append(seq_id)`` -> list of (src, dst) copies (room for one more token: a new
    block when the last is full, a private copy first when the block written is shared),
    ``fork(parent_id, child_id)`` (the child shares every block of the parent),
    ``free(seq_id)``; attributes ``tables`` (seq id -> list of physical block ids), ``ref``
    (list of num_blocks reference counts) and ``free_blocks`` (the ids with count 0).
    Driven by random operations (only those that fit in the pool) next to the package's
    :class:`BlockManager`: the same tables up to renaming of blocks, the same copies, and
    the invariants of :meth:`BlockManager.check`."""
    cases = [(1, 8, [("allocate", 0, 0, 4), ("append", 0, 0, 0), ("fork", 0, 1, 0),
                     ("append", 1, 0, 0), ("append", 0, 0, 0), ("free", 0, 0, 0)]),
             (4, 8, [("allocate", 0, 0, 6), ("fork", 0, 1, 0), ("fork", 1, 2, 0),
                     ("append", 2, 0, 0), ("append", 0, 0, 0), ("free", 1, 0, 0),
                     ("append", 0, 0, 0), ("free", 2, 0, 0), ("free", 0, 0, 0)])]
    rng = random.Random(3)
    for _ in range(12):
        cases.append((rng.choice([1, 2, 4]), rng.randint(8, 24), _block_ops(rng, 60)))

    def attempt() -> None:
        for bs, nb, ops in cases:
            mine, ref = cls(nb, bs), BlockManager(nb, bs, watermark=0)
            done: list[str] = []
            for op, a, b, n in ops:
                if not _apply(ref, mine, op, a, b, n, done):
                    continue
                where = f"block_size={bs}, num_blocks={nb}, after {'; '.join(done)}"
                _compare(mine, ref, where)

    return check("block_manager", attempt)


def _apply(ref: BlockManager, mine: Any, op: str, a: int, b: int, n: int, done: list) -> bool:
    """Do one operation on both managers when it is legal and fits the pool; False if skipped."""
    has = ref.tables
    if op == "allocate" and a not in has and blocks_for(n, ref.block_size) <= ref.num_free:
        ref.allocate(a, n)
        mine.allocate(a, n)
        done.append(f"allocate({a}, {n})")
    elif op == "append" and a in has and ref.blocks_to_reserve(a, ref.filled[a] + 1) <= \
            ref.num_free:
        want = ref.reserve(a, ref.filled[a] + 1)
        got = [tuple(c) for c in mine.append(a)]
        done.append(f"append({a})")
        assert len(got) == len(want), (f"after {'; '.join(done)}: append returned {got}, "
                                       f"expected {len(want)} copy-on-write copies")
    elif op == "fork" and a in has and b not in has:
        ref.fork(a, b)
        mine.fork(a, b)
        done.append(f"fork({a}, {b})")
    elif op == "free" and a in has:
        ref.free(a)
        mine.free(a)
        done.append(f"free({a})")
    else:
        return False
    return True


def _compare(mine: Any, ref: BlockManager, where: str) -> None:
    tables = {s: list(t) for s, t in mine.tables.items()}
    assert _canonical(tables) == _canonical(ref.tables), (
        f"{where}: tables {tables}, expected the sharing of {ref.tables} (block ids may differ)")
    counts = Counter(b for t in tables.values() for b in t)
    refs = list(mine.ref)
    bad = [b for b in range(len(refs)) if refs[b] != counts.get(b, 0)]
    assert not bad, (f"{where}: ref[{bad[0]}] = {refs[bad[0]]} but {counts.get(bad[0], 0)} "
                     f"tables hold block {bad[0]}")
    free = sorted(mine.free_blocks)
    assert free == [b for b in range(len(refs)) if refs[b] == 0], (
        f"{where}: free_blocks {free} are not the blocks with reference count 0")
    assert len(free) == ref.num_free, f"{where}: {len(free)} free blocks, expected {ref.num_free}"


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] (the last T positions), k/v [L, H, D] -> [T, H, D], causal, float64."""
    t, length = q.shape[0], k.shape[0]
    scores = torch.einsum("thd,lhd->htl", q, k) / math.sqrt(q.shape[-1])
    pos = torch.arange(length - t, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None] > pos, float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v)


def check_paged_attention(fn: Callable[..., torch.Tensor]) -> Result:
    """``fn(q, k_cache, v_cache, block_table, seq_len)`` -> [T, H, D]: attention of one
    sequence's T newest tokens over its ``seq_len`` cached tokens (the new ones included,
    already written), read from a paged pool. q [T, H, D] are the queries of positions
    seq_len - T ... seq_len - 1 (causal: each sees the keys up to its own position);
    k_cache, v_cache [num_blocks, block_size, H, D]; ``block_table``: list of physical block
    ids, logical block i holding positions i*block_size ... Slots past seq_len hold garbage.
    Compared with float64 attention over the contiguous keys and values."""
    gen = torch.Generator().manual_seed(4)
    cases = [(1, 4, 1), (10, 4, 1), (8, 4, 1), (23, 4, 5), (7, 4, 7), (16, 16, 16), (33, 8, 3)]

    def attempt() -> None:
        for seq_len, bs, t in cases:
            h, d, nb = 2, 8, blocks_for(seq_len, bs) + 5
            k = torch.randn(seq_len, h, d, generator=gen, dtype=torch.float64)
            v = torch.randn(seq_len, h, d, generator=gen, dtype=torch.float64)
            q = torch.randn(t, h, d, generator=gen, dtype=torch.float64)
            table = torch.randperm(nb, generator=gen)[:blocks_for(seq_len, bs)].tolist()
            k_cache = 100 * torch.randn(nb, bs, h, d, generator=gen, dtype=torch.float64)
            v_cache = 100 * torch.randn(nb, bs, h, d, generator=gen, dtype=torch.float64)
            for p in range(seq_len):
                k_cache[table[p // bs], p % bs], v_cache[table[p // bs], p % bs] = k[p], v[p]
            got = fn(q.clone(), k_cache.clone(), v_cache.clone(), list(table), seq_len)
            want = _dense_attention(q, k, v)
            where = f"seq_len={seq_len}, block_size={bs}, T={t}, block_table={table}"
            assert tuple(got.shape) == tuple(want.shape), (
                f"{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            err = (got.double() - want).abs().max().item()
            assert err < 1e-6, f"{where}: differs from contiguous attention by {err:.2e}"

    return check("paged_attention", attempt)


# --- the student's code inside the engine ----------------------------------------------------


class FunctionStep(Scheduler):
    """The engine's scheduler with each step's decisions taken by ``decide``, a function with
    exercise 5's contract: ``decide(running, waiting, num_free_blocks, block_size,
    max_num_seqs, max_batched_tokens) -> (decoded, admitted, preempted)``. This class carries
    them out: preempted requests by recompute (blocks freed, back to the queue), decoded ones
    one token each, admitted ones whole. Chunked prefill off; one sequence per request."""

    decide: Callable[..., tuple] = staticmethod(lambda *args: ([], [], []))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished=self._finished)
        self._finished = []
        running, waiting = self._sorted(self.running), self._sorted(self.waiting)
        decoded, admitted, preempted = (list(x) for x in self.decide(
            [r.seqs[0].num_computed for r in running], [r.seqs[0].num_tokens for r in waiting],
            self.blocks.num_free, self.blocks.block_size, self.config.max_num_seqs,
            self.config.max_num_batched_tokens))
        if sorted(decoded + preempted) != list(range(len(running))):
            raise ValueError(f"schedule_step: every running request must be decoded or "
                             f"preempted once; got decoded={decoded}, preempted={preempted} for "
                             f"{len(running)} running")
        if len(set(admitted)) != len(admitted) or not set(admitted) <= set(range(len(waiting))):
            raise ValueError(f"schedule_step: admitted={admitted} must be distinct indices "
                             f"into the {len(waiting)} waiting requests")
        for i in preempted:
            self._preempt(running[i], out)
        self.running = []
        for req in [running[i] for i in decoded] + [waiting[j] for j in admitted]:
            seq = req.seqs[0]
            if req.status is Status.WAITING:
                self.blocks.allocate(seq.seq_id, seq.num_tokens)
                self.waiting.remove(req)
                req.status = Status.RUNNING
            else:
                out.copies += self.blocks.reserve(seq.seq_id, seq.num_tokens)
            out.seqs.append(ScheduledSeq(seq, seq.num_uncomputed))
            out.requests.append(req)
            self.running.append(req)
        return out


class FunctionAttention:
    """The engine's paged attention backend computed by ``fn``, a function with exercise 4's
    contract (``fn(q, k_cache, v_cache, block_table, seq_len)`` -> [T, H, D], one sequence,
    as many KV heads as query heads), called once per sequence per layer per step. The
    adapter hands ``fn`` the sequence's own blocks of the pool, each KV head repeated for its
    query heads (grouped-query attention), in a shuffled order with the matching table."""

    name, reads_direct, cpu_fast_path = "exercise", False, False

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn, self.gen = fn, torch.Generator().manual_seed(0)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: PagedMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[2]
        for s, (start, t) in enumerate(zip(meta.starts, meta.q_lens)):
            seq_len = int(meta.seq_lens[s])
            n = blocks_for(seq_len, meta.block_size)
            own = meta.block_tables[s, :n].long()
            order = torch.randperm(n, generator=self.gen)       # where each block now sits
            blocks_k = torch.empty_like(k_cache[own]).index_copy_(0, order, k_cache[own])
            blocks_v = torch.empty_like(v_cache[own]).index_copy_(0, order, v_cache[own])
            out[start:start + t] = self.fn(
                q[start:start + t], blocks_k.repeat_interleave(group, dim=2),
                blocks_v.repeat_interleave(group, dim=2), order.tolist(), seq_len)
        return out


def check_schedule_step_in_engine(fn: Callable[..., tuple], model: Transformer | None = None,
                                  prompts: list[list[int]] | None = None,
                                  output_lens: list[int] | None = None, num_kv_blocks: int = 24,
                                  block_size: int = 4) -> Result:
    """Exercise 5's ``schedule_step`` schedules a real engine (:class:`FunctionStep`): every
    prompt at once, greedy, into a pool of ``num_kv_blocks`` (small enough to preempt), on
    ``model`` (default: the tiny preset, random weights, float64). Passes when every request
    gets the package engine's tokens in as many steps with as many preemptions (at least one),
    and every block is free at the end; prints both runs' steps and seconds."""
    model = model or demo_model()
    if prompts is None:
        prompts, output_lens = demo_prompts()
    opts = dict(num_kv_blocks=num_kv_blocks, block_size=block_size, watermark=0.0,
                enable_chunked_prefill=False, preemption="recompute")
    step = type("StudentStep", (FunctionStep,), {"decide": staticmethod(fn)})

    def attempt() -> None:
        fn([], [1], 10, block_size, 4, 64)          # a stub raises NotImplementedError here
        ref = serve_greedy(LLMEngine(model, None, EngineConfig(**opts)), prompts, output_lens)
        mine = serve_greedy(LLMEngine(model, None, EngineConfig(scheduler_cls=step, **opts)),
                      prompts, output_lens)
        assert_same_tokens(mine, ref)
        assert (mine["steps"], mine["preemptions"]) == (ref["steps"], ref["preemptions"]), (
            f"the same tokens, but {mine['steps']} steps and {mine['preemptions']} preemptions "
            f"where the package's scheduler took {ref['steps']} and {ref['preemptions']}")
        assert mine["preemptions"] > 0, "no request was preempted: the pool was large enough"
        print(f"your schedule_step: {mine['steps']} steps, {mine['seconds']:.2f} s, "
              f"{mine['preemptions']} preemptions; the package's: {ref['steps']} steps, "
              f"{ref['seconds']:.2f} s, {ref['preemptions']} preemptions")

    return check("schedule_step_in_engine", attempt)


def check_paged_attention_in_engine(fn: Callable[..., torch.Tensor],
                                    model: Transformer | None = None,
                                    prompts: list[list[int]] | None = None,
                                    output_lens: list[int] | None = None,
                                    block_size: int = 4) -> Result:
    """Exercise 4's ``paged_attention`` is the engine's attention backend
    (:class:`FunctionAttention`): every layer of every prefill and decode step. Passes when
    every request gets the tokens of the engine with its own backend (sdpa) on ``model``
    (default: the tiny preset, random weights, float64) and every block is free at the end;
    prints both runs' seconds."""
    model = model or demo_model()
    if prompts is None:
        prompts, output_lens = demo_prompts(4)
    opts = dict(num_kv_blocks=64, block_size=block_size)

    def attempt() -> None:
        ref = serve_greedy(LLMEngine(model, None, EngineConfig(attention_backend="sdpa", **opts)),
                     prompts, output_lens)
        mine = serve_greedy(LLMEngine(model, None, EngineConfig(attention_backend=FunctionAttention(
            fn), **opts)), prompts, output_lens)
        assert_same_tokens(mine, ref)
        print(f"your paged attention served {sum(map(len, mine['tokens']))} tokens in "
              f"{mine['seconds']:.2f} s; the package's sdpa backend {ref['seconds']:.2f} s")

    return check("paged_attention_in_engine", attempt)


__all__ = ["FunctionAttention", "FunctionStep", "check_block_manager", "check_blocks_needed",
           "check_fcfs_admit", "check_kv_waste", "check_paged_attention",
           "check_paged_attention_in_engine", "check_schedule_step",
           "check_schedule_step_in_engine"]
