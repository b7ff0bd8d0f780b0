"""The model runner alone: ``ModelRunner.execute`` on plans built by hand (no scheduler), over the
tiny random model in float64 and block tables taken from a BlockManager.

Checked: a plan of a prompt chunk plus a decode samples only the sequence whose chunk completes,
reports each sequence's rows of the flat batch, and writes no sequence; a prompt computed in two
chunks (num_computed advanced by hand between them, as ``update_from_output`` would) gives the
logits of one pass over it; the plan's copy-on-write pairs reach the pool before the forward;
and a KV connector is called in order (start_load, wait/save around each layer, wait_for_save),
a sequence whose load comes short sitting the step out.
"""
from __future__ import annotations

import pytest
import torch
from engine_checks import prompts_of, sharp_model

from minillm import SamplingParams
from minillm.cache.block_manager import BlockManager
from minillm.engine.connector import KVConnector
from minillm.engine.plan import ScheduledSeq, SchedulerOutput
from minillm.engine.runner import ModelRunner
from minillm.engine.sampler import sample_rows
from minillm.engine.sequence import Request
from minillm.engine.step_sampler import StepSampler

BS = 4
TOL = 1e-9                 # float64
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def model():
    return sharp_model(torch.float64, max_seq_len=256)


class Recording:
    """A sampler that keeps every batch of logits it is given, then samples as the package does."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits, batch):
        self.logits.append(logits.clone())
        return sample_rows(logits, batch)


def setup(model, connector: KVConnector | None = None):
    """(runner, block manager, recording sampler): the runner reads the manager's tables."""
    blocks = BlockManager(32, BS, watermark=0)
    runner = ModelRunner(model, 32, BS, attention_backend="sdpa", tables=blocks.tables,
                         connector=connector)
    rec = Recording()
    runner.sampler = StepSampler(sampler=rec)
    return runner, blocks, rec


def prompt_request(rid: str, n: int, seed: int = 0) -> Request:
    return Request(rid, prompts_of([n], seed=seed)[0], GREEDY)


def plan_of(*work: tuple[Request, int], copies=()) -> SchedulerOutput:
    """A plan where each (request, n) computes n tokens of its one sequence."""
    return SchedulerOutput(requests=[r for r, _ in work],
                           seqs=[ScheduledSeq(r.seqs[0], n) for r, n in work],
                           copies=list(copies))


def advance(req: Request, n: int, token: int | None = None) -> None:
    """What update_from_output does to a sequence that computed n tokens (and sampled one)."""
    seq = req.seqs[0]
    seq.num_computed += n
    if token is not None:
        seq.token_ids.append(token)


def test_execute_samples_completing_sequences_only_and_writes_none(model):
    """A chunk of 6 of a 10-token prompt and a decode in one plan: only the decode gets a
    sample (one token), each has its rows of the 7-row batch, and neither sequence changes.
    Catches: a sample drawn for an unfinished chunk, or a runner that advances num_computed
    or appends the token itself."""
    runner, blocks, _ = setup(model)
    b = prompt_request("b", 6, seed=1)
    blocks.allocate(b.seqs[0].seq_id, 6)
    first = runner.execute(plan_of((b, 6)))
    advance(b, 6, first.samples[b.seqs[0].seq_id][0].tokens[0])
    blocks.reserve(b.seqs[0].seq_id, 7)
    a = prompt_request("a", 10, seed=2)
    blocks.allocate(a.seqs[0].seq_id, 6)
    plan = plan_of((a, 6), (b, 1))
    before = [(w.seq.num_computed, list(w.seq.token_ids)) for w in plan.seqs]
    out = runner.execute(plan)
    a_id, b_id = a.seqs[0].seq_id, b.seqs[0].seq_id
    assert list(out.samples) == [b_id] and len(out.samples[b_id]) == 1
    assert len(out.samples[b_id][0].tokens) == 1 and out.samples[b_id][0].path is None
    rows = out.rows
    assert set(rows) == {a_id, b_id}
    assert rows[a_id].stop - rows[a_id].start == 6 and rows[b_id].stop - rows[b_id].start == 1
    assert sorted(i for r in rows.values() for i in range(r.start, r.stop)) == list(range(7))
    assert [(w.seq.num_computed, w.seq.token_ids) for w in plan.seqs] == before
    assert out.short_loads == {} and out.errors == {}


