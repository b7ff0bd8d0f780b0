"""Checkers for the exercises of chapter 07 (prefill/decode scheduling and disaggregation).

- :func:`check_schedule_step`: one chunked-prefill step under a token budget, compared with the
  plan of the package's :class:`minillm.engine.scheduler.Scheduler` on states it reaches;
  :func:`check_schedule_step_in_engine`: that step schedules a real engine
  (:class:`ChunkedFunctionStep`) through a workload whose long prompts arrive while others
  decode, step for step as the package's chunked policy.
- :func:`check_scatter_kv`: the decode side of a KV transfer (a contiguous K/V buffer into the
  blocks of a paged pool), against a loop over the tokens; :func:`check_scatter_kv_in_engine`:
  a prompt prefilled on one engine, its KV gathered, scattered by the student's function into a
  second engine (other block size, shuffled blocks) that decodes it: the colocated tokens.
- :func:`check_ttft_tpot`: the two SLO metrics of a request from its token times.
- :func:`check_goodput`: DistServe's goodput of a rate sweep, compared with the rule of
  :mod:`minillm.course.placement` (the highest rate below the lowest one that misses).
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from ..cache.block_manager import BlockManager, blocks_for
from ..cache.pool import PagedKVPool
from ..config import SamplingParams
from ..engine import EngineConfig, LLMEngine
from ..engine.connector import KVConnector
from ..engine.plan import ScheduledSeq, SchedulerOutput
from ..engine.scheduler import Scheduler, SchedulerConfig
from ..engine.sequence import Request, Status
from ..model.transformer import Transformer
from ..serving_metrics import SLO, goodput_of, tpot
from .common import Result, check
from .in_engine import assert_same_tokens, demo_model, demo_prompts, finish_all, serve_greedy

# --- one scheduling step -------------------------------------------------------------------


def scheduler_states(seed: int = 0, steps: int = 40):
    """Run the package's chunked scheduler on a seeded random arrival stream and yield, before
    each step, (decoding ids, [(prompt id, tokens left to prefill)] in arrival order, budget,
    the package's plan {request id: tokens})."""
    rng = random.Random(seed)
    budget = rng.choice([8, 16, 32, 64])
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=budget,
                                      step_policy="chunked"), BlockManager(4096, 16), 1 << 16)
    left: dict[str, int] = {}
    n = 0
    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            rid = f"r{n}"
            n += 1
            left[rid] = rng.randint(1, 6)
            sched.add(Request(rid, [rng.randint(5, 99) for _ in range(rng.randint(1, 90))],
                              SamplingParams(max_tokens=left[rid])))
        if not sched.has_unfinished():
            continue
        decoding = [r.request_id for r in sched._sorted(sched.running)
                    if not sched._prefilling(r)]
        prompts = [(r.request_id, r.num_new_tokens)
                   for r in sched._sorted(sched.running) + sched._sorted(sched.waiting)
                   if sched._prefilling(r) or r in sched.waiting]
        fits = len(sched.running) + len(sched.waiting) <= budget   # sequences never bind
        plan = sched.schedule()
        want = {r.request_id: plan.tokens_of(r) for r in plan.requests}
        if fits:
            yield decoding, prompts, budget, want
        for w in plan.seqs:
            done = w.completes
            w.seq.num_computed += w.num_tokens
            if done:
                w.seq.token_ids.append(7)
        for r in list(sched.running):
            out = len(r.seqs[0].token_ids) - len(r.prompt_ids)
            if out >= left[r.request_id]:
                sched.finish(r)


def _step_cases():
    cases = [(["d0", "d1", "d2"], [("p", 100)], 64, {"d0": 1, "d1": 1, "d2": 1, "p": 61}),
             ([], [("a", 10), ("b", 10)], 16, {"a": 10, "b": 6}),
             (["d0"], [("a", 15)], 16, {"d0": 1, "a": 15}),
             (["d0", "d1"], [], 8, {"d0": 1, "d1": 1}),
             (["d0", "d1"], [("a", 6), ("b", 3)], 8, {"d0": 1, "d1": 1, "a": 6})]
    for seed in range(12):
        cases += list(scheduler_states(seed))
    return cases


