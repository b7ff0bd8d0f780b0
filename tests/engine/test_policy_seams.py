"""Three more of the engine's seams are real, each with a deliberately simple implementation
of our own passed through ``EngineConfig`` that serves the engine end to end with the package's
tokens, and a broken one whose requests fail alone (finish_reason "error", a message naming the
component and the rule, every block freed) while the engine goes on serving:

- the step policy (``scheduler_cls``): the engine checks every plan
  (:func:`minillm.engine.plan.check_plan`: token budget, sequence limit, blocks for every token);
- the block allocator (``block_allocator``): the pool checks every block it hands out;
- the sampler (``sampler``): the runner checks every token it draws.
"""
from __future__ import annotations

import re

import pytest
from engine_checks import assert_all_free, prompts_of, run_all, sharp_model

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.engine.plan import PlanError, ScheduledSeq, SchedulerOutput, check_plan
from minillm.engine.sampler import SamplerOutput, sample_rows
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import Status

GREEDY = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)


class OneAtATime(Scheduler):
    """Request-level batching at its plainest: the oldest waiting request is admitted alone
    with its whole prompt, then decodes alone until it finishes."""

    admit_all = False

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished=self._finished)
        self._finished = []
        while self.waiting and (self.admit_all or not self.running):
            req = self.waiting.pop(0)
            seq = req.seqs[0]
            self.blocks.allocate(seq.seq_id, seq.num_tokens)
            req.status = Status.RUNNING
            self.running.append(req)
        for req in self.running:
            for seq in req.seqs:
                out.copies += self.blocks.reserve(seq.seq_id, seq.num_tokens)
                out.seqs.append(ScheduledSeq(seq, seq.num_uncomputed))
            out.requests.append(req)
        return out


class AllAtOnce(OneAtATime):
    """Broken on purpose: every waiting request is admitted whole in one step, whatever the
    token budget."""

    admit_all = True


class NoBlocks(OneAtATime):
    """Broken on purpose: admits a prompt without allocating its blocks."""

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished=self._finished)
        self._finished = []
        if self.waiting:
            req = self.waiting.pop(0)
            req.status = Status.RUNNING
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req.seqs[0], req.seqs[0].num_tokens))
            out.requests.append(req)
        return out


@pytest.fixture(scope="module")
def model():
    return sharp_model(max_seq_len=512)


def prompts():
    return prompts_of([30, 7, 19, 44], seed=2)


def engine_of(model, **kw):
    return LLMEngine(model, None, EngineConfig(num_kv_blocks=40, block_size=8,
                                               max_num_batched_tokens=64, max_num_seqs=4, **kw))


def test_a_scheduler_of_our_own_serves_the_package_tokens(model):
    want = [o.token_ids for o in run_all(engine_of(model), prompts(), GREEDY)]
    engine = engine_of(model, scheduler_cls=OneAtATime)
    assert type(engine.scheduler) is OneAtATime
    got = [o.token_ids for o in run_all(engine, prompts(), GREEDY)]
    assert got == want
    assert engine.num_steps == len(prompts()) * GREEDY.max_tokens   # alone: prompt + 6 decodes


@pytest.mark.parametrize("policy, rule", [
    (AllAtOnce, r"step policy AllAtOnce: the plan holds 100 tokens, over "
                r"max_num_batched_tokens=64"),
    (NoBlocks, r"step policy NoBlocks: sequence \d+ computes up to position 30 but owns 0 "
               r"blocks"),
])
def test_a_plan_breaking_a_rule_fails_its_requests_alone(model, policy, rule):
    engine = engine_of(model, scheduler_cls=policy)
    outs = {}
    for p in prompts():
        engine.add_request(p, GREEDY)
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    failed = [o for o in outs.values() if o.outputs[0].finish_reason == "error"]
    assert failed and re.search(rule, failed[0].error), failed[0].error
    assert_all_free(engine)


def test_the_engine_goes_on_serving_after_a_broken_plan(model):
    engine = engine_of(model, scheduler_cls=AllAtOnce)
    first = run_all(engine, prompts(), GREEDY)
    assert {o.outputs[0].finish_reason for o in first} == {"error"}
    alone = run_all(engine, prompts()[:1], GREEDY)[0]          # 30 tokens fit the budget
    assert alone.outputs[0].finish_reason == "length"
    assert alone.token_ids == run_all(engine_of(model), prompts()[:1], GREEDY)[0].token_ids


def test_check_plan_names_each_rule(model):
    engine = engine_of(model)
    engine.add_request(prompts()[0], GREEDY)
    plan = engine.scheduler.schedule()
    tables, cfg = engine.blocks.tables, engine.config
    check_plan(plan, cfg, tables, 8)                             # the package's plan is fine
    w = plan.seqs[0]
    for seqs, rule in [([w, w], "scheduled twice"),
                       ([ScheduledSeq(w.seq, 0)], "computes 0 tokens"),
                       ([ScheduledSeq(w.seq, 31)], "computes 31 tokens; it has 30 uncomputed")]:
        bad = SchedulerOutput(requests=plan.requests, seqs=seqs)
        with pytest.raises(PlanError, match=rule):
            check_plan(bad, cfg, tables, 8, "Mine")
    with pytest.raises(PlanError, match="owns 3 blocks of 8 slots"):
        check_plan(plan, cfg, {w.seq.seq_id: tables[w.seq.seq_id][:3]}, 8)


def test_scheduler_cls_must_be_a_scheduler(model):
    with pytest.raises(ValueError, match="scheduler_cls must be a subclass of"):
        engine_of(model, scheduler_cls=dict)