def test_a_prompt_in_two_chunks_gives_the_logits_of_one_pass(model):
    """x computes a 13-token prompt at once; y, the same prompt, as 8 then 5 tokens (advanced
    by hand between the calls). The last row's logits and the greedy token agree; the first
    chunk samples nothing. A third copy that skips the first chunk (its KV never computed)
    gives other logits, so the comparison can fail: it catches a runner that ignores the
    cached KV or restarts positions at 0 for a later chunk."""
    runner, blocks, rec = setup(model)
    prompt = prompts_of([13], seed=3)[0]
    x, y, skip = (Request(r, prompt, GREEDY) for r in "xys")
    for r in (x, y, skip):
        blocks.allocate(r.seqs[0].seq_id, 13)
    whole = runner.execute(plan_of((x, 13)))
    assert runner.execute(plan_of((y, 8))).samples == {} and len(rec.logits) == 1
    advance(y, 8)
    chunked = runner.execute(plan_of((y, 5)))
    advance(skip, 8)                             # claims 8 computed tokens it never computed
    runner.execute(plan_of((skip, 5)))
    one, two, wrong = (t[0] for t in rec.logits)
    assert whole.samples[x.seqs[0].seq_id][0].tokens == chunked.samples[y.seqs[0].seq_id][0].tokens
    assert whole.samples[x.seqs[0].seq_id][0].tokens == [int(one.argmax())]
    torch.testing.assert_close(two, one, atol=TOL, rtol=0)
    assert (wrong - one).abs().max() > 1e-3


def test_copies_in_the_plan_are_applied_to_the_pool(model):
    """Block 5 holds known K/V; a plan copying (5, 9) leaves block 9 equal to it and block 5
    as it was. Catches: copies skipped, or done the wrong way round (5 would be zeroed)."""
    runner, blocks, _ = setup(model)
    pool, cfg = runner.pool, model.cfg
    kv = torch.arange(2 * cfg.n_layers * BS * cfg.n_kv_heads * cfg.head_dim,
                      dtype=torch.float64).view(2, cfg.n_layers, BS, cfg.n_kv_heads, cfg.head_dim)
    pool.write_blocks(torch.tensor([5]), kv)
    assert torch.equal(pool.gather([5]), kv) and not pool.gather([9]).any()
    a = prompt_request("a", 4)
    blocks.allocate(a.seqs[0].seq_id, 4)
    assert blocks.tables[a.seqs[0].seq_id] == [0]          # the forward writes elsewhere
    runner.execute(plan_of((a, 4), copies=[(5, 9)]))
    assert torch.equal(pool.gather([9]), kv) and torch.equal(pool.gather([5]), kv)


def test_a_plan_with_only_block_moves_runs_them_and_computes_nothing(model):
    """A plan with no sequence to compute (a step policy may make one) still moves its
    blocks, with or without a KV connector. Catches: the empty plan reaching the connector
    that is not there, or the forward run over no tokens."""
    runner, _, rec = setup(model)
    runner.pool.write_blocks(torch.tensor([5]), torch.ones_like(runner.pool.gather([5])))
    out = runner.execute(SchedulerOutput(copies=[(5, 9)]))
    assert not out.samples and not out.rows and not rec.logits
    assert torch.equal(runner.pool.gather([9]), runner.pool.gather([5]))


