"""What a request does with the tokens its sequences gain: the request policies.

:meth:`~.scheduler.Scheduler.update_from_output` calls these with the runner's samples:

- :func:`append_token` grows a sequence by one token and decides whether it ends there (EOS,
  ``max_tokens``, the context window, a stop string found by its detokenizer);
- parallel sampling (``n`` > 1): at its first token a request becomes n sequences that share the
  prompt's blocks (:func:`fork_seq`; the block manager counts references, nothing is copied);
- beam search (:func:`beam_step`): keep the ``beam_width`` best continuations of all beams,
  forking a beam's blocks when two continuations extend it, freeing those nobody extends.

None of them touches the device: forking is bookkeeping in the block manager.
"""
from __future__ import annotations

import copy

from ..cache.block_manager import BlockManager
from .sequence import Request, Sequence


def append_token(req: Request, seq: Sequence, token: int, eos_token_id: int,
                 max_seq_len: int, logprob: float = 0.0,
                 top: list[tuple[int, float]] | None = None) -> None:
    """Append ``token`` to ``seq`` and set its finish reason if it ends here: "stop" at EOS
    (unless ``ignore_eos``), a stop string or the end of its structured-outputs grammar (its
    constraint advances here, with the token), "length" at ``max_tokens`` or the window."""
    if seq.constraint is not None:
        seq.constraint.accept(token)     # the step sampler drew it from the allowed tokens
    seq.token_ids.append(token)
    seq.cumulative_logprob += logprob
    if top is not None:
        seq.logprobs.append({token: logprob, **dict(top)})
    params = req.params
    if token == eos_token_id and not params.ignore_eos or \
            seq.constraint is not None and seq.constraint.is_terminated():
        seq.finish_reason = "stop"
    elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= max_seq_len:
        seq.finish_reason = "length"
    if seq.detok is not None:
        seq.delta += seq.detok.push([token])
        if seq.detok.stopped:
            seq.finish_reason = "stop"
        if seq.finished:
            seq.delta += seq.detok.finish()


def copy_seq(parent: Sequence) -> Sequence:
    """The parent's tokens and text state under a new id (no blocks)."""
    child = parent.fork()
    if parent.detok is not None:     # its own text state, sharing the tokenizer
        tok = parent.detok.tokenizer
        child.detok = copy.deepcopy(parent.detok, {id(tok): tok})
    if parent.constraint is not None:   # its own grammar state
        child.constraint = parent.constraint.fork()
    return child


def fork_seq(blocks: BlockManager, req: Request, parent: Sequence) -> Sequence:
    """A new live sequence of ``req`` sharing every block of ``parent``."""
    child = copy_seq(parent)
    blocks.fork(parent.seq_id, child.seq_id)
    req.seqs.append(child)
    return child


def forks_at_first_token(req: Request) -> bool:
    """Whether this step's token is the first of an n > 1 request (it becomes n sequences)."""
    return req.params.n > 1 and not req.params.use_beam_search and not req.done \
        and len(req.seqs) == 1 and not req.seqs[0].output_ids


def beam_step(req: Request, candidates: list[tuple[int, int, float]], blocks: BlockManager,
              eos_token_id: int, max_seq_len: int) -> list[int]:
    """Advance a beam-search request: ``candidates`` are (beam index, token, token
    log-probability), best first (2 x beam_width of them). A continuation ending in EOS among
    the top beam_width becomes a finished hypothesis; the first beam_width others become the
    new beams. Returns the ids of the sequences whose blocks were freed."""
    width, beams = req.params.beam_width, req.seqs
    chosen = []
    for rank, (parent, tok, lp) in enumerate(candidates):
        if tok == eos_token_id and not req.params.ignore_eos:
            if rank < width:
                done = copy_seq(beams[parent])
                append_token(req, done, tok, eos_token_id, max_seq_len, lp)
                req.done.append(done)
            continue
        chosen.append((parent, tok, lp))
        if len(chosen) == width:
            break
    new, used = [], set()
    for parent, tok, lp in chosen:
        p = beams[parent]
        if parent in used:
            p = copy_seq(p)
            blocks.fork(beams[parent].seq_id, p.seq_id)
        new.append((p, tok, lp))
        used.add(parent)
    freed = [s.seq_id for i, s in enumerate(beams) if i not in used]
    for seq_id in freed:
        blocks.free(seq_id)
    req.seqs = [b for b, _, _ in new]
    for seq, tok, lp in new:
        append_token(req, seq, tok, eos_token_id, max_seq_len, lp)
    return freed


def beam_score(req: Request, seq: Sequence) -> float:
    """Summed log-probability / length ** length_penalty (HF's length normalisation)."""
    return seq.cumulative_logprob / max(1, len(seq.output_ids)) ** req.params.length_penalty
