"""The disaggregated pair against the colocated engine: real worker processes over gloo, the KV
pulled layer by layer or whole, the same greedy tokens; faults by killing a worker for real;
no block left on a surviving worker."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from engine_checks import read_in_turn

import minillm
from minillm import SamplingParams
from minillm.disagg import DisaggLLM
from minillm.disagg.transfer import gather_layer, scatter, staging_buffer

OPTIONS = dict(num_kv_blocks=192, max_num_seqs=8, max_num_batched_tokens=48, block_size=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [list(range(10 + 9 * i, 10 + 9 * i + 15 + 11 * i)) for i in range(6)]  # 15..70 tokens


def pair(**kw) -> DisaggLLM:
    return DisaggLLM("tiny", random_weights=True, dtype=torch.float32, threads=1,
                     **{**OPTIONS, "timeout_s": 60.0, **kw})


@pytest.fixture(scope="module")
def reference():
    """The colocated engine's greedy tokens (fp32, same seed, same options)."""
    llm = minillm.LLM("tiny", random_weights=True, dtype=torch.float32, **OPTIONS)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def assert_no_block_held(llm: DisaggLLM) -> None:
    deadline = time.monotonic() + 10
    while True:
        stats = llm.worker_stats()
        if all(s["num_used"] == 0 and s["held"] == 0 for s in stats.values()) or \
                time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for rank, s in stats.items():
        assert s["num_used"] == 0 and s["held"] == 0, f"rank {rank} keeps blocks: {s}"
        left = [k for k in ("pulls", "kv_ready", "running", "expected", "pulled", "arrived",
                            "first") if s.get(k)]
        assert not left, f"rank {rank} still tracks {left}: {s}"


@pytest.mark.parametrize("layerwise", [True, False])
def test_pair_equals_colocated_and_frees_every_block(reference, layerwise):
    with pair(layerwise=layerwise) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == reference
        sent = [t["sent"] for t in llm.transfers.values()]
        assert len(sent) == len(PROMPTS) and all(s["error"] is None for s in sent)
        cfg = minillm.config.PRESETS["tiny"]
        for p, rid in zip(PROMPTS, [o.request_id for o in outs]):   # whole blocks, K and V
            blocks = -(-len(p) // OPTIONS["block_size"])
            assert llm.transfers[rid]["received"]["bytes"] == \
                blocks * OPTIONS["block_size"] * cfg.kv_bytes_per_token(4)
            t = llm.transfers[rid]      # one clock: the router's and the workers' times
            assert t["arrival"] <= t["first_token"] and t["arrival"] <= t["sent"]["kv_ready"]
            assert t["sent"]["start"] <= t["received"]["end"] <= t["first_decode"]
        assert_no_block_held(llm)


def test_two_decode_workers_share_the_load_and_stream_matches(reference):
    with pair(num_decode=2) as llm:
        text = "".join(llm.stream(PROMPTS[0], GREEDY))
        out = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in out] == reference
        assert text == out[0].text and text
        assert {llm.finished[o.request_id].decode_rank for o in out} == {1, 2}
        assert_no_block_held(llm)


def test_two_streams_consumed_in_turn_each_get_their_whole_text(reference):
    """next() on one stream, then on the other, until both end: neither loses the outputs
    that arrive while the other is being read."""
    with pair() as llm:
        texts = read_in_turn([llm.stream(p, GREEDY) for p in PROMPTS[:2]])
        outs = llm.generate(PROMPTS[:2], GREEDY)
        assert [o.token_ids for o in outs] == reference[:2]
        assert texts == [o.text for o in outs]
        assert all(o.text for o in outs) and llm.output_processor.watched == []


def test_first_token_finishes_and_aborts_leave_nothing(reference):
    with pair() as llm:
        one = llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=1))
        assert [o.token_ids for o in one] == [r[:1] for r in reference[:3]]
        rid = llm.add_request(PROMPTS[4], GREEDY)
        while not llm.requests[rid].tokens:
            llm.step()
        assert llm.abort(rid)
        assert_no_block_held(llm)


def wait_for_tokens(llm: DisaggLLM, n: int) -> None:
    deadline = time.monotonic() + 60
    while sum(len(t.tokens) for t in llm.requests.values()) < n:   # unfinished ones
        assert time.monotonic() < deadline, "no progress"
        llm.step()


@pytest.mark.parametrize("standby", [False, True])
def test_a_decode_worker_killed_mid_generation_is_rerouted(reference, standby):
    with pair(num_decode=2, standby=standby) as llm:
        ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
        wait_for_tokens(llm, 20)
        os.kill(llm.pids[1], signal.SIGKILL)
        outs = llm.output_processor.collect(ids)
        assert [o.token_ids for o in outs] == reference
        assert 1 in llm.dead and any(llm.finished[i].reroutes for i in ids)
        assert_no_block_held(llm)


def test_a_decode_worker_dying_mid_transfer_and_the_last_one_falls_back(reference):
    with pair(num_decode=1, faults={1: ("exit_after_pull", 0)}) as llm:
        outs = llm.generate(PROMPTS[:3], GREEDY)     # the only decode worker dies: colocated
        assert [o.token_ids for o in outs] == reference[:3]
        assert llm.dead == {1}
        assert_no_block_held(llm)


def test_gather_then_scatter_is_the_identity():
    from minillm.cache.pool import PagedKVPool

    cfg = minillm.config.PRESETS["tiny"]
    src = PagedKVPool(cfg, 10, 4, torch.device("cpu"), torch.float32)
    src.k.normal_(), src.v.normal_()
    dst = PagedKVPool(cfg, 10, 4, torch.device("cpu"), torch.float32)
    staged = staging_buffer(dst, 3)
    for layer in range(cfg.n_layers):
        staged[layer] = gather_layer(src, [7, 2, 5], layer)
    scatter(dst, [0, 1, 9], staged)
    assert torch.equal(dst.k[:, [0, 1, 9]], src.k[:, [7, 2, 5]])
    assert torch.equal(dst.v[:, [0, 1, 9]], src.v[:, [7, 2, 5]])


@pytest.mark.parametrize("kw, match", [
    (dict(num_decode=0), "num_decode"),
    (dict(faults={3: ("exit_after_pull", 0)}), "faults"),
    (dict(faults={1: ("explode", 0)}), "faults"),
    (dict(max_num_batched_tokens=4), "max_num_batched_tokens"),
    (dict(timeout_s=0), "timeout_s"),
])
def test_bad_options_fail_before_any_process_starts(kw, match):
    with pytest.raises(ValueError, match=match):
        pair(**kw)