def check_schedule_step(fn: Callable) -> Result:
    """``fn(decoding, prompts, budget)`` -> {request id: tokens this step}. ``decoding``: ids of
    running requests that need one token each; ``prompts``: (id, tokens left to prefill) in
    arrival order. Decodes first, then the rest of the budget to prompts in order, a prompt
    longer than the room left getting a chunk of the room; ids with 0 tokens are left out.
    Compared with the package scheduler's plan on the states it reaches."""
    cases = _step_cases()

    def attempt() -> None:
        for decoding, prompts, budget, want in cases:
            got = fn(list(decoding), [tuple(p) for p in prompts], budget)
            got = {str(k): int(v) for k, v in dict(got).items() if int(v)}
            assert got == want, (f"decoding={decoding}, prompts={prompts}, budget={budget}: "
                                 f"expected {want}, got {got}")

    return check("schedule_step", attempt)


# --- the student's chunked step inside the engine ---------------------------------------------


class ChunkedFunctionStep(Scheduler):
    """The engine's scheduler with each step's token split taken by ``decide``, a function with
    :func:`check_schedule_step`'s contract: ``decide(decoding, prompts, budget)`` -> {request
    id: tokens}. ``decoding``: the running requests past their prompt, in arrival order;
    ``prompts``: (id, tokens left to prefill) of the running requests still prefilling, then of
    the waiting ones, in arrival order; ``budget``: ``max_num_batched_tokens``. This class
    carries the split out: a decode computes its token, a prompt its chunk (admitted first if
    it was waiting), blocks grown by the engine's block manager; the engine checks the plan
    (the budget among its rules). No preemption: the pool must hold every request. One
    sequence per request."""

    decide: Callable[..., dict] = staticmethod(lambda decoding, prompts, budget: {})

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished=self._finished)
        self._finished = []
        running, waiting = self._sorted(self.running), self._sorted(self.waiting)
        decoding = [r for r in running if not self._prefilling(r)]
        queue = [r for r in running if self._prefilling(r)] + waiting
        plan = self.decide([r.request_id for r in decoding],
                           [(r.request_id, r.num_new_tokens) for r in queue],
                           self.config.max_num_batched_tokens)
        plan = {str(k): int(v) for k, v in dict(plan).items()}
        left = {r.request_id: r.num_new_tokens for r in decoding + queue}
        bad = {k: v for k, v in plan.items() if k not in left or not 0 <= v <= left[k]}
        if bad:
            raise ValueError(f"schedule_step returned {bad}: ids must be among the decoding "
                             f"and prompt ids, tokens between 0 and the tokens each has left "
                             f"({left})")
        for req in running + waiting:
            n = plan.get(req.request_id, 0)
            if n:
                self._run(req, n, out)
        if not out.requests and self.has_unfinished():
            raise ValueError(f"schedule_step scheduled no token for decoding="
                             f"{[r.request_id for r in decoding]}, prompts="
                             f"{[(r.request_id, r.num_new_tokens) for r in queue]}: the engine "
                             f"would never finish")
        return out

    def _run(self, req: Request, n: int, out: SchedulerOutput) -> None:
        """Give ``req``'s sequence slots for ``n`` more tokens and put it in the plan."""
        seq = req.seqs[0]
        end = seq.num_computed + n
        waiting = req.status is Status.WAITING
        if not (self.blocks.can_allocate(end) if waiting else
                self.blocks.blocks_to_reserve(seq.seq_id, end) <= self.blocks.num_free):
            raise ValueError(f"the KV pool ({self.blocks.num_blocks} blocks) is too small for "
                             f"this workload: ChunkedFunctionStep does not preempt")
        if waiting:
            self.blocks.allocate(seq.seq_id, end)
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
        else:
            out.copies += self.blocks.reserve(seq.seq_id, end)
        out.seqs.append(ScheduledSeq(seq, n))
        out.requests.append(req)


