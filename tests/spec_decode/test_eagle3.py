"""EAGLE-3 (minillm.spec_decode.training.eagle3) on a tiny random target: the training-time
test's step-j rows equal what the drafter computes at serving time after drafting j - 1 tokens
(a dense causal pass over the committed rows and the draft so far), its mask against a brute
force definition, the loss falls when overfitting, and a trained drafter saves, loads and
serves the target's greedy tokens."""
from __future__ import annotations

import pytest
import torch
from test_spec_train import synthetic_data

from minillm import load_model
from minillm.spec_decode import weights
from minillm.spec_decode.drafters import MaskedAttention, build_drafter, eagle3_layers
from minillm.spec_decode.training import batches as TB
from minillm.spec_decode.training import checkpoints as C
from minillm.spec_decode.training import eagle3 as E
from minillm.spec_decode.training import train as T


@pytest.fixture(scope="module")
def target():
    return load_model("tiny", random_weights=True, dtype=torch.float32, device="cpu")[0]


@pytest.fixture(scope="module")
def data(target):
    out = synthetic_data(target)
    del out["features"]                     # the corpus holds token ids only
    return out


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(0)
    module = build_drafter(T.drafter_config("eagle3", target, 64), target)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 2 and p is not target.embed.weight:
                p.normal_(0, 0.1)
    return module.eval()


def test_the_layers_are_low_middle_and_high():
    assert eagle3_layers(30) == (2, 15, 27)
    assert eagle3_layers(2) == (0, 1)


def test_ttt_mask_against_its_definition():
    t = 6
    for step in (1, 2, 4):
        mask = E.ttt_mask(step, t)
        for q in range(t):
            for i in range(1, step + 1):
                for s in range(t):
                    want = s <= q - (step - 1) if i == 1 else s == q - (step - i)
                    assert bool(mask[q, (i - 1) * t + s]) == want, (step, q, i, s)


def test_step_j_rows_are_the_serving_time_draft(target, drafter, data):
    batch = E.sample_whole(data, torch.arange(3), torch.Generator().manual_seed(1), 2)
    with torch.no_grad():
        outs = E.ttt_outputs(drafter, target, batch, steps=4)
        states = E.target_states(target, batch.tokens, drafter.cfg.target_layers)
        tokens = target.embed(T.ahead(batch.tokens, 1))
        g = drafter.fuse(states)
        for c in (3, 7):                                  # the committed context ends at c
            feats = list(g[:, :c + 1].unbind(1))          # committed rows read the target's
            for j in range(1, 5):
                n = len(feats)                            # rows 0..c, then the draft so far
                causal = torch.ones(n, n, dtype=torch.bool).tril()[None].expand(2, n, n)
                f = drafter(tokens[:, :n], torch.stack(feats, 1), batch.positions[:, :n],
                            MaskedAttention(causal))
                torch.testing.assert_close(f[:, -1], outs[j - 1][:, c + j - 1], rtol=1e-4,
                                           atol=1e-4)
                feats.append(f[:, -1])                    # the next row reads this output


def test_loss_falls_when_overfitting_one_batch(target, data):
    torch.manual_seed(0)
    module = build_drafter(T.drafter_config("eagle3", target, 64), target).train()
    ids = TB.draft_vocabulary(data, 64)
    head = T.DraftHead(target.lm_head.weight, ids)
    lookup = T.vocab_lookup(ids, target.cfg.vocab_size)
    opt = T.make_optimizer(module, target)
    for g in opt.param_groups:
        g["lr"] = 3e-3
    batch = E.sample_whole(data, torch.arange(10), torch.Generator().manual_seed(0), 4)
    losses = [T.train_step("eagle3", module, head, target, batch, lookup, opt, E.eagle3_loss)
              for _ in range(30)]
    assert losses[-1] < 0.8 * losses[0], losses[::5]
    assert not any(p.grad is not None for p in target.parameters())


def test_run_writes_a_drafter_that_loads(target, data, tmp_path, monkeypatch):
    monkeypatch.setattr(T, "DRAFT_VOCAB", 64)
    monkeypatch.setattr(T, "checkpoint_path", lambda m: tmp_path / f"{m}.ckpt")
    pt = E.run(target, data, steps=3, out=tmp_path / "eagle3.pt")
    module, head, man = weights.load_drafter("eagle3", target, pt)
    assert man["steps"] == 3 and len(man["heldout_accuracy"]) == 5
    assert module.cfg.target_layers == eagle3_layers(target.cfg.n_layers)
    assert len(head.ids) == 64


def test_a_warm_start_begins_from_the_file_and_keeps_its_vocabulary(target, data, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setattr(T, "DRAFT_VOCAB", 64)
    monkeypatch.setattr(T, "checkpoint_path", lambda m: tmp_path / f"{m}.ckpt")
    first = E.run(target, data, steps=3, out=tmp_path / "a" / "eagle3.pt")
    start, head, _ = weights.load_drafter("eagle3", target, first)
    fresh = build_drafter(T.drafter_config("eagle3", target, 64), target)
    ids = C.warm_start("eagle3", target, fresh, first)
    assert torch.equal(ids, head.ids.cpu())
    for name, p in T.own_parameters(start, target).items():
        assert torch.equal(p, T.own_parameters(fresh, target)[name]), name
    second = E.run(target, data, steps=2, fresh=True, out=tmp_path / "b" / "eagle3.pt",
                   warm_from=first)
    _, head2, man = weights.load_drafter("eagle3", target, second)
    assert man["steps"] == 2 and man["warm_start"]["steps"] == 3
    assert torch.equal(head2.ids, head.ids)
