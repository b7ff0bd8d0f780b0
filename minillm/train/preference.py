"""Learning from preferences: a reward model (Bradley-Terry) and DPO.

Both read pairs (prompt, chosen, rejected). The **reward model** (Ouyang et al., 2022) is the
language model with a scalar head on its last token, trained so r(chosen) > r(rejected):
loss = -log sigmoid(r_c - r_r). **DPO** (Rafailov et al., 2023) skips the reward model: the
policy's own log-probability ratio to a frozen reference is the implicit reward, and
loss = -log sigmoid(beta * [(log pi(c) - log ref(c)) - (log pi(r) - log ref(r))]).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .data import batch, example_ids
from .lora import lora_disabled, lora_parameters
from .sft import batches, optimizer


class RewardModel(nn.Module):
    """A Transformer trunk (usually with LoRA adapters) and a linear head on the last token."""

    def __init__(self, trunk: nn.Module) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = nn.Linear(trunk.cfg.d_model, 1, device=trunk.device, dtype=torch.float32)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """ids [B, T] right-padded, lengths [B] -> rewards [B]."""
        h = self.trunk.hidden_states(ids)
        last = h[torch.arange(ids.shape[0], device=ids.device), lengths - 1]
        return self.head(last.float())[:, 0]

    def score(self, tok, pairs: Sequence[tuple[str, str]], max_len: int = 96) -> torch.Tensor:
        """Rewards of [(prompt, response)] (no gradient)."""
        with torch.no_grad():
            return self(*_padded(tok, pairs, max_len, self.trunk.device))


def _padded(tok, pairs, max_len, device):
    seqs = [example_ids(tok, p, r, max_len)[0] for p, r in pairs]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    return ids.to(device), torch.tensor([len(s) for s in seqs], device=device)


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    return -F.logsigmoid(r_chosen - r_rejected).mean()


def train_reward_model(rm: RewardModel, tok, rows: Sequence[dict], steps: int = 20,
                       batch_size: int = 8, lr: float = 1e-3, max_len: int = 96, seed: int = 0,
                       log: Callable[[int, float, float], None] | None = None) -> dict:
    """Fit the head and the trunk's adapters to the preference pairs; returns
    {"loss": [...], "accuracy": [...]} per step (accuracy on the step's batch)."""
    opt = optimizer(rm, lr, [*lora_parameters(rm.trunk), *rm.head.parameters()])
    hist = {"loss": [], "accuracy": []}
    rm.train()
    for step, rows_b in enumerate(batches(rows, batch_size, steps, seed)):
        pairs = [(r["prompt"], r["chosen"]) for r in rows_b] + \
                [(r["prompt"], r["rejected"]) for r in rows_b]
        rewards = rm(*_padded(tok, pairs, max_len, rm.trunk.device))
        rc, rr = rewards[:len(rows_b)], rewards[len(rows_b):]
        loss = bradley_terry_loss(rc, rr)
        opt.zero_grad()
        loss.backward()
        opt.step()
        hist["loss"].append(loss.item())
        hist["accuracy"].append((rc > rr).float().mean().item())
        if log:
            log(step, hist["loss"][-1], hist["accuracy"][-1])
    rm.eval()
    return hist


def reward_accuracy(rm: RewardModel, tok, rows: Sequence[dict]) -> float:
    """Fraction of pairs where the reward model scores the chosen answer higher."""
    rc = rm.score(tok, [(r["prompt"], r["chosen"]) for r in rows])
    rr = rm.score(tok, [(r["prompt"], r["rejected"]) for r in rows])
    return (rc > rr).float().mean().item()


# ----------------------------------------------------------------------------- DPO

def sequence_logprobs(model, tok, pairs: Sequence[tuple[str, str]], max_len: int = 96
                      ) -> torch.Tensor:
    """Sum of log p(response token) for each (prompt, response) [B] (differentiable)."""
    from .data import response_logprobs

    ids, labels = batch(tok, list(pairs), max_len)
    return response_logprobs(model, ids.to(model.device), labels.to(model.device))


def dpo_loss(pi_c: torch.Tensor, pi_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor,
             beta: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, implicit reward margin beta * [(pi_c - ref_c) - (pi_r - ref_r)] per pair)."""
    margin = beta * ((pi_c - ref_c) - (pi_r - ref_r))
    return -F.logsigmoid(margin).mean(), margin.detach()


def dpo_margins(model, tok, rows: Sequence[dict], beta: float = 0.1) -> torch.Tensor:
    """Implicit reward margins of ``model`` (with adapters) against itself without them."""
    with torch.no_grad():
        pi_c, pi_r = _pair_logprobs(model, tok, rows)
        with lora_disabled(model):
            ref_c, ref_r = _pair_logprobs(model, tok, rows)
    return dpo_loss(pi_c, pi_r, ref_c, ref_r, beta)[1]


def _pair_logprobs(model, tok, rows: Sequence[dict], max_len: int = 96
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(chosen) [B], log pi(rejected) [B]) of the rows, summed over response tokens."""
    return (sequence_logprobs(model, tok, [(r["prompt"], r["chosen"]) for r in rows], max_len),
            sequence_logprobs(model, tok, [(r["prompt"], r["rejected"]) for r in rows], max_len))


class _ReferenceLogprobs:
    """The frozen reference's (chosen, rejected) log-probabilities of preference rows, each row
    computed once (the reference never changes while DPO trains the adapters)."""

    def __init__(self, model, tok, max_len: int) -> None:
        self.model, self.tok, self.max_len = model, tok, max_len
        self.known: dict[tuple[str, str, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, rows: Sequence[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        keys = [(r["prompt"], r["chosen"], r["rejected"]) for r in rows]
        new = {k: r for k, r in zip(keys, rows) if k not in self.known}
        if new:
            with torch.no_grad(), lora_disabled(self.model):
                chosen, rejected = _pair_logprobs(self.model, self.tok, list(new.values()),
                                                  self.max_len)
            self.known |= {k: (c, r) for k, c, r in zip(new, chosen, rejected)}
        return (torch.stack([self.known[k][0] for k in keys]),
                torch.stack([self.known[k][1] for k in keys]))


def _held_out_score(model, tok, rows: Sequence[dict], ref: tuple[torch.Tensor, torch.Tensor],
                    beta: float, max_len: int) -> tuple[float, float]:
    """(share of the rows with DPO margin > 0, mean log pi(chosen) - log ref(chosen)), given
    the reference's (chosen, rejected) log-probabilities ``ref`` [B] each."""
    with torch.no_grad():
        pi = _pair_logprobs(model, tok, rows, max_len)
    margin = dpo_loss(*pi, *ref, beta)[1]
    return (margin > 0).float().mean().item(), (pi[0] - ref[0]).mean().item()


def train_dpo(model, tok, rows: Sequence[dict], steps: int = 20, batch_size: int = 8,
              beta: float = 0.1, lr: float = 1e-3, max_len: int = 96, seed: int = 0,
              log: Callable[[int, float, float], None] | None = None,
              held_out: Sequence[dict] | None = None, patience: int | None = None) -> dict:
    """DPO on the LoRA adapters of ``model``; the reference is the model with adapters off.

    Returns {"loss", "accuracy", "margin"} per step (accuracy: margin > 0 on the batch). With
    ``held_out`` pairs it also records, after each step, "held_accuracy" (margin > 0 on them)
    and "held_chosen_shift" (mean log pi(chosen) - log ref(chosen): strongly negative means
    the policy pushes its preferred answers down too, the start of a collapse). With
    ``patience`` it stops once the held-out accuracy (ties broken by the chosen shift) has not
    improved for that many steps, puts back the adapters of the best step and records
    "best_step" (1-based).
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if patience is not None and (patience < 1 or not held_out):
        raise ValueError(f"patience must be >= 1 and needs held_out pairs, got {patience}")
    opt = optimizer(model, lr)
    params = lora_parameters(model)
    hist = {"loss": [], "accuracy": [], "margin": []}
    reference = _ReferenceLogprobs(model, tok, max_len)
    if held_out:
        hist |= {"held_accuracy": [], "held_chosen_shift": []}
        ref_held = reference(held_out)
    best = None
    for step, rows_b in enumerate(batches(rows, batch_size, steps, seed)):
        ref_c, ref_r = reference(rows_b)
        model.train()
        loss, margin = dpo_loss(*_pair_logprobs(model, tok, rows_b, max_len), ref_c, ref_r,
                                beta)
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.eval()
        hist["loss"].append(loss.item())
        hist["accuracy"].append((margin > 0).float().mean().item())
        hist["margin"].append(margin.mean().item())
        if held_out:
            score = _held_out_score(model, tok, held_out, ref_held, beta, max_len)
            hist["held_accuracy"].append(score[0])
            hist["held_chosen_shift"].append(score[1])
            if patience is not None:
                if best is None or score > best[0]:
                    best = (score, step, [p.detach().clone() for p in params])
                elif step - best[1] >= patience:
                    break
        if log:
            log(step, hist["loss"][-1], hist["accuracy"][-1])
    if best is not None:
        with torch.no_grad():
            for p, saved in zip(params, best[2]):
                p.copy_(saved)
        hist["best_step"] = best[1] + 1
    return hist