def test_a_copy_on_write_lands_before_the_forward_reads_it(model):
    """x computes 9 prompt tokens and samples; y is forked from it and gets its own copy of the
    shared last block (the block manager's copy-on-write pair). x and y then decode the same
    token in one plan: y reads position 8 from the copy, so both rows' logits agree. Catches:
    copies done after the forward, or not at all (y would read zeros)."""
    runner, blocks, rec = setup(model)
    x = prompt_request("x", 9, seed=5)
    xs = x.seqs[0]
    blocks.allocate(xs.seq_id, 9)
    out = runner.execute(plan_of((x, 9)))
    advance(x, 9, out.samples[xs.seq_id][0].tokens[0])
    ys = xs.fork()
    y = Request("y", x.prompt_ids, GREEDY, seqs=[ys])
    blocks.fork(xs.seq_id, ys.seq_id)
    copies = blocks.reserve(ys.seq_id, 10)
    assert copies == [(blocks.tables[xs.seq_id][2], blocks.tables[ys.seq_id][2])]
    assert blocks.reserve(xs.seq_id, 10) == []
    out = runner.execute(plan_of((x, 1), (y, 1), copies=copies))
    rows = rec.logits[-1]
    torch.testing.assert_close(rows[1], rows[0], atol=TOL, rtol=0)
    assert out.samples[xs.seq_id][0].tokens == out.samples[ys.seq_id][0].tokens
    blocks.check()


class Recorder(KVConnector):
    """Records the runner's calls in order. At each layer call it notes whether that layer has
    written this step's K for the first token yet. ``short``: start_load's answer."""

    def __init__(self, short: dict[int, int] | None = None) -> None:
        self.calls: list = []
        self.short = short or {}

    def register_kv_pool(self, pool, tables):
        self.pool, self.tables = pool, tables
        self.calls.append("register")

    def start_load(self, plan):
        self.plan = plan
        self.calls.append(("start", [w.seq.seq_id for w in plan.seqs]))
        return dict(self.short)

    def _written(self, layer: int) -> bool:
        w = next(w for w in self.plan.seqs if w.seq.seq_id not in self.short)
        return bool(self.pool.k[layer, self.tables[w.seq.seq_id][0], 0].any())

    def wait_for_layer(self, layer):
        self.calls.append(("wait", layer, self._written(layer)))

    def save_layer(self, layer):
        self.calls.append(("save", layer, self._written(layer)))

    def wait_for_save(self):
        self.calls.append("done")


def test_the_connector_is_called_around_the_forward_and_each_layer(model):
    """register once; then start_load with the plan, wait_for_layer(i) before layer i writes its
    K/V and save_layer(i) after, for every layer in order, then wait_for_save. Catches: a call
    missing, out of order, or on the wrong side of its layer."""
    connector = Recorder()
    runner, blocks, _ = setup(model, connector)
    assert connector.pool is runner.pool and connector.tables is blocks.tables
    a = prompt_request("a", 5)
    blocks.allocate(a.seqs[0].seq_id, 5)
    runner.execute(plan_of((a, 5)))
    layers = [c for i in range(model.cfg.n_layers) for c in (("wait", i, False),
                                                            ("save", i, True))]
    assert connector.calls == ["register", ("start", [a.seqs[0].seq_id])] + layers + ["done"]


def test_a_short_load_sits_the_step_out(model):
    """start_load reports a's load short (4 valid tokens): a gets no sample and no rows, the
    forward runs over b alone, and short_loads carries a for the scheduler. When every sequence
    is short, nothing runs but the step still ends with wait_for_save. Catches: a sampled from
    KV that was never loaded, or the short load not reported."""
    a, b = prompt_request("a", 10, seed=6), prompt_request("b", 6, seed=7)
    a_id, b_id = a.seqs[0].seq_id, b.seqs[0].seq_id
    connector = Recorder(short={a_id: 4})
    runner, blocks, _ = setup(model, connector)
    blocks.allocate(a_id, 10)
    blocks.allocate(b_id, 6)
    out = runner.execute(plan_of((a, 10), (b, 6)))
    assert list(out.samples) == [b_id] and out.short_loads == {a_id: 4}
    assert out.rows == {b_id: slice(0, 6)}
    assert a.seqs[0].num_computed == 0
    connector.calls.clear()
    out = runner.execute(plan_of((a, 10)))
    assert out.samples == {} and out.rows == {} and out.short_loads == {a_id: 4}
    assert connector.calls == [("start", [a_id]), "done"]
