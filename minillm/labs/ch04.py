"""Checkers for the exercises of chapter 04 (batching, scheduling and paging).

Each ``check_*`` compares the student's function with the package's block manager or scheduler
on a few cases, prints a one-line verdict and returns a :class:`~minillm.labs.common.Result`
(``passed`` is None while the exercise still raises NotImplementedError).
"""
from __future__ import annotations

import random
from collections.abc import Callable

from ..cache.block_manager import BlockManager
from ..config import SamplingParams
from ..engine.outputs import EngineStats
from ..engine.scheduler import Scheduler, SchedulerConfig
from ..engine.sequence import Request
from .common import Result, check


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


__all__ = ["check_blocks_needed", "check_fcfs_admit", "check_kv_waste"]
