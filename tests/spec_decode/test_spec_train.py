"""Drafter training (minillm.spec_decode.training.train) on a tiny random target and a synthetic
dataset in the distillation format: every loss goes down when overfitting one batch, a run resumes
from its checkpoint exactly, the draft vocabulary is what it should be, and the weights file
loads."""
from __future__ import annotations

import pytest
import torch

from minillm import load_model
from minillm.spec_decode import weights
from minillm.spec_decode.drafters import OOV
from minillm.spec_decode.training import batches as TB
from minillm.spec_decode.training import train as T


@pytest.fixture(scope="module")
def target():
    return load_model("tiny", random_weights=True, dtype=torch.float32, device="cpu")[0]


def synthetic_data(target, seqs: int = 12, seed: int = 0) -> dict:
    """The distillation format: replies drawn from a small pool, features from the target."""
    g = torch.Generator().manual_seed(seed)
    toks, plens, feats = [], [], []
    for _ in range(seqs):
        p, r = (int(torch.randint(lo, hi, (), generator=g)) for lo, hi in ((6, 12), (12, 30)))
        ids = torch.cat([torch.randint(3, 400, (p,), generator=g),
                         torch.randint(3, 60, (r,), generator=g)])
        with torch.no_grad():
            feats.append(target.hidden_states(ids[None])[0].to(torch.bfloat16))
        toks.append(ids)
        plens.append(p)
    lens = torch.tensor([len(t) for t in toks])
    return {"tokens": torch.cat(toks).int(), "prompt_lens": torch.tensor(plens),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
            "features": torch.cat(feats), "kinds": ["chat"] * seqs, "heldout": 2}


@pytest.fixture(scope="module")
def data(target):
    return synthetic_data(target)


def test_draft_vocabulary(data):
    ids = TB.draft_vocabulary(data, 40)
    assert len(ids) == 40 and torch.equal(ids, ids.unique())       # sorted, no repeats
    assert {0, 1, 2} <= set(ids.tolist())
    assert ids.max() < 60                      # reply tokens only: prompt ids reach 400
    seq = torch.repeat_interleave(torch.arange(12), data["offsets"].diff())
    pos = torch.arange(len(data["tokens"])) - data["offsets"][seq]
    reply = data["tokens"][pos >= data["prompt_lens"][seq]].long()
    assert reply.bincount().argmax() in ids
    lookup = T.vocab_lookup(ids, 49152)
    assert torch.equal(lookup[ids], torch.arange(40)) and lookup[400] == OOV


@pytest.mark.parametrize("method", list(T.LOSSES))
def test_overfits_one_batch(method, target, data):
    torch.manual_seed(0)
    cfg = T.drafter_config(method, target, draft_vocab=64)
    drafter = T.build_drafter(cfg, target).train()
    ids = TB.draft_vocabulary(data, 64)
    head, lookup = T.DraftHead(target.lm_head.weight, ids), T.vocab_lookup(ids, 49152)
    batch = TB.sample_batch(data, TB.split(data)[0], torch.Generator().manual_seed(0), 4, 24)
    batch = batch.to(target.device, target.dtype)
    opt = T.make_optimizer(drafter, target)
    for g in opt.param_groups:
        g["lr"] = 1e-2 if method == "medusa" else 3e-3   # Medusa's heads start at zero
    losses = [T.train_step(method, drafter, head, target, batch, lookup, opt) for _ in range(30)]
    assert losses[-1] < 0.8 * losses[0], losses
    assert not any(p.grad is not None for p in target.parameters())


