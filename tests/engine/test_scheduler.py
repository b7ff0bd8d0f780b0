"""The scheduler alone: ``Scheduler.schedule`` and ``update_from_output`` driven by hand-written
runner outputs, with no model and no tensors (vLLM v1's scheduler tests with mock outputs).

Each test builds a Scheduler over a BlockManager of 4-token blocks, adds Requests, and plays the
runner itself: every sequence whose chunk completes gets one sampled token. The plans are
checked against exact token counts per request; after every step the block manager's
invariants hold (``check``) and at the end of every test every block is free. (conftest also
checks each plan's token budget and sequence limit.)
"""
from __future__ import annotations

from dataclasses import dataclass

from minillm import SamplingParams
from minillm.cache.block_manager import BlockManager
from minillm.cache.prefix import HashPrefixCache
from minillm.engine.config import SchedulerConfig
from minillm.engine.connector import KVConnector
from minillm.engine.plan import RunnerOutput, Sample, SchedulerOutput, StepUpdate
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import Request, Sequence, Status

BS = 4          # tokens per block
EOS = 2
TOKEN = 77      # what the fake runner samples unless told otherwise


def scheduler(num_blocks: int = 32, connector: KVConnector | None = None, cpu_blocks: int = 0,
              prefix: bool = False, **config) -> Scheduler:
    config.setdefault("max_num_seqs", 8)
    config.setdefault("max_num_batched_tokens", 16)
    blocks = BlockManager(num_blocks, BS, cpu_blocks, watermark=0,
                          prefix_cache=HashPrefixCache(BS) if prefix else None)
    return Scheduler(SchedulerConfig(**config), blocks, 256, connector, EOS)


def request(rid: str, prompt_len: int, priority: int = 0, **params) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(**params), priority)


def tokens(plan: SchedulerOutput) -> dict[str, int]:
    """{request id: tokens it computes in this step}, in plan order."""
    return {r.request_id: plan.tokens_of(r) for r in plan.requests}


def apply(sched: Scheduler, plan: SchedulerOutput, sampled: dict[str, int] | None = None):
    """The fake runner's output for ``plan``: every completing sequence samples
    ``sampled[request id]`` (default TOKEN); returns the update. The block manager's
    invariants must hold after it."""
    owner = {s.seq_id: r.request_id for r in plan.requests for s in r.seqs}
    samples = {w.seq.seq_id: [Sample([(sampled or {}).get(owner[w.seq.seq_id], TOKEN)], [0.0])]
               for w in plan.seqs if w.completes}
    upd = sched.update_from_output(plan, RunnerOutput(samples=samples))
    sched.blocks.check()
    return upd


@dataclass
class Step:
    """One step: its plan, and what it held when planned (the update changes the sequences):
    ``tokens`` {request id: tokens} in plan order, ``chunks`` (num_tokens, completes) of each
    scheduled sequence."""

    plan: SchedulerOutput
    tokens: dict[str, int]
    chunks: list[tuple[int, bool]]
    update: StepUpdate


def step(sched: Scheduler, sampled: dict[str, int] | None = None) -> Step:
    """schedule(), then :func:`apply`."""
    plan = sched.schedule()
    held = tokens(plan), [(w.num_tokens, w.completes) for w in plan.seqs]
    return Step(plan, *held, apply(sched, plan, sampled))


def finish_all(sched: Scheduler, *reqs: Request) -> None:
    """Abort what is left; then every block must be free."""
    for req in reqs:
        if not req.finished:
            sched.finish_request(req, "abort")
    assert not sched.has_unfinished()
    sched.blocks.check()
    assert sched.blocks.num_free == sched.blocks.num_blocks
    assert sched.blocks.cpu.num_free == sched.blocks.cpu.num_blocks
    assert sched.blocks.slots_in_use() == 0


def test_decodes_first_then_prompts_share_the_rest_in_arrival_order():
    """A decode takes 1 of the 16 tokens; b (10) runs whole, c gets the 5 left as a chunk, and
    its last 5 the step after. Catches: prompts admitted out of arrival order (c whole, b
    chunked), or a chunk's progress lost between steps."""
    sched = scheduler()
    a, b, c = request("a", 6), request("b", 10), request("c", 10)
    sched.add(a)
    assert step(sched).tokens == {"a": 6}
    sched.add(b)
    sched.add(c)
    now = step(sched).tokens
    assert now == {"a": 1, "b": 10, "c": 5} and list(now) == ["a", "b", "c"]
    assert step(sched).tokens == {"a": 1, "b": 1, "c": 5}
    finish_all(sched, a, b, c)


