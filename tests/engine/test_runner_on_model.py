"""The runner inside a live engine, over the sharpened tiny model in float64: every row's logits
and chosen hidden states from one pass, a tree mask's node logits equal to the forward over its
path, the rollback and compaction of a verified tree, and static buffers (what CUDA graphs need)
giving the same tokens at fixed addresses.
"""
from __future__ import annotations

import torch
from engine_checks import assert_all_free, prompts_of, run_all

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.engine.scheduler import ScheduledSeq, SchedulerOutput
from minillm.engine.sequence import Draft
from minillm.generate import generate


def one_step(engine: LLMEngine, seq, n: int, **kw):
    """Run ``n`` tokens of ``seq`` (blocks already reserved) through the runner directly."""
    plan = SchedulerOutput(seqs=[ScheduledSeq(seq, n)])
    engine.blocks.reserve(seq.seq_id, seq.num_computed + n)
    result = engine.runner.forward(plan, engine.blocks.tables, **kw)
    seq.num_computed += n
    return result


def start_request(engine: LLMEngine, prompt: list[int]):
    """Prefill ``prompt`` through the engine; returns its live Sequence (one output token)."""
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=50,
                                                     ignore_eos=True))
    engine.step()
    return rid, engine.requests[rid].seqs[0]


def test_every_row_logits_and_hidden_states_from_one_pass(sharp):
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=50))
    rid, seq = start_request(engine, prompts_of([21])[0])
    seq.token_ids += prompts_of([5], seed=9)[0]           # a "draft" of 5 tokens to verify
    n = seq.num_uncomputed
    result = one_step(engine, seq, n, all_logits={seq.seq_id}, hidden_layers=[0, 1, -1])
    ids = torch.tensor([seq.token_ids])
    with torch.no_grad():
        final, kept = sharp.forward_layers(ids, keep=[0, 1])
        want = sharp.lm_head(final)[0, -n:]
    torch.testing.assert_close(result.logits.double(), want, rtol=0, atol=1e-9)
    for layer, h in ((0, kept[0]), (1, kept[1]), (-1, final)):
        torch.testing.assert_close(result.hidden[layer], h[0, -n:], rtol=0, atol=1e-9)
    engine.abort(rid)
    assert_all_free(engine)


def test_tree_mask_node_logits_equal_their_paths(sharp):
    """A tree of 6 draft nodes over a cached prefix, verified in one pass with each node at
    position prefix + depth: node i's logits equal the forward over prefix + its path."""
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=50, block_size=8))
    rid, seq = start_request(engine, prompts_of([19])[0])
    ctx = seq.num_tokens - 1                              # the sampled token is node 0 (root)
    parent = [-1, 0, 0, 1, 1, 2]
    nodes = [seq.token_ids[-1]] + prompts_of([5], seed=4)[0]
    seq.token_ids[-1:] = nodes
    depth = [0] * 6
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
        depth[i] = int(mask[i].sum()) - 1
    result = one_step(engine, seq, 6, all_logits={seq.seq_id}, masks={seq.seq_id: mask},
                      positions={seq.seq_id: [ctx + d for d in depth]})
    for i in range(6):
        path = [nodes[j] for j in range(6) if mask[i, j]]
        want = sharp(torch.tensor([seq.token_ids[:ctx] + path]))[0, -1]
        torch.testing.assert_close(result.logits[i].double(), want, rtol=0, atol=1e-9)
    engine.abort(rid)
    assert_all_free(engine)


class FixedVerdict:
    """A speculator that drafts nothing and accepts a fixed path of nodes, then a fixed token
    (the engine's verification seam, driven by hand)."""

    hidden_layers = ()
    max_draft_tokens = 5

    def __init__(self, path: list[int], bonus: int) -> None:
        self.path, self.bonus = path, bonus

    def propose(self, plan, out, done):
        return {}

    def verify(self, seq, draft, logits, params, generator):
        return self.path, self.bonus

    def release(self, seq_id) -> None: ...


def test_rollback_and_compaction_keep_the_accepted_tokens(sharp):
    """A step verifies 6 tree nodes and accepts the path 0 -> 2 -> 5: the runner moves its
    K/V into place, the update truncates the rest (freed blocks then poisoned), and decoding
    goes on with the same tokens as the accepted sequence run alone from scratch."""
    bonus = prompts_of([1], seed=7)[0][0]
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=60, block_size=4, watermark=0),
                       speculator=FixedVerdict([2, 5], bonus))
    rid, seq = start_request(engine, prompts_of([10])[0])
    ctx = seq.num_tokens - 1
    nodes = [seq.token_ids[-1]] + prompts_of([5], seed=6)[0]
    seq.attach_draft(Draft(nodes[1:], [0, 0, 1, 1, 2]))
    engine.step()
    assert seq.token_ids[ctx:] == [nodes[0], nodes[2], nodes[5], bonus]
    assert seq.num_computed == ctx + 3 and engine.blocks.filled[seq.seq_id] == ctx + 3
    free = list(engine.blocks.device.free)
    engine.runner.pool.k[:, free] = 1e4
    engine.runner.pool.v[:, free] = 1e4
    base = list(seq.token_ids)
    out = []
    while len(out) < 5:
        engine.step()
        out = seq.output_ids[len(base) - seq.prompt_len:]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    assert out[:5] == generate(sharp, base, params)
    engine.abort(rid)
    assert_all_free(engine)



def test_static_buffers_give_the_same_tokens_at_fixed_addresses(sharp):
    """With ``static_buffers`` every step's inputs and metadata live in tensors allocated once
    (what CUDA graph replay needs): same outputs as fresh tensors, same addresses every step."""
    prompts = prompts_of([7, 30, 12])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    from minillm.attention.paged import default_paged_backend, get_paged_backend

    plain = run_all(LLMEngine(sharp, None, EngineConfig(num_kv_blocks=60)), prompts, params)
    seen = set()

    class Spy:
        """The default backend, noting where each call's metadata lives."""
        name, cpu_fast_path = "spy", False
        inner = get_paged_backend(default_paged_backend(sharp.device, sharp.dtype))
        reads_direct = inner.reads_direct

        def __call__(self, q, k, v, k_cache, v_cache, meta):
            seen.add((meta.slot_mapping.data_ptr(), meta.block_tables.data_ptr(),
                      meta.seq_lens.data_ptr()))
            return self.inner(q, k, v, k_cache, v_cache, meta)

    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=60, static_buffers=True,
                                                 attention_backend=Spy()))
    fixed = run_all(engine, prompts, params)
    assert [o.token_ids for o in fixed] == [o.token_ids for o in plain]
    buffers = engine.runner.buffers
    assert seen == {(buffers.slot_mapping.data_ptr(), buffers.block_tables.data_ptr(),
                     buffers.seq_lens.data_ptr())}