# ---- the block allocator ------------------------------------------------------------------------
class StackAllocator:
    """A plain list: the most recently freed block first."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))

    def take(self) -> int:
        return self.free.pop()

    def put(self, block: int) -> None:
        self.free.append(block)

    def __len__(self) -> int:
        return len(self.free)

    def __iter__(self):
        return iter(self.free)


class HandsOutOneTwice(StackAllocator):
    """Broken on purpose, once: its ``bad_at``-th take returns the block handed out just
    before (still in use) without removing anything from its list."""

    bad_at = 1

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.takes, self.last = 0, None

    def take(self) -> int:
        self.takes += 1
        if self.takes == self.bad_at and self.last is not None:
            return self.last
        self.last = super().take()
        return self.last


def workload_outputs(engine):
    """Parallel samples (forks, copy-on-write), a shared prefix (cache hits), a pool small
    enough to preempt by swapping: each request's tokens."""
    system = prompts_of([24], seed=5)[0]
    ps = [system + p for p in prompts_of([3, 9, 14, 6, 11], seed=6)]
    params = [SamplingParams(n=2, temperature=0.9, seed=i, max_tokens=12) for i in range(5)]
    return [[c.token_ids for c in o.outputs] for o in run_all(engine, ps, params)]


def pressed(model, **kw):
    return LLMEngine(model, None, EngineConfig(
        num_kv_blocks=16, block_size=8, max_num_batched_tokens=64, max_num_seqs=8,
        enable_prefix_caching=True, preemption="swap", swap_space=0.01, **kw))


def test_a_list_allocator_serves_the_package_tokens(model):
    fifo = pressed(model)
    want = workload_outputs(fifo)
    stack = pressed(model, block_allocator=StackAllocator)
    assert isinstance(stack.blocks.device.free, StackAllocator)
    assert workload_outputs(stack) == want
    assert any(r.swapped_out for r in fifo.trace) and any(r.copied for r in fifo.trace)
    assert fifo.blocks.prefix_hit > 0


@pytest.mark.parametrize("bad_at, where", [(4, "admission"), (3, "growth")])
def test_an_allocator_handing_out_a_used_block_fails_that_request_alone(model, bad_at, where):
    """Two 10-token prompts admitted together take blocks 1-2 and 3-4 (the 4th repeats the
    3rd: the second request fails at admission); one alone takes its 3rd block when its 17th
    token is computed (it fails while decoding, with 7 tokens out)."""
    broken = type("HandsOutOneTwice", (HandsOutOneTwice,), {"bad_at": bad_at})
    engine = engine_of(model, block_allocator=broken)
    ps = prompts_of([10, 10], seed=1)[:2 if where == "admission" else 1]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = run_all(engine, ps, params)                     # checks that every block is free
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons == (["length", "error"] if where == "admission" else ["error"])
    assert re.search(r"block_allocator: HandsOutOneTwice\.take returned \d+, which is in use "
                     r"\(1 readers\): take must return a free block", outs[-1].error)
    assert len(outs[-1].token_ids) == (0 if where == "admission" else 17 - 10)
    again = run_all(engine, prompts()[:2], GREEDY)                   # the engine goes on
    assert [o.token_ids for o in again] == \
        [o.token_ids for o in run_all(engine_of(model), prompts()[:2], GREEDY)]


def test_an_unknown_allocator_name_is_refused(model):
    with pytest.raises(ValueError, match=r"block_allocator must be one of \['fifo'\]"):
        engine_of(model, block_allocator="lifo")


# ---- the sampler -------------------------------------------------------------------------------
def float64_sampler(logits, batch):
    """Greedy rows only: the argmax, and log-probabilities from a float64 log-softmax (the
    package computes them in float32: they agree to 1e-5)."""
    assert all(batch.greedy), "this sampler draws greedy rows only"
    logp = logits.double().log_softmax(-1)
    best = logp.topk(max(batch.logprobs, 1), dim=-1)
    tokens = logp.argmax(-1).tolist()
    return SamplerOutput(tokens, [float(logp[i, t]) for i, t in enumerate(tokens)],
                         [list(zip(best.indices[i].tolist(), best.values[i].tolist()))
                          [:batch.logprobs] for i in range(len(tokens))])


class OutOfVocabularyOnce:
    """Broken on purpose, once: row 0 of its first call gets the vocabulary size."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, logits, batch):
        out = sample_rows(logits, batch)
        self.calls += 1
        if self.calls == 1:
            out.token_ids[0] = logits.shape[-1]
        return out


def test_a_float64_sampler_serves_the_package_tokens_and_logprobs(model):
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=2)
    want = run_all(engine_of(model), prompts(), params)
    got = run_all(engine_of(model, sampler=float64_sampler), prompts(), params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-5 for t in x)


def test_a_sampler_drawing_outside_the_vocabulary_fails_that_request_alone(model):
    engine = engine_of(model, sampler=OutOfVocabularyOnce())
    outs = run_all(engine, prompts()[:2], GREEDY)            # checks that every block is free
    want = run_all(engine_of(model), prompts()[:2], GREEDY)
    vocab = model.cfg.vocab_size
    assert outs[0].outputs[0].finish_reason == "error" and not outs[0].token_ids
    assert outs[0].error == (f"sampler: OutOfVocabularyOnce returned {vocab} for row 0: a "
                             f"token id must be an int in [0, {vocab})")
    assert outs[1].token_ids == want[1].token_ids


def test_a_sampler_returning_too_few_rows_fails_their_requests(model):
    def short(logits, batch):
        out = sample_rows(logits, batch)
        return SamplerOutput(out.token_ids[:-1], out.logprobs, out.top)

    outs = run_all(engine_of(model, sampler=short), prompts()[:2], GREEDY)
    assert {o.outputs[0].finish_reason for o in outs} == {"error"}
    assert "returned token_ids 1, logprobs 2, top 2 for 2 rows" in outs[0].error