def test_a_decode_is_served_before_an_earlier_prompt_chunk():
    """With priorities, the running order puts a prompt (being chunked) before a decode: the
    decode still gets its token first and the chunk the 15 left. Catches: room given out in
    queue order (the chunk would take all 16 and the plan hold 17)."""
    sched = scheduler(policy="priority")
    low, urgent = request("low", 3, priority=1), request("urgent", 40, priority=0)
    sched.add(low)
    step(sched)                                      # low: its prompt, then decoding
    sched.add(urgent)
    assert step(sched).tokens == {"low": 1, "urgent": 15}
    now = step(sched).tokens
    assert now == {"urgent": 15, "low": 1} and list(now) == ["urgent", "low"]
    finish_all(sched, low, urgent)


def test_a_chunked_prompt_samples_only_on_its_last_chunk():
    """A 20-token prompt, budget 8: chunks of 8, 8, 4; only the last one completes, and a token
    is appended only then. Catches: a chunk marked complete early, or num_computed not advanced
    by a chunk that sampled nothing."""
    sched = scheduler(max_num_batched_tokens=8)
    req = request("a", 20)
    sched.add(req)
    seq = req.seqs[0]
    seen = []
    for _ in range(3):
        now = step(sched)
        seen.append((*now.chunks[0], seq.num_computed, len(seq.output_ids)))
    assert seen == [(8, False, 8, 0), (8, False, 16, 0), (4, True, 20, 1)]
    assert now.update.changed == [req] and seq.output_ids == [TOKEN] and seq.num_uncomputed == 1
    finish_all(sched, req)


def test_a_request_of_two_sequences_is_chunked_so_both_end_in_the_same_step():
    """Two sequences of 7 uncomputed tokens (a forked request after recompute), budget 8: each
    chunk stops short of its sequence's last token (6 + 2), then both complete together (1 + 5).
    Catches: a chunk allowed to reach the last token (7 + 1: the first ends a step early)."""
    sched = scheduler(max_num_batched_tokens=8)
    prompt = list(range(10, 16))
    seqs = [Sequence(prompt + [50], 6), Sequence(prompt + [51], 6)]
    req = Request("a", prompt, SamplingParams(n=2, max_tokens=8), seqs=seqs)
    sched.add(req)
    assert step(sched).chunks == [(6, False), (2, False)]
    assert step(sched).chunks == [(1, True), (5, True)]
    assert [s.output_ids for s in req.seqs] == [[50, TOKEN], [51, TOKEN]]
    finish_all(sched, req)


def test_without_chunked_prefill_a_prompt_waits_for_room_or_runs_alone():
    """Budget 16, no chunking: b (10) waits behind a (10) rather than being split, and a
    40-token prompt in an empty step runs whole and alone. Catches: a chunk of b scheduled, or
    the long prompt never admitted (it would wait forever)."""
    sched = scheduler(enable_chunked_prefill=False)
    a, b = request("a", 10), request("b", 10)
    sched.add(a)
    sched.add(b)
    assert step(sched).tokens == {"a": 10}
    assert step(sched).tokens == {"a": 1, "b": 10}
    finish_all(sched, a, b)
    long, short = request("long", 40), request("short", 3)
    sched.add(long)
    sched.add(short)
    assert step(sched).tokens == {"long": 40}
    assert step(sched).tokens == {"long": 1, "short": 3}
    finish_all(sched, long, short)


def test_max_num_seqs_caps_the_running_set():
    """max_num_seqs=2: c waits while a and b run, and joins the step after a finishes.
    Catches: admission that ignores the sequence limit (three would run)."""
    sched = scheduler(max_num_seqs=2)
    a, b, c = request("a", 4), request("b", 4), request("c", 4)
    for r in (a, b, c):
        sched.add(r)
    assert step(sched).tokens == {"a": 4, "b": 4}
    assert step(sched, {"a": EOS}).tokens == {"a": 1, "b": 1}
    assert sched.waiting == [c] and a.finished
    assert step(sched).tokens == {"b": 1, "c": 4}
    finish_all(sched, b, c)


