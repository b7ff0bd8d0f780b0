"""The course's small instruction and preference sets, and turning them into token batches.

``data/sft.jsonl``: {"prompt", "response"}: short factual answers that end with a signature
phrase (:data:`SIGNATURE`), a style the base model never uses, so SFT's effect is easy to see.
``data/preferences.jsonl``: {"prompt", "chosen", "rejected"}: the chosen answer is correct and
polite, the rejected one is wrong (even rows) or rude (odd rows). Both were written for this
course. Held-out splits are the last :data:`HELD_OUT` rows.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

DATA = Path(__file__).parent / "data"
SIGNATURE = "Glad to help!"
HELD_OUT = 8
IGNORE = -100  # label of tokens that are not trained on (the prompt, padding)


def load_jsonl(name: str) -> list[dict]:
    """Rows of ``data/<name>.jsonl``."""
    path = DATA / f"{name}.jsonl"
    if not path.exists():
        raise ValueError(f"no data set {name!r}: expected one of "
                         f"{sorted(p.stem for p in DATA.glob('*.jsonl'))}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def split(rows: list[dict], held_out: int = HELD_OUT) -> tuple[list[dict], list[dict]]:
    """(train, held-out): the last ``held_out`` rows are never trained on."""
    return rows[:-held_out], rows[-held_out:]


def prompt_ids(tok, prompt: str) -> list[int]:
    """The user turn in the chat template, ending where the assistant starts."""
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}],
                                              add_generation_prompt=True))


def example_ids(tok, prompt: str, response: str, max_len: int = 96) -> tuple[list[int], int]:
    """(ids of prompt + response + EOS, number of prompt tokens), cut to ``max_len``."""
    p = prompt_ids(tok, prompt)
    r = tok.encode(response) + [tok.eos_token_id]
    return (p + r)[:max_len], len(p)


def batch(tok, pairs: list[tuple[str, str]], max_len: int = 96, pad_id: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """[(prompt, response)] -> (input ids [B, T], labels [B, T]) right-padded.

    labels[t] is the token the model should predict at position t (ids shifted left), or
    IGNORE on the prompt and the padding, so the loss counts response tokens only.
    """
    seqs = [example_ids(tok, p, r, max_len) for p, r in pairs]
    t = max(len(s) for s, _ in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), t), IGNORE, dtype=torch.long)
    for i, (s, n_prompt) in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        labels[i, n_prompt - 1:len(s) - 1] = torch.tensor(s[n_prompt:])
    return ids, labels


def response_logprobs(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over response tokens of log p(token), per row [B] (differentiable)."""
    logits = model(ids).float()
    mask = labels != IGNORE
    logp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return (logp * mask).sum(-1)
