"""What the engine tests share: a model whose outputs depend on their context, prompts, a loop
that runs requests to the end, and the check that nothing leaks."""
from __future__ import annotations

import torch

from minillm import SamplingParams
from minillm.checkpoint import random_model
from minillm.config import get_preset
from minillm.engine import LLMEngine


def sharp_model(dtype=torch.float64, max_seq_len: int = 4096, seed: int = 3,
                vocab_size: int | None = None):
    """The tiny preset's shape with a long window and the attention weights x 4 (q and k:
    peaked attention; v and o: what attention reads outweighs the token's own embedding), so
    that a wrong KV cache changes the greedy tokens (``test_context_matters``). ``vocab_size``
    (default: the preset's) shrinks the vocabulary for a faster step."""
    cfg = get_preset("tiny").with_(max_seq_len=max_seq_len)
    model = random_model(cfg.with_(vocab_size=vocab_size) if vocab_size else cfg, seed)
    with torch.no_grad():
        for layer in model.layers:
            for w in (layer.attn.wq, layer.attn.wk, layer.attn.wv, layer.attn.wo):
                w.weight.mul_(4.0)
    return model.to(dtype).eval().requires_grad_(False)


def prompts_of(lengths, seed=0, vocab=2000):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


def run_all(engine: LLMEngine, prompts, params: SamplingParams | list[SamplingParams],
            priorities=None):
    """Run every prompt to the end (one SamplingParams, or one per prompt); outputs in order;
    then every block must be free."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    priorities = priorities or [0] * len(prompts)
    ids = [engine.add_request(p, sp, priority=pr) for p, sp, pr in zip(prompts, params, priorities)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert_all_free(engine)
    return [done[i] for i in ids]


def assert_all_free(engine: LLMEngine):
    engine.blocks.check()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert engine.blocks.cpu.num_free == engine.blocks.cpu.num_blocks
    assert engine.blocks.slots_in_use() == 0 and not engine.requests


def read_in_turn(streams) -> list[str]:
    """next() on each stream in turn until all have ended; the text each one yielded."""
    pieces: list[list[str]] = [[] for _ in streams]
    live = list(range(len(streams)))
    while live:
        for i in list(live):
            try:
                pieces[i].append(next(streams[i]))
            except StopIteration:
                live.remove(i)
    return ["".join(p) for p in pieces]


@torch.no_grad()
def full_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits over the whole sequence ``ids``, no cache: [T, vocab]
    in float64 (the reference for the engine's logprobs)."""
    return model(torch.tensor([ids]))[0].double().log_softmax(-1)