def test_recompute_preempts_the_last_arrival_which_computes_everything_again():
    """Three 4-token prompts fill 3 of 4 blocks; a's growth takes the last, so b's growth
    preempts c (the last arrival, not b): c's blocks are freed, num_computed goes to 0 and it
    waits; when a finishes, c recomputes its prompt and its first token (5) and samples again.
    Catches: the wrong victim, or a recomputed sequence keeping its old num_computed."""
    sched = scheduler(num_blocks=4)
    a, b, c = request("a", 4), request("b", 4), request("c", 4)
    for r in (a, b, c):
        sched.add(r)
    assert step(sched).tokens == {"a": 4, "b": 4, "c": 4}
    now = step(sched, {"a": EOS})
    assert now.tokens == {"a": 1, "b": 1} and now.plan.preempted == [c]
    cs = c.seqs[0]
    assert cs.num_computed == 0 and cs.token_ids == c.prompt_ids + [TOKEN]
    assert sched.waiting == [c] and c.status is Status.WAITING
    assert c.metrics.num_preemptions == 1 and cs.seq_id not in sched.blocks.tables
    now = step(sched, {"c": 78})
    assert now.tokens == {"b": 1, "c": 5} and now.chunks == [(1, True), (5, True)]
    assert cs.output_ids == [TOKEN, 78] and cs.num_computed == 5
    finish_all(sched, b, c)


def test_swap_preempts_to_the_cpu_and_swaps_in_before_any_admission():
    """As above with swap: c's block goes to the CPU pool (swap_out pairs) and keeps its
    num_computed; d (which would fit) is not admitted while c is swapped out; once there is
    room, c comes back (swap_in pairs) and only then is d admitted. Catches: admitting past a
    swapped request, or swap pairs missing from the plan."""
    sched = scheduler(num_blocks=4, cpu_blocks=4, preemption="swap")
    a, b, c, d = (request(r, 4) for r in "abcd")
    for r in (a, b, c):
        sched.add(r)
    step(sched)
    c_block = sched.blocks.tables[c.seqs[0].seq_id][0]
    now = step(sched, {"a": EOS})                    # a frees its 2 blocks after the step
    assert now.tokens == {"a": 1, "b": 1} and now.plan.preempted == [c]
    assert now.plan.swap_out == [(c_block, 0)] and now.plan.swap_in == []
    assert sched.swapped == [c] and c.status is Status.SWAPPED and c.seqs[0].num_computed == 4
    sched.add(d)
    now = step(sched, {"b": EOS})                    # 2 free: c needs 3 (itself, growth, CoW)
    assert now.tokens == {"b": 1} and now.plan.swap_in == [] and sched.waiting == [d]
    now = step(sched)
    assert now.tokens == {"c": 1, "d": 4}
    assert now.plan.swap_in == [(0, sched.blocks.tables[c.seqs[0].seq_id][0])]
    assert c.seqs[0].output_ids == [TOKEN, TOKEN]
    finish_all(sched, c, d)


def test_priority_policy_orders_admission():
    """Budget 8: the urgent request (priority 0) arriving second is admitted whole and the
    earlier one (priority 1) gets the 2 tokens left. Catches: admission by arrival (6 + 2 the
    other way round)."""
    sched = scheduler(policy="priority", max_num_batched_tokens=8)
    late, urgent = request("late", 6, priority=1), request("urgent", 6, priority=0)
    sched.add(late)
    sched.add(urgent)
    now = step(sched).tokens
    assert now == {"urgent": 6, "late": 2} and list(now) == ["urgent", "late"]
    finish_all(sched, late, urgent)


def test_a_prefix_cache_hit_counts_as_computed_at_admission():
    """a's 10-token prompt leaves 2 full blocks in the cache. b (the same 8 tokens + 3 more)
    starts at 8 and computes 3, sharing a's two blocks; c (exactly those 8 tokens) may reuse
    only 1 block: its last token is always computed. Catches: the hit not counted (11 tokens),
    or a hit that swallows the last token (c computing 0)."""
    sched = scheduler(prefix=True)
    a = request("a", 10)
    sched.add(a)
    step(sched)
    b = Request("b", a.prompt_ids[:8] + [90, 91, 92], SamplingParams(max_tokens=8))
    c = Request("c", a.prompt_ids[:8], SamplingParams(max_tokens=8))
    sched.add(b)
    sched.add(c)
    plan = sched.schedule()
    assert tokens(plan) == {"a": 1, "b": 3, "c": 4}
    assert [w.seq.num_computed for w in plan.seqs] == [10, 8, 4]
    assert b.metrics.cached_tokens == 8 and c.metrics.cached_tokens == 4
    tables = sched.blocks.tables
    assert tables[b.seqs[0].seq_id][:2] == tables[a.seqs[0].seq_id][:2]
    assert tables[c.seqs[0].seq_id][0] == tables[a.seqs[0].seq_id][0]
    apply(sched, plan)
    finish_all(sched, a, b, c)


