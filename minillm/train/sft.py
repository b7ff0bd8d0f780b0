"""Supervised fine-tuning: next-token cross-entropy on the response tokens of chat examples.

Pre-training taught the model to continue text; SFT shows it (prompt, answer) pairs in the chat
template so it continues a user turn with an assistant answer in the wanted style. The loss is
the usual next-token cross-entropy, counted on the response only (the prompt is given).
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..config import SamplingParams
from ..generate import generate
from .data import IGNORE, SIGNATURE, batch, prompt_ids
from .lora import lora_parameters


def sft_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens whose label is not IGNORE."""
    logits = model(ids).float()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


def batches(rows: Sequence, batch_size: int, steps: int, seed: int = 0):
    """``steps`` batches drawn by walking a seeded shuffle of ``rows`` (reshuffled each pass)."""
    if batch_size < 1 or steps < 0:
        raise ValueError(f"batch_size must be >= 1 and steps >= 0, got {batch_size}, {steps}")
    rng = random.Random(seed)
    order: list = []
    for _ in range(steps):
        if len(order) < batch_size:
            more = list(rows)
            rng.shuffle(more)
            order += more
        yield order[:batch_size]
        order = order[batch_size:]


def optimizer(model, lr: float, params=None) -> torch.optim.Optimizer:
    params = list(params if params is not None else lora_parameters(model))
    if not params:
        raise ValueError("nothing to train: add LoRA adapters (add_lora) or pass params")
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def train_sft(model, tok, rows: Sequence[dict], steps: int = 30, batch_size: int = 8,
              lr: float = 1e-3, max_len: int = 96, seed: int = 0,
              log: Callable[[int, float], None] | None = None) -> list[float]:
    """Train the LoRA adapters of ``model`` on {"prompt", "response"} rows; return the losses."""
    opt = optimizer(model, lr)
    losses = []
    model.train()
    for step, rows_b in enumerate(batches(rows, batch_size, steps, seed)):
        ids, labels = batch(tok, [(r["prompt"], r["response"]) for r in rows_b], max_len)
        loss = sft_loss(model, ids.to(model.device), labels.to(model.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log:
            log(step, losses[-1])
    model.eval()
    return losses


@torch.no_grad()
def eval_loss(model, tok, rows: Sequence[dict], max_len: int = 96) -> float:
    ids, labels = batch(tok, [(r["prompt"], r["response"]) for r in rows], max_len)
    return sft_loss(model, ids.to(model.device), labels.to(model.device)).item()


def reply(model, tok, prompt: str, max_tokens: int = 32, temperature: float = 0.0,
          seed: int | None = None) -> str:
    """The model's answer to one user message (greedy by default)."""
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    out = generate(model, prompt_ids(tok, prompt), params)
    return tok.decode([i for i in out if i != tok.eos_token_id], skip_special_tokens=True)


def signature_rate(replies: Sequence[str]) -> float:
    """Fraction of replies that use the SFT data's signature phrase."""
    return sum(SIGNATURE in r for r in replies) / max(len(replies), 1)