def test_resume_continues_where_it_stopped(target, data, tmp_path, monkeypatch):
    kw = dict(draft_vocab=64, batch=4, width=24, progress=False)
    whole = T.train("eagle", target, data, 15, ckpt=tmp_path / "a.ckpt", **kw).state
    monkeypatch.setattr(T, "CKPT_EVERY", 10)
    step, calls = T.train_step, []

    def interrupted(*args):
        if len(calls) == 10:
            raise KeyboardInterrupt
        calls.append(1)
        return step(*args)

    monkeypatch.setattr(T, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        T.train("eagle", target, data, 15, ckpt=tmp_path / "b.ckpt", **kw)
    monkeypatch.setattr(T, "train_step", step)
    assert torch.load(tmp_path / "b.ckpt")["step"] == 10
    resumed = T.train("eagle", target, data, 15, ckpt=tmp_path / "b.ckpt", **kw).state
    assert resumed.step == 15 and len(resumed.losses) == 15
    assert resumed.losses == pytest.approx(whole.losses, rel=1e-4)
    fresh = T.train("eagle", target, data, 3, ckpt=tmp_path / "b.ckpt", fresh=True, **kw).state
    assert fresh.step == 3


def test_lr_schedule():
    assert T.lr_at(0, 1000) == pytest.approx(T.LR / T.WARMUP)
    assert T.lr_at(T.WARMUP, 1000) == pytest.approx(T.LR)
    assert T.lr_at(999, 1000) < 0.01 * T.LR


def test_run_writes_a_loadable_drafter(target, data, tmp_path, monkeypatch):
    monkeypatch.setattr(T, "DRAFT_VOCAB", 64)
    monkeypatch.setattr(T, "checkpoint_path", lambda m: tmp_path / f"{m}.ckpt")
    pt = T.run("medusa", target, data, steps=4, out=tmp_path / "medusa.pt")
    drafter, head, man = weights.load_drafter("medusa", target, pt)
    assert man["steps"] == 4 and man["data"]["sequences"] == 12
    assert len(man["heldout_accuracy"]) == 5
    acc = torch.tensor(man["head_accuracy"])
    assert acc.shape == (5, T.TOPK) and (acc >= 0).all() and acc.sum(1).max() <= 1 + 1e-6
    assert len(head.ids) == 64


def test_a_warm_run_keeps_its_own_checkpoint_and_names_the_first(target, data, tmp_path,
                                                                 monkeypatch):
    """A first run's checkpoint (at its last step) must not be resumed by a warm run of the
    same method, which starts from the first run's weights file instead."""
    monkeypatch.setattr(T, "DRAFT_VOCAB", 64)
    monkeypatch.setattr(T, "checkpoint_path", lambda m: tmp_path / f"{m}.ckpt")
    first = T.run("mtp", target, data, steps=4, out=tmp_path / "a" / "mtp.pt")
    second = T.run("mtp", target, data, steps=2, out=tmp_path / "b" / "mtp.pt", warm_from=first)
    assert torch.load(tmp_path / "mtp-warm.ckpt")["step"] == 2
    man = weights.read_manifest("mtp", second)
    assert man["steps"] == 2 and man["warm_start"]["steps"] == 4
    assert weights.training_run(man) == "2 steps on 12 replies ({:,} tokens), after 4 steps on " \
        "12 replies ({:,} tokens)".format(len(data["tokens"]), len(data["tokens"]))


def test_ahead_past_the_end():
    x = torch.arange(6).view(2, 3)
    assert torch.equal(T.ahead(x, 1, -1), torch.tensor([[1, 2, -1], [4, 5, -1]]))
    assert (T.ahead(x, 5, -1) == -1).all()


def test_live_features_are_the_stored_ones(target, data):
    """Computed per batch from whole-sequence windows, the features equal those the
    distillation data stores (bfloat16 there), and the target's argmax comes along; a window
    that does not start at a sequence's first token is refused."""
    tokens_only = {k: v for k, v in data.items() if k != "features"}
    gen = torch.Generator().manual_seed(0)
    live = TB.LiveFeatures(target, next_tokens=True)
    batch = live(TB.sample_whole(tokens_only, torch.arange(12), gen, 4, 64))
    stored = TB.make_batch(data, [(s, 0) for s in _rows_of(batch, data)], 64)
    real = torch.arange(batch.tokens.shape[1])[None] < batch.lengths[:, None]
    torch.testing.assert_close(batch.features[real].to(torch.bfloat16), stored.features[real],
                               atol=2e-2, rtol=2e-2)
    with torch.no_grad():
        assert torch.equal(batch.target_next, target(batch.tokens).argmax(-1))
    with pytest.raises(ValueError, match="first token"):
        live(TB.make_batch(tokens_only, [(0, 3)], 16))


def _rows_of(batch, data) -> list[int]:
    """The sequence ids of a whole-sequence batch, found by their tokens."""
    offsets = data["offsets"]
    out = []
    for row, n in zip(batch.tokens, batch.lengths.tolist()):
        out.append(next(s for s in range(len(offsets) - 1)
                        if torch.equal(data["tokens"][offsets[s]:offsets[s] + n].long(),
                                       row[:n])))
    return out


def test_run_on_token_ids_with_live_features(target, data, tmp_path, monkeypatch):
    monkeypatch.setattr(T, "DRAFT_VOCAB", 64)
    monkeypatch.setattr(T, "checkpoint_path", lambda m: tmp_path / f"{m}.ckpt")
    tokens_only = {k: v for k, v in data.items() if k != "features"}
    pt = T.run("mtp", target, tokens_only, steps=3, out=tmp_path / "mtp.pt",
               live=TB.LiveFeatures(target))
    _, _, man = weights.load_drafter("mtp", target, pt)
    assert man["steps"] == 3 and len(man["heldout_accuracy"]) == T.EVAL_DEPTH


def test_whole_sequence_batches_hold_rows_of_about_one_length():
    """Sequences of lengths 10..1009: a batch's rows come from NEIGHBOURS neighbours in length
    (far narrower than the spread of random rows), start at each sequence's first token, and
    every length range is drawn."""
    lengths = torch.arange(10, 1010)
    data = {"tokens": torch.zeros(int(lengths.sum()), dtype=torch.int32),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            "prompt_lens": torch.full((1000,), 4)}
    gen, spans, seen = torch.Generator().manual_seed(0), [], set()
    for _ in range(200):
        batch = TB.sample_whole(data, torch.arange(1000), gen, 8, 2000)
        assert int(batch.positions[:, 0].max()) == 0
        spans.append(int(batch.lengths.max() - batch.lengths.min()))
        seen.add(int(batch.lengths[0]) // 100)
    assert max(spans) < TB.NEIGHBOURS and set(range(10)) <= seen