class Claims(KVConnector):
    """Claims ``n`` leading tokens of every prompt; records what the scheduler tells it."""

    def __init__(self, n: int) -> None:
        self.n, self.asked, self.allocated = n, [], []

    def num_external_tokens(self, seq, device_tokens):
        self.asked.append((seq.seq_id, device_tokens))
        return self.n

    def on_allocated(self, seq, device_tokens):
        self.allocated.append((seq.seq_id, seq.num_computed, device_tokens))

    def build_meta(self, plan):
        loads = {s for s, computed, device in self.allocated if computed > device}
        return [(w.seq.seq_id, w.seq.num_computed) for w in plan.seqs if w.seq.seq_id in loads]


def test_a_connectors_tokens_count_as_computed_at_admission():
    """A connector claiming 10 tokens of a 13-token prompt: admission counts the 8 of whole
    blocks, on_allocated sees the sequence at 8 with nothing on the device, the plan computes
    the other 5 and build_meta names the load. Catches: the claim ignored (13 tokens), or not
    rounded down to whole blocks (3 tokens)."""
    connector = Claims(10)
    sched = scheduler(prefix=True, connector=connector)
    req = request("a", 13)
    sched.add(req)
    seq_id = req.seqs[0].seq_id
    plan = sched.schedule()
    assert tokens(plan) == {"a": 5} and req.metrics.cached_tokens == 8
    assert connector.asked == [(seq_id, 0)] and connector.allocated == [(seq_id, 8, 0)]
    assert connector.build_meta(plan) == [(seq_id, 8)]
    assert len(sched.blocks.tables[seq_id]) == 4
    apply(sched, plan)
    assert req.seqs[0].num_computed == 13 and req.seqs[0].output_ids == [TOKEN]
    finish_all(sched, req)


def test_a_short_load_counts_only_its_valid_tokens():
    """The runner reports the load short (4 valid tokens): the sequence sat out, so it stays at
    4 computed, gains no token, and the next plan computes the other 9. Catches: the planned
    tokens counted anyway (13, and KV never computed for 4..7)."""
    sched = scheduler(prefix=True, connector=Claims(8))
    req = request("a", 13)
    sched.add(req)
    seq = req.seqs[0]
    plan = sched.schedule()
    upd = sched.update_from_output(plan, RunnerOutput(short_loads={seq.seq_id: 4}))
    sched.blocks.check()
    assert seq.num_computed == 4 and req.metrics.cached_tokens == 4 and not upd.changed
    assert tokens(sched.schedule()) == {"a": 9}
    finish_all(sched, req)


def test_finished_sequences_are_named_in_the_next_plan_only():
    """a ends at EOS, b at max_tokens=2, c is aborted: each id is in the next plan's
    ``finished`` (the runner drops their state) and in no later one. Catches: the list not
    handed over, or never cleared."""
    sched = scheduler()
    a, b, c = request("a", 3), request("b", 3, max_tokens=2), request("c", 3)
    for r in (a, b, c):
        sched.add(r)
    ids = {r.request_id: r.seqs[0].seq_id for r in (a, b, c)}
    now = step(sched, {"a": EOS})
    assert now.plan.finished == [] and now.update.released == [ids["a"]] and a.finished
    now = step(sched)
    assert now.plan.finished == [ids["a"]] and now.update.released == [ids["b"]]
    assert b.done[0].finish_reason == "length" and b.done[0].output_ids == [TOKEN, TOKEN]
    sched.finish_request(c, "abort")
    plan = sched.schedule()
    assert plan.finished == [ids["b"], ids["c"]] and plan.is_empty
    assert sched.schedule().finished == []
    finish_all(sched)
