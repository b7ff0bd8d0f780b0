"""Post-training: LoRA / QLoRA algebra, SFT, reward model, DPO, REINFORCE-KL and RLAIF pieces,
on the small random preset (with SmolLM2's tokenizer), against direct float64 computations."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from minillm.quant import Int4Linear, quantize_int4
from minillm.train.data import IGNORE, batch, load_jsonl, split
from minillm.train.lora import (
    LoRALinear,
    add_lora,
    lora_disabled,
    lora_modules,
    merge_lora,
    trainable_fraction,
    unmerge_lora,
)
from minillm.train.preference import (
    RewardModel,
    _pair_logprobs,
    _ReferenceLogprobs,
    dpo_loss,
    dpo_margins,
    reward_accuracy,
    train_dpo,
    train_reward_model,
)
from minillm.train.rl import constitution_score, rlaif_pairs, rule_judge, train_rlhf
from minillm.train.sft import eval_loss, train_sft


@pytest.fixture(scope="module")
def model_tok(tiny):
    model, tok = tiny
    return model, tok


def fresh(model_tok, layers=(0, 1), rank=4):
    model, tok = model_tok
    m = copy.deepcopy(model)
    add_lora(m, rank=rank, alpha=8.0, layers=layers)
    return m, tok


def randomise_b(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model):
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=g) * 0.05)


# ----------------------------------------------------------------------------- data

def test_data_sets_and_labels(model_tok):
    _, tok = model_tok
    sft, prefs = load_jsonl("sft"), load_jsonl("preferences")
    assert len(sft) >= 40 and len(prefs) == len(sft)
    train, held = split(sft)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    ids, labels = batch(tok, [(sft[0]["prompt"], sft[0]["response"])])
    target = labels[0][labels[0] != IGNORE].tolist()
    assert tok.decode(target, skip_special_tokens=True) == sft[0]["response"]
    assert target[-1] == tok.eos_token_id
    with pytest.raises(ValueError, match="no data set"):
        load_jsonl("nope")


# ----------------------------------------------------------------------------- LoRA

def test_lora_starts_as_the_base_model_and_merge_equals_adapters(model_tok):
    base, _ = model_tok
    m, _ = fresh(model_tok)
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(m(ids), base(ids))  # B = 0
        randomise_b(m)
        adapted = m(ids)
        assert (adapted - base(ids)).abs().max() > 1e-4
        w0 = m.layers[0].attn.wq.base.weight.clone()
        merge_lora(m)
        torch.testing.assert_close(m(ids), adapted, atol=1e-5, rtol=1e-5)
        lin = m.layers[0].attn.wq
        want = w0.double() + lin.alpha / lin.rank * lin.lora_b.double() @ lin.lora_a.double()
        torch.testing.assert_close(lin.base.weight.double(), want, atol=1e-6, rtol=1e-6)
        unmerge_lora(m)
        torch.testing.assert_close(m.layers[0].attn.wq.base.weight, w0, atol=1e-6, rtol=0)
        torch.testing.assert_close(m(ids), adapted, atol=1e-5, rtol=1e-5)
        with lora_disabled(m):
            torch.testing.assert_close(m(ids), base(ids), atol=1e-6, rtol=0)


def test_lora_trains_only_the_adapters(model_tok):
    m, _ = fresh(model_tok, layers=(1,), rank=2)
    train, total = trainable_fraction(m)
    n_lora = sum(2 * (lin.in_features + lin.out_features) for lin in lora_modules(m))
    assert train == n_lora and train / total < 0.01


@pytest.mark.parametrize("rank,match", [(17, r"rank must be .* \[1, 16\]"), (0, "rank must be"),
                                        (2.5, "rank must be")])
def test_lora_rank_above_the_layer_is_an_error(rank, match):
    with pytest.raises(ValueError, match=match):
        LoRALinear(nn.Linear(64, 16, bias=False), rank=rank)


def test_add_lora_bad_layers_and_targets(model_tok):
    model, _ = model_tok
    with pytest.raises(ValueError, match="layers must be in"):
        add_lora(copy.deepcopy(model), layers=[5])
    with pytest.raises(ValueError, match="targets must be among"):
        add_lora(copy.deepcopy(model), targets=["attn.wz"])


def test_qlora_over_an_int4_base():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g) * 0.05
    base = Int4Linear(*quantize_int4(w, 32), 32)
    lora = LoRALinear(base, rank=4, alpha=4.0)
    with torch.no_grad():
        lora.lora_b.copy_(torch.randn(32, 4, generator=g) * 0.1)
    x = torch.randn(5, 64, generator=g, requires_grad=True)
    y = lora(x)
    ref = x.double() @ (base.dequantize().double() + lora.delta().double()).t()
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    y.square().sum().backward()
    assert lora.lora_a.grad.abs().sum() > 0 and lora.lora_b.grad.abs().sum() > 0
    assert x.grad is not None  # gradients reach earlier layers through the 4-bit base
    with pytest.raises(ValueError, match="merge needs a float"):
        lora.merge()


# ----------------------------------------------------------------------------- SFT

def test_sft_lowers_the_loss(model_tok):
    m, tok = fresh(model_tok, rank=8)
    rows = load_jsonl("sft")[:2]
    before = eval_loss(m, tok, rows)
    losses = train_sft(m, tok, rows, steps=6, batch_size=2, lr=1e-1)
    assert len(losses) == 6 and losses[0] == pytest.approx(before, rel=1e-4)
    assert eval_loss(m, tok, rows) < before - 0.25


# ----------------------------------------------------------------------------- preferences

def test_dpo_loss_matches_float64():
    pc, pr, rc, rr = (torch.tensor(v) for v in ([-3.0, -5.0], [-4.0, -2.0], [-3.5, -4.0],
                                                [-3.9, -2.5]))
    loss, margin = dpo_loss(pc, pr, rc, rr, beta=0.5)
    want = [0.5 * ((a - c) - (b - d)) for a, b, c, d in zip(pc.tolist(), pr.tolist(),
                                                              rc.tolist(), rr.tolist())]
    assert margin.tolist() == pytest.approx(want)
    assert loss.item() == pytest.approx(
        sum(math.log1p(math.exp(-m)) for m in want) / 2, rel=1e-6)


def test_dpo_raises_the_margin(model_tok):
    m, tok = fresh(model_tok, rank=8)
    rows = load_jsonl("preferences")[:2]
    hist = train_dpo(m, tok, rows, steps=5, batch_size=2, beta=0.5, lr=2e-2)
    assert hist["margin"][0] == pytest.approx(0.0, abs=1e-5)  # policy == reference at start
    assert hist["margin"][-1] > 0.5 and hist["accuracy"][-1] == 1.0
    with pytest.raises(ValueError, match="beta must be > 0"):
        train_dpo(m, tok, rows, steps=1, beta=0.0)


def test_dpo_reference_is_the_model_without_adapters(model_tok):
    """The reference's log-probabilities are the base model's, once per row, whatever the
    adapters hold when a row is first seen (its cache is keyed by the row's texts)."""
    m, tok = fresh(model_tok, rank=8)
    randomise_b(m)                                     # the adapters now change the outputs
    rows = load_jsonl("preferences")[:3]
    reference = _ReferenceLogprobs(m, tok, 96)
    first = reference(rows[:2])
    again = reference(rows[::-1])
    with torch.no_grad():
        want = _pair_logprobs(model_tok[0], tok, rows[::-1], 96)
        policy = _pair_logprobs(m, tok, rows[::-1], 96)
    for got, base, pol in zip(again, want, policy):
        torch.testing.assert_close(got, base, rtol=1e-5, atol=1e-5)
        assert (got - pol).abs().max() > 1e-3          # not the policy's
    torch.testing.assert_close(first[0], again[0][1:].flip(0))
    assert len(reference.known) == 3


def test_dpo_early_stopping_keeps_the_best_held_out_step(model_tok):
    m, tok = fresh(model_tok, rank=8)
    rows = load_jsonl("preferences")
    hist = train_dpo(m, tok, rows[:4], steps=8, batch_size=2, beta=0.5, lr=5e-2,
                     held_out=rows[4:7], patience=2)
    n = len(hist["held_accuracy"])
    assert n == len(hist["loss"]) == len(hist["held_chosen_shift"]) <= 8
    best = hist["best_step"]
    scores = list(zip(hist["held_accuracy"], hist["held_chosen_shift"]))
    assert scores[best - 1] == max(scores) and (n == 8 or n - best == 2)
    held = dpo_margins(m, tok, rows[4:7], beta=0.5)  # the restored adapters are the best step's
    assert (held > 0).float().mean().item() == pytest.approx(hist["held_accuracy"][best - 1])
    with pytest.raises(ValueError, match="patience must be >= 1 and needs held_out"):
        train_dpo(m, tok, rows[:4], steps=1, patience=2)


def test_reward_model_learns_the_pairs(model_tok):
    trunk, tok = fresh(model_tok, rank=8)
    rm = RewardModel(trunk)
    rows = load_jsonl("preferences")[:4]
    hist = train_reward_model(rm, tok, rows, steps=16, batch_size=4, lr=2e-2)
    assert hist["loss"][0] == pytest.approx(math.log(2), rel=1e-4)  # zero head: r_c = r_r
    assert hist["loss"][-1] < 0.3  # from log 2 = 0.69 at the start
    assert reward_accuracy(rm, tok, rows) == 1.0  # every trained pair ranked right
    assert reward_accuracy(rm, tok, [{**r, "chosen": r["rejected"], "rejected": r["chosen"]}
                                     for r in rows]) == 0.0  # and every swapped pair wrong


# ----------------------------------------------------------------------------- RL

def test_constitution_and_rule_judge():
    good, rude = "Paris. Glad to help!", "Figure it out yourself."
    assert constitution_score(good) == 1.0 and constitution_score(rude) == -2.0
    assert rule_judge("q", good, rude) == 0 and rule_judge("q", rude, good) == 1
    assert rule_judge("q", good, good) == -1


def test_rlhf_starts_at_zero_kl_and_moves_the_policy(model_tok):
    m, tok = fresh(model_tok, rank=4)
    hist = train_rlhf(m, tok, lambda p, a: float(len(a) % 3), ["What is two plus two?"],
                      steps=2, samples=3, beta=0.1, lr=1e-2, max_tokens=6)
    assert hist["kl"][0] == pytest.approx(0.0, abs=1e-5)
    assert any(mod.lora_b.abs().sum() > 0 for mod in lora_modules(m))
    with pytest.raises(ValueError, match="samples must be >= 2"):
        train_rlhf(m, tok, lambda p, a: 0.0, ["x"], steps=1, samples=1)


def test_rlaif_pairs_follow_the_judge(model_tok):
    m, tok = fresh(model_tok)
    prompts = ["What is two plus two?", "Name a color."]
    rows = rlaif_pairs(m, tok, prompts, rule_judge, max_tokens=16)
    for r in rows:  # the rule judge ties on most samples of this model: rows may be few
        assert constitution_score(r["chosen"]) > constitution_score(r["rejected"])

    def shorter(prompt, a, b):  # a judge that never ties on different answers
        return -1 if a == b else int(len(b) < len(a))

    rows = rlaif_pairs(m, tok, prompts, shorter, max_tokens=16)
    assert [r["prompt"] for r in rows] == prompts, "sampled answers should differ"
    for r in rows:
        assert len(r["chosen"]) < len(r["rejected"]), r
