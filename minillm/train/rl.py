"""RLHF with REINFORCE and a KL penalty, and RLAIF (an AI or rule judge labels the pairs).

**RLHF** (Ouyang et al., 2022, with PPO; here the simpler REINFORCE with a leave-one-out
baseline, as in Ahmadian et al., 2024): sample answers from the policy, score them with the
reward model, subtract beta * KL(policy || reference) estimated on the sampled tokens, and raise
the log-probability of answers that beat the other samples of their batch:
loss = -mean[(R_i - mean_{j != i} R_j) * log pi(answer_i)], R = reward - beta * KL.

**RLAIF** (Bai et al., 2022; Lee et al., 2023): the preference labels come from a judge instead
of people. The judge here is either a written rule (:func:`constitution_score`, transparent and
checkable) or the language model itself asked which answer is better (:func:`model_judge`).
The labelled pairs then train the policy with DPO.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from ..config import SamplingParams
from ..generate import generate
from .data import IGNORE, SIGNATURE, prompt_ids
from .lora import lora_disabled
from .sft import optimizer

RUDE = ("yourself", "silly", "why would", "busy", "stupid", "not answer")


def sample(model, tok, prompt: str, max_tokens: int = 24, temperature: float = 1.0,
           seed: int | None = None) -> list[int]:
    """One sampled answer (token ids, EOS kept if produced)."""
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    return generate(model, prompt_ids(tok, prompt), params)


def _sequences(tok, prompt: str, answers: Sequence[list[int]], device):
    p = prompt_ids(tok, prompt)
    t = len(p) + max(len(a) for a in answers)
    ids = torch.zeros(len(answers), t, dtype=torch.long)
    labels = torch.full((len(answers), t), IGNORE, dtype=torch.long)
    for i, a in enumerate(answers):
        s = p + list(a)
        ids[i, :len(s)] = torch.tensor(s)
        labels[i, len(p) - 1:len(s) - 1] = torch.tensor(list(a))
    return ids.to(device), labels.to(device)


def token_logprobs(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) at each position [B, T] (0 where the label is IGNORE)."""
    logp = model(ids).float().log_softmax(-1)
    out = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return out * (labels != IGNORE)


def train_rlhf(policy, tok, reward_fn: Callable[[str, str], float], prompts: Sequence[str],
               steps: int = 10, samples: int = 4, beta: float = 0.05, lr: float = 5e-4,
               max_tokens: int = 24, seed: int = 0,
               log: Callable[[int, dict], None] | None = None) -> dict:
    """REINFORCE with a KL penalty on the LoRA adapters of ``policy`` (reference: adapters off).

    Each step takes one prompt, samples ``samples`` answers, and scores each with
    ``reward_fn(prompt, answer_text)``. Returns per-step means {"reward", "kl", "objective"}.
    """
    if samples < 2:
        raise ValueError(f"samples must be >= 2 (the baseline is the other samples), got {samples}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    opt = optimizer(policy, lr)
    rng = random.Random(seed)
    hist = {"reward": [], "kl": [], "objective": []}
    for step in range(steps):
        prompt = rng.choice(list(prompts))
        answers = [sample(policy, tok, prompt, max_tokens, seed=seed * 100003 + step * 97 + i)
                   for i in range(samples)]
        texts = [tok.decode([t for t in a if t != tok.eos_token_id], skip_special_tokens=True)
                 for a in answers]
        rewards = torch.tensor([float(reward_fn(prompt, t)) for t in texts])
        ids, labels = _sequences(tok, prompt, answers, policy.device)
        with torch.no_grad(), lora_disabled(policy):
            ref = token_logprobs(policy, ids, labels).sum(-1).cpu()
        policy.train()
        logp = token_logprobs(policy, ids, labels).sum(-1)
        kl = logp.detach().cpu() - ref  # one-sample estimate of KL(pi || ref) per answer
        total = rewards - beta * kl
        baseline = (total.sum() - total) / (samples - 1)  # leave-one-out
        loss = -((total - baseline).to(logp.device) * logp).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        policy.eval()
        hist["reward"].append(rewards.mean().item())
        hist["kl"].append(kl.mean().item())
        hist["objective"].append(total.mean().item())
        if log:
            log(step, {k: v[-1] for k, v in hist.items()})
    return hist


# ----------------------------------------------------------------------------- judges

def constitution_score(answer: str) -> float:
    """A written rule ("constitution") for a good answer: polite, signed, short.

    +1 for the signature phrase, -2 for a rude phrase, -0.05 per word beyond twelve.
    """
    text = answer.lower()
    words = len(answer.split())
    return (float(SIGNATURE.lower() in text) - 2.0 * any(r in text for r in RUDE)
            - 0.05 * max(0, words - 12))


def rule_judge(prompt: str, a: str, b: str) -> int:
    """0 if answer a is better under :func:`constitution_score`, 1 if b is, -1 for a tie."""
    sa, sb = constitution_score(a), constitution_score(b)
    return -1 if sa == sb else int(sb > sa)


def model_judge(model, tok) -> Callable[[str, str, str], int]:
    """The language model as judge: asked which answer is better, compare p("A") and p("B"),
    averaged over both orders of the answers to cancel the judge's position bias."""
    ids_a, ids_b = tok.encode("A")[0], tok.encode("B")[0]

    @torch.no_grad()
    def judge(prompt: str, a: str, b: str) -> int:
        score = 0.0
        for first, second, sign in ((a, b, 1.0), (b, a, -1.0)):
            q = (f"Question: {prompt}\nAnswer A: {first}\nAnswer B: {second}\n"
                 "Which answer is correct and polite? Reply with A or B.")
            x = torch.tensor([prompt_ids(tok, q)], device=model.device)
            logits = model(x, last_only=True)[0, -1].float()
            score += sign * (logits[ids_a] - logits[ids_b]).item()
        return 0 if score > 0 else 1

    return judge


def judge_agreement(judge: Callable[[str, str, str], int], rows: Sequence[dict]) -> float:
    """How often a judge picks the human-labelled ``chosen`` answer of preference rows."""
    hits = [judge(r["prompt"], r["chosen"], r["rejected"]) == 0 for r in rows]
    return sum(hits) / max(len(hits), 1)


def rlaif_pairs(policy, tok, prompts: Sequence[str], judge: Callable[[str, str, str], int],
                samples: int = 2, max_tokens: int = 24, temperature: float = 1.0,
                seed: int = 0) -> list[dict]:
    """Sample answers from the policy and let the judge label (chosen, rejected) pairs; ties
    are dropped. The rows feed :func:`minillm.train.preference.train_dpo`."""
    rows = []
    for i, prompt in enumerate(prompts):
        texts = []
        for j in range(samples):
            a = sample(policy, tok, prompt, max_tokens, temperature, seed=seed + 1000 * i + j)
            texts.append(tok.decode([t for t in a if t != tok.eos_token_id],
                                    skip_special_tokens=True))
        verdict = judge(prompt, texts[0], texts[1])
        if verdict >= 0:
            rows.append({"prompt": prompt, "chosen": texts[verdict],
                         "rejected": texts[1 - verdict]})
    return rows
