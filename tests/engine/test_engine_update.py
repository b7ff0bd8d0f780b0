"""The step's two halves apart: ``Scheduler.update_from_output`` on fabricated runner outputs
(no model), and ``ModelRunner.execute`` on a plan (it samples, and writes no sequence)."""
from __future__ import annotations

from minillm import SamplingParams
from minillm.cache.block_manager import BlockManager
from minillm.engine import EngineConfig, LLMEngine
from minillm.engine.config import SchedulerConfig
from minillm.engine.plan import RunnerOutput, Sample
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import Draft, Request

EOS = 2


def scheduler(num_blocks: int = 32, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget)
    return Scheduler(config, BlockManager(num_blocks, 4, watermark=0), 256, eos_token_id=EOS)


def request(rid: str, prompt_len: int, **params) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(**params))


def sample(*tokens: int, path: list[int] | None = None) -> Sample:
    return Sample(list(tokens), [0.0] * len(tokens), None, path)


def test_a_chunk_advances_and_a_completed_prompt_gains_its_token():
    sched = scheduler(budget=8)
    req = request("a", 12)
    sched.add(req)
    plan = sched.schedule()                     # a chunk of 8: the prompt is not done
    seq = req.seqs[0]
    done = sched.update_from_output(plan, RunnerOutput())
    assert seq.num_computed == 8 and not done.changed and seq.output_ids == []
    plan = sched.schedule()
    assert plan.seqs[0].num_tokens == 4 and plan.seqs[0].completes
    done = sched.update_from_output(plan, RunnerOutput(samples={seq.seq_id: [sample(77)]}))
    assert done.changed == [req] and done.starts[seq.seq_id] == 8
    assert seq.output_ids == [77] and seq.num_computed == 12 and seq.num_uncomputed == 1
    sched.blocks.check()


def test_eos_finishes_the_request_and_frees_its_blocks():
    sched = scheduler()
    req = request("a", 5)
    sched.add(req)
    plan = sched.schedule()
    seq_id = req.seqs[0].seq_id
    done = sched.update_from_output(plan, RunnerOutput(samples={seq_id: [sample(EOS)]}))
    assert req.finished and done.released == [seq_id] and not sched.has_unfinished()
    assert req.done[0].finish_reason == "stop" and sched.blocks.num_free == 32
    assert sched.schedule().finished == [seq_id]      # the runner hears who left


def test_n_samples_fork_the_sequence_sharing_the_prompt_blocks():
    sched = scheduler()
    req = request("a", 6, n=3, temperature=1.0)
    sched.add(req)
    plan = sched.schedule()
    parent = req.seqs[0]
    done = sched.update_from_output(
        plan, RunnerOutput(samples={parent.seq_id: [sample(50), sample(51), sample(52)]}))
    assert [s.output_ids for s in req.seqs] == [[50], [51], [52]]
    assert set(done.forked.values()) == {parent.seq_id} and len(done.forked) == 2
    first = sched.blocks.tables[parent.seq_id][0]
    assert sched.blocks.device.ref[first] == 3          # the full prompt block is shared
    sched.blocks.check()


def test_a_verified_chain_keeps_its_accepted_prefix_and_rolls_back_the_rest():
    sched = scheduler()
    req = request("a", 6)
    sched.add(req)
    seq = req.seqs[0]
    sched.update_from_output(sched.schedule(), RunnerOutput(samples={seq.seq_id: [sample(60)]}))
    seq.attach_draft(Draft.chain([61, 62, 63]))
    plan = sched.schedule()
    assert plan.seqs[0].num_tokens == 4                 # the last token and the draft
    done = sched.update_from_output(
        plan, RunnerOutput(samples={seq.seq_id: [sample(61, 99, path=[1])]}))
    assert seq.output_ids == [60, 61, 99] and seq.draft is None
    assert seq.num_computed == 8 and sched.blocks.filled[seq.seq_id] == 8   # 62, 63 forgotten
    assert done.kept_rows[seq.seq_id] == [0, 1]
    sched.blocks.check()