def serve_arrivals(engine: LLMEngine, prompts: list[list[int]], output_lens: list[int],
                   arrival_steps: list[int]) -> dict:
    """Greedy, request i (id ``str(i)``) added before step ``arrival_steps[i]``: a clock that
    counts steps, so every engine sees the same arrivals whatever its speed (a step with
    nothing to run still counts). Returns the tokens per request, ``plans`` (per step, {request
    id: tokens}), and per request the ``arrival`` and the ``times`` of its tokens
    (time.perf_counter s, each token stamped at the end of its step); AssertionError on a
    failed request or on a KV block still in use at the end."""
    n = len(prompts)
    order = sorted(range(n), key=lambda i: arrival_steps[i])
    done, plans, arrival = {}, [], {}
    times: dict[str, list[float]] = {str(i): [] for i in range(n)}
    nxt, clock = 0, 0
    while nxt < n or engine.has_unfinished():
        while nxt < n and arrival_steps[order[nxt]] <= clock:
            i = order[nxt]
            arrival[str(i)] = time.perf_counter()
            engine.add_request(prompts[i], SamplingParams(
                temperature=0.0, max_tokens=output_lens[i], ignore_eos=True), request_id=str(i))
            nxt += 1
        clock += 1
        if not engine.has_unfinished():
            continue
        ran = engine.num_steps
        outs = engine.step()
        now = time.perf_counter()
        if engine.num_steps > ran:
            plans.append(dict(engine.trace[-1].scheduled))
        for o in outs:
            times[o.request_id] += [now] * (len(o.token_ids) - len(times[o.request_id]))
            if o.finished:
                done[o.request_id] = o
    failed = [o for o in done.values() if o.outputs[0].finish_reason == "error"]
    assert not failed, f"request {failed[0].request_id} failed: {failed[0].error}"
    free, total = engine.blocks.num_free, engine.blocks.num_blocks
    assert free == total, f"{total - free} KV blocks still in use after every request finished"
    ids = [str(i) for i in range(n)]
    return {"tokens": [done[i].token_ids for i in ids], "plans": plans,
            "arrival": [arrival[i] for i in ids], "times": [times[i] for i in ids]}


def worst_gap(run: dict) -> float:
    """The longest wait (s) between two consecutive tokens of one request in a
    :func:`serve_arrivals` run."""
    return max((b - a for t in run["times"] for a, b in zip(t, t[1:])), default=0.0)


def late_prompts_workload(decode_prompts: list[list[int]] | None = None,
                          long_prompts: list[list[int]] | None = None, decode_tokens: int = 24,
                          long_tokens: int = 4, gap_steps: int = 4
                          ) -> tuple[list[list[int]], list[int], list[int]]:
    """(prompts, output lengths, arrival steps): the ``decode_prompts`` arrive at step 0 and
    decode ``decode_tokens`` each; long prompt j arrives at step ``(j + 1) * gap_steps`` and
    generates ``long_tokens``. Defaults: four seeded prompts of 6-12 tokens and two of 50-70
    (random ids)."""
    g = torch.Generator().manual_seed(5)
    if decode_prompts is None:
        decode_prompts = [torch.randint(5, 2000, (int(n),), generator=g).tolist()
                          for n in torch.randint(6, 13, (4,), generator=g)]
    if long_prompts is None:
        long_prompts = [torch.randint(5, 2000, (int(n),), generator=g).tolist()
                        for n in torch.randint(50, 71, (2,), generator=g)]
    prompts = list(decode_prompts) + list(long_prompts)
    lens = [decode_tokens] * len(decode_prompts) + [long_tokens] * len(long_prompts)
    steps = [0] * len(decode_prompts) + [(j + 1) * gap_steps for j in range(len(long_prompts))]
    return prompts, lens, steps