def test_beam_step_keeps_the_best_continuations_and_frees_the_rest():
    sched = scheduler()
    req = request("a", 6, beam_width=2, n=2, temperature=0.0)
    sched.add(req)
    seq = req.seqs[0]
    plan = sched.schedule()
    # both new beams extend beam 0: one keeps its sequence, the other forks its blocks
    sched.update_from_output(plan, RunnerOutput(beams={"a": [(0, 70, -0.1), (0, 71, -0.2),
                                                             (0, 72, -3.0), (0, 73, -4.0)]}))
    assert [s.output_ids for s in req.seqs] == [[70], [71]] and req.seqs[0] is seq
    plan = sched.schedule()
    done = sched.update_from_output(plan, RunnerOutput(beams={"a": [(1, 80, -0.1), (1, 81, -0.2),
                                                                    (0, 82, -5.0), (0, 83, -6.0)]}))
    assert [s.output_ids for s in req.seqs] == [[71, 80], [71, 81]]
    assert seq.seq_id in done.released and seq.seq_id not in sched.blocks.tables
    assert seq.seq_id in sched.schedule().finished      # the runner hears of dropped beams
    sched.blocks.check()


def test_the_runner_samples_completing_sequences_and_writes_none(sharp):
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=32, max_num_batched_tokens=16,
                                                 max_num_seqs=4))
    params = SamplingParams(temperature=0, max_tokens=4)
    short, long = (engine.add_request(list(range(1, n + 1)), params) for n in (5, 30))
    plan = engine.scheduler.schedule()
    before = [(w.seq.num_computed, list(w.seq.token_ids)) for w in plan.seqs]
    out = engine.runner.execute(plan)
    assert [(w.seq.num_computed, w.seq.token_ids) for w in plan.seqs] == before
    done_ids = {w.seq.seq_id for w in plan.seqs if w.completes}
    assert set(out.samples) == done_ids and len(done_ids) == 1     # the long prompt is chunked
    (only,) = out.samples.values()
    assert len(only) == 1 and len(only[0].tokens) == 1 and only[0].path is None
    engine.scheduler.update_from_output(plan, out)
    engine.abort(short)
    engine.abort(long)
    assert engine.blocks.num_free == 32


class BadDrafter:
    """Drafts a token outside the vocabulary for request "bad", nothing for the others."""

    hidden_layers = ()
    max_draft_tokens = 2

    def __init__(self, bad_seq: set[int], vocab: int) -> None:
        self.bad_seq, self.vocab = bad_seq, vocab

    def propose(self, plan, out, done):
        return {s.seq_id: Draft.chain([5, self.vocab]) for r in plan.requests
                for s in r.seqs if s.seq_id in self.bad_seq and not r.finished}

    def verify(self, seq, draft, logits, params, generator):
        raise AssertionError("no draft should reach verification")

    def release(self, seq_id) -> None: ...


def test_a_drafter_breaking_its_contract_fails_its_request_alone(sharp):
    from engine_checks import assert_all_free, run_all

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(3, 12)), list(range(20, 33))]
    plain = run_all(LLMEngine(sharp, None, EngineConfig(num_kv_blocks=32)), prompts, params)
    drafter = BadDrafter(set(), sharp.cfg.vocab_size)
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=32), speculator=drafter)
    bad = engine.add_request(prompts[0], params)
    good = engine.add_request(prompts[1], params)
    drafter.bad_seq = {engine.requests[bad].seqs[0].seq_id}
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert outs[bad].outputs[0].finish_reason == "error"
    assert "BadDrafter" in outs[bad].error and f"[0, {sharp.cfg.vocab_size})" in outs[bad].error
    assert outs[good].token_ids == plain[1].token_ids and outs[good].error is None
    assert_all_free(engine)