def check_schedule_step_in_engine(fn: Callable[..., dict], model: Transformer | None = None,
                                  prompts: list[list[int]] | None = None,
                                  output_lens: list[int] | None = None,
                                  arrival_steps: list[int] | None = None, budget: int = 16,
                                  block_size: int = 4) -> Result:
    """Exercise ``schedule_step`` is the step policy of a real engine
    (:class:`ChunkedFunctionStep`) with a token budget of ``budget``: requests arrive at their
    ``arrival_steps`` (default :func:`late_prompts_workload`: long prompts arriving while
    others decode) and run greedy on ``model`` (default: the tiny preset, random weights,
    float64). Passes when every request gets the tokens of the package's chunked policy
    (``step_policy="chunked"``), every step runs the same tokens per request as there, the
    engine's plan check (the budget among its rules) never fails a request, and every block is
    free at the end. Prints the worst inter-token gap of your run, of the package's chunked
    one and of prefill-first (whole prompts: a budget of the longest request), and the mean
    time to first token of the prompts that arrive later."""
    model = model or demo_model()
    if prompts is None:
        prompts, output_lens, arrival_steps = late_prompts_workload()
    if output_lens is None or arrival_steps is None:
        raise ValueError("pass prompts, output_lens and arrival_steps together "
                         "(ch07.late_prompts_workload builds all three)")
    num_blocks = sum(blocks_for(len(p) + m, block_size) + 1 for p, m in zip(prompts, output_lens))
    opts = dict(max_num_batched_tokens=budget, max_num_seqs=len(prompts),
                block_size=block_size, num_kv_blocks=num_blocks, watermark=0.0)
    step = type("StudentChunkedStep", (ChunkedFunctionStep,), {"decide": staticmethod(fn)})
    late = [i for i, s in enumerate(arrival_steps) if s > 0]

    def run(**config) -> dict:
        engine = LLMEngine(model, None, EngineConfig(**{**opts, **config}))
        return serve_arrivals(engine, prompts, output_lens, arrival_steps)

    def ttft(r: dict) -> float:
        return sum(r["times"][i][0] - r["arrival"][i] for i in late) / max(1, len(late))

    def attempt() -> None:
        fn([], [("a", 1)], budget)               # a stub raises NotImplementedError here
        run(step_policy="chunked")               # unmeasured: each batch shape's first run is slow
        ref = run(step_policy="chunked")
        mine = run(step_policy="chunked", scheduler_cls=step)
        assert_same_tokens(mine, ref)
        for k, (a, b) in enumerate(zip(mine["plans"], ref["plans"])):
            assert a == b, (f"step {k}: your schedule_step ran {a} (request id: tokens), the "
                            f"package's chunked policy {b}")
        assert len(mine["plans"]) == len(ref["plans"]), (
            f"{len(mine['plans'])} steps, the package's chunked policy took {len(ref['plans'])}")
        longest = max(len(p) + m for p, m in zip(prompts, output_lens))
        whole = run(step_policy="prefill_first", max_num_batched_tokens=max(budget, longest))
        print(f"worst inter-token gap: your schedule_step {worst_gap(mine) * 1e3:.1f} ms, the "
              f"package's chunked {worst_gap(ref) * 1e3:.1f} ms, prefill-first "
              f"{worst_gap(whole) * 1e3:.1f} ms; late prompts' mean TTFT: yours "
              f"{ttft(mine) * 1e3:.1f} ms, chunked {ttft(ref) * 1e3:.1f} ms, prefill-first "
              f"{ttft(whole) * 1e3:.1f} ms ({len(mine['plans'])} steps of at most {budget} "
              f"tokens)")

    return check("schedule_step_in_engine", attempt)


# --- the decode side of a KV transfer ---------------------------------------------------------


def _scatter_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, block_table: list[int]) -> None:
    """Token by token: position t of every layer to block ``block_table[t // bs]``, slot
    ``t % bs``."""
    bs = k_cache.shape[2]
    for t in range(k.shape[1]):
        k_cache[:, block_table[t // bs], t % bs] = k[:, t]
        v_cache[:, block_table[t // bs], t % bs] = v[:, t]


def check_scatter_kv(fn: Callable[..., None]) -> Result:
    """``fn(k, v, k_cache, v_cache, block_table)`` -> None: write one sequence's K and V,
    received as contiguous buffers ``k``, ``v`` [L, T, Hkv, D] (token t of layer l at
    ``k[l, t]``), into the paged pools ``k_cache``, ``v_cache`` [L, num_blocks, block_size,
    Hkv, D], in place: token t goes to block ``block_table[t // block_size]``, slot ``t %
    block_size``, in every layer. ``block_table`` lists ceil(T / block_size) block ids. Every
    other block keeps its contents (the slots of the last block past T may change)."""
    gen = torch.Generator().manual_seed(6)
    cases = [(1, 4, 2), (4, 4, 2), (5, 4, 3), (13, 4, 2), (16, 16, 1), (33, 8, 3), (7, 1, 2)]

    def attempt() -> None:
        for t, bs, layers in cases:
            h, d, nb = 2, 4, blocks_for(t, bs) + 6
            k = torch.randn(layers, t, h, d, generator=gen, dtype=torch.float64)
            v = torch.randn(layers, t, h, d, generator=gen, dtype=torch.float64)
            k_cache = 100 * torch.randn(layers, nb, bs, h, d, generator=gen, dtype=torch.float64)
            v_cache = 100 * torch.randn(layers, nb, bs, h, d, generator=gen, dtype=torch.float64)
            table = torch.randperm(nb, generator=gen)[:blocks_for(t, bs)].tolist()
            want_k, want_v = k_cache.clone(), v_cache.clone()
            _scatter_reference(k, v, want_k, want_v, table)
            before = k_cache.clone()
            fn(k.clone(), v.clone(), k_cache, v_cache, list(table))
            where = f"T={t}, block_size={bs}, {layers} layers, block_table={table}"
            assert not torch.equal(k_cache, before), (
                f"{where}: k_cache is unchanged (write into k_cache and v_cache in place)")
            last = table[-1]
            used = (t - 1) % bs + 1             # slots of the last block that hold tokens
            for name, got, want in (("k_cache", k_cache, want_k), ("v_cache", v_cache, want_v)):
                got, want = got.clone(), want.clone()
                got[:, last, used:] = want[:, last, used:] = 0
                wrong = (got != want).flatten(2).any(-1).nonzero().tolist()
                if wrong:
                    layer, block = wrong[0]
                    role = f"block {block} (logical block {table.index(block)})" \
                        if block in table else f"block {block}, not in the table,"
                    raise AssertionError(f"{where}: {name}[{layer}] {role} holds the wrong "
                                         f"values")

    return check("scatter_kv", attempt)


class PoolAccess(KVConnector):
    """A KV connector that only keeps the engine's KV pool: the seam through which KV enters or
    leaves an engine from outside (disaggregation's workers use one like it)."""

    def __init__(self) -> None:
        self.pool: PagedKVPool | None = None

    def register_kv_pool(self, pool: PagedKVPool, tables: dict[int, list[int]]) -> None:
        self.pool = pool


class ShuffledAllocator:
    """A block allocator (``EngineConfig(block_allocator=...)``) that hands out free blocks in
    a seeded random order, so a sequence's blocks are not consecutive by luck."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.free = list(range(num_blocks))
        self.rng.shuffle(self.free)

    def take(self) -> int:
        return self.free.pop()

    def put(self, block: int) -> None:
        self.free.insert(self.rng.randrange(len(self.free) + 1), block)

    def __len__(self) -> int:
        return len(self.free)

    def __iter__(self) -> Iterator[int]:
        return iter(self.free)


def gather_kv(pool: PagedKVPool, blocks: list[int], num_tokens: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V of a sequence's first ``num_tokens`` tokens, whose blocks are ``blocks``,
    as contiguous [L, num_tokens, Hkv, D] buffers (the sender's half)."""
    idx = torch.tensor(blocks, device=pool.k.device)
    return tuple(x[:, idx].flatten(1, 2)[:, :num_tokens].clone() for x in (pool.k, pool.v))


def prefill_and_hand_off(fn: Callable[..., None], model: Transformer,
                         prompts: list[list[int]], output_lens: list[int],
                         prefill_config: EngineConfig, decode_config: EngineConfig) -> dict:
    """Disaggregation in one process: an engine with ``prefill_config`` computes every prompt
    and its first token, keeping the prompt's blocks (``hold_kv``); their K/V is gathered
    (:func:`gather_kv`); an engine with ``decode_config`` (a pool full of noise) allocates
    blocks for each prompt, ``fn`` (:func:`check_scatter_kv`'s contract) writes the K/V into
    them, and the engine adopts the request (``add_prefilled``) and decodes it. Returns
    :func:`serve_greedy`'s dict for the decode engine (first tokens included) and the bytes
    and seconds ``fn`` took; AssertionError on a failed request or a block left in use."""
    prefill_side, decode_side = PoolAccess(), PoolAccess()
    prefill = LLMEngine(model, None, replace(prefill_config, kv_connector=prefill_side))
    decode = LLMEngine(model, None, replace(decode_config, kv_connector=decode_side))
    held = {}
    for i, p in enumerate(prompts):
        rid = prefill.add_request(p, SamplingParams(temperature=0.0, max_tokens=1,
                                                    ignore_eos=True), request_id=str(i))
        held[rid] = prefill.hold_kv(rid)
    first = {}
    while prefill.has_unfinished():
        for o in prefill.step():
            if o.finished:
                assert o.outputs[0].finish_reason != "error", f"request {o.request_id}: {o.error}"
                first[o.request_id] = o.token_ids[0]
    gen = torch.Generator(device=decode_side.pool.k.device).manual_seed(7)
    for x in (decode_side.pool.k, decode_side.pool.v):
        x.copy_(10 * torch.randn(x.shape, generator=gen, device=x.device))
    nbytes, seconds = 0, 0.0
    for i, (p, m) in enumerate(zip(prompts, output_lens)):
        rid, n = str(i), len(p)
        k, v = gather_kv(prefill_side.pool, prefill.kv_blocks(held[rid], n), n)
        prefill.release_kv(held[rid])
        seq_id = decode.allocate_kv(n)
        t0 = time.perf_counter()
        fn(k, v, decode_side.pool.k, decode_side.pool.v, decode.kv_blocks(seq_id, n))
        seconds += time.perf_counter() - t0
        nbytes += 2 * k.numel() * k.element_size()
        decode.add_prefilled(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True),
                             [first[rid]], seq_id, request_id=rid)
    left = prefill.blocks.num_blocks - prefill.blocks.num_free
    assert left == 0, f"{left} blocks of the prefill engine still in use after the hand-off"
    run = finish_all(decode, [str(i) for i in range(len(prompts))])
    return {**run, "bytes": nbytes, "scatter_seconds": seconds}


def check_scatter_kv_in_engine(fn: Callable[..., None], model: Transformer | None = None,
                               prompts: list[list[int]] | None = None,
                               output_lens: list[int] | None = None,
                               prefill_block_size: int = 4, decode_block_size: int = 8
                               ) -> Result:
    """Exercise ``scatter_kv`` is the receiving half of a prefill/decode hand-off
    (:func:`prefill_and_hand_off`): a prefill engine (blocks of ``prefill_block_size``)
    computes every prompt and its first token, the K/V of each prompt is gathered into
    contiguous buffers, and your function writes them into the blocks a decode engine (blocks
    of ``decode_block_size``, handed out in a shuffled order, a pool full of noise) allocated
    for it; the decode engine then adopts and decodes the requests. Passes when every request
    gets the tokens of one colocated engine (``decode_block_size``) on ``model`` (default: the
    tiny preset, random weights, float64) and no block of either engine stays in use."""
    model = model or demo_model()
    if prompts is None:
        prompts, output_lens = demo_prompts(6)
    pool_blocks = {bs: sum(blocks_for(len(p) + m, bs) + 1 for p, m in zip(prompts, output_lens))
                   for bs in (prefill_block_size, decode_block_size)}
    budget = max(sum(map(len, prompts)), len(prompts), decode_block_size)

    def config(bs: int, **extra) -> EngineConfig:
        return EngineConfig(block_size=bs, num_kv_blocks=pool_blocks[bs], watermark=0.0,
                            max_num_seqs=len(prompts), max_num_batched_tokens=budget, **extra)

    def attempt() -> None:
        ref = serve_greedy(LLMEngine(model, None, config(decode_block_size,
                                                         kv_connector=PoolAccess())),
                           prompts, output_lens)
        mine = prefill_and_hand_off(fn, model, prompts, output_lens,
                                    config(prefill_block_size),
                                    config(decode_block_size,
                                           block_allocator=ShuffledAllocator))
        assert_same_tokens(mine, ref)
        print(f"your scatter_kv wrote {mine['bytes'] / 2**10:.0f} KiB of K/V for "
              f"{len(prompts)} prompts in {mine['scatter_seconds'] * 1e3:.1f} ms (blocks of "
              f"{prefill_block_size} tokens on the prefill side, {decode_block_size} on the "
              f"decode side); the decode engine's {sum(map(len, mine['tokens']))} tokens equal "
              f"the colocated engine's")

    return check("scatter_kv_in_engine", attempt)


# --- TTFT and TPOT ------------------------------------------------------------------------------


def _ttft_tpot_cases():
    rng = random.Random(8)
    cases = [(0.0, [0.5]), (1.0, [1.25, 1.5, 1.75]), (2.0, [2.0, 2.0]), (0.0, [0.1, 0.1, 0.7])]
    for _ in range(30):
        arrival = rng.random() * 5
        times, t = [], arrival + rng.random()
        for _ in range(rng.randint(1, 12)):
            t += rng.random() * 0.2
            times.append(round(t, 6))
        cases.append((round(arrival, 6), times))
    return cases


def check_ttft_tpot(fn: Callable[[float, list[float]], tuple]) -> Result:
    """``fn(arrival, token_times)`` -> (ttft, tpot) in seconds, for one request that arrived at
    ``arrival`` and whose output tokens came at ``token_times`` (non-decreasing, at least one):
    TTFT from arrival to the first token; TPOT the mean time per output token after the first
    (0 for a single token). Compared with :func:`minillm.serving_metrics.tpot`."""
    cases = _ttft_tpot_cases()

    def attempt() -> None:
        for arrival, times in cases:
            got = tuple(float(x) for x in fn(arrival, list(times)))
            want = (times[0] - arrival, tpot(times[0], times[-1], len(times)))
            assert len(got) == 2 and all(abs(a - b) < 1e-9 for a, b in zip(got, want)), (
                f"arrival={arrival}, token_times={times}: expected (ttft, tpot) = {want}, got "
                f"{got}")

    return check("ttft_tpot", attempt)


# --- goodput -------------------------------------------------------------------------------


def _goodput(curve, ttft_slo: float, tpot_slo: float, attainment: float = 0.9) -> float:
    """The package's rule on a sweep ``curve`` = [(rate, [(ttft, tpot), ...]), ...]."""
    slo = SLO(ttft_slo, tpot_slo)
    return goodput_of([(rate, sum(slo.met(a, b) for a, b in reqs) / len(reqs))
                       for rate, reqs in curve], attainment)


def _goodput_cases():
    rng = random.Random(7)
    cases = [([(1.0, [(0.1, 0.01)] * 10), (2.0, [(0.1, 0.01)] * 9 + [(0.1, 0.5)])], 0.2, 0.05,
              0.9),
             ([(1.0, [(0.1, 0.01)] * 10), (2.0, [(0.1, 0.01)] * 8 + [(0.5, 0.01)] * 2)], 0.2,
              0.05, 0.9),
             ([(2.0, [(0.3, 0.01)] * 4), (1.0, [(0.1, 0.01)] * 4)], 0.2, 0.05, 0.9),
             ([(1.0, [(0.3, 0.01)] * 4)], 0.2, 0.05, 0.5),
             # requests exactly at an SLO meet it
             ([(1.0, [(0.2, 0.05)] * 10), (2.0, [(0.2, 0.01)] * 10), (3.0, [(0.5, 0.5)] * 10)],
              0.2, 0.05, 0.9)]
    for _ in range(60):
        curve = []
        for k in range(rng.randint(1, 6)):
            load = rng.random() * (k + 1)
            curve.append((round(0.5 * (k + 1), 2),
                          [(rng.random() * load, rng.random() * 0.05 * load)
                           for _ in range(rng.randint(1, 12))]))
        rng.shuffle(curve)
        cases.append((curve, 0.5, 0.05, rng.choice([0.5, 0.8, 0.9, 1.0])))
    return cases


def check_goodput(fn: Callable) -> Result:
    """``fn(curve, ttft_slo, tpot_slo, attainment)`` -> goodput (requests/s). ``curve``: a list
    of (rate, [(ttft, tpot), ...] per request) in any order. A request is good when it meets
    both SLOs; a rate passes when at least ``attainment`` of its requests are good; goodput is
    the highest rate below the lowest rate that fails (0 if the lowest fails)."""
    cases = _goodput_cases()

    def attempt() -> None:
        for curve, a, b, att in cases:
            want = _goodput(curve, a, b, att)
            got = float(fn([(r, list(q)) for r, q in curve], a, b, att))
            short = [(r, len(q)) for r, q in curve]
            assert abs(got - want) < 1e-9, (
                f"rates (requests per rate) {short}, SLO ttft {a} s / tpot {b} s, attainment "
                f"{att}: expected goodput {want}, got {got}")

    return check("goodput", attempt)
