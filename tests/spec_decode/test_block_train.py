"""Training the block drafter (minillm.spec_decode.training.block_train) on the tiny random target:
the block denoising loss falls when overfitting one batch, DSpark's stage moves only its heads, the
anchors sit in replies, and a run writes a drafter that loads and serves."""
from __future__ import annotations

import pytest
import torch
from test_spec_train import synthetic_data

from minillm import load_model
from minillm.spec_decode import weights
from minillm.spec_decode.training import batches as TB
from minillm.spec_decode.training import block_train as BT
from minillm.spec_decode.training import train as T

CONFIG = dict(layers=1, ffn_dim=64, target_layers=(0, 1), block_size=4, markov_rank=8)


@pytest.fixture(scope="module")
def target():
    return load_model("tiny", random_weights=True, dtype=torch.float32, device="cpu")[0]


@pytest.fixture(scope="module")
def raw(target):
    return synthetic_data(target)


@pytest.fixture(scope="module")
def data(target, raw, tmp_path_factory):
    return {**raw, **BT.block_features(raw, target, (0, 1), out=tmp_path_factory.mktemp("f"))}


@pytest.fixture()
def small(monkeypatch):
    monkeypatch.setitem(T.CONFIGS, "dflash", CONFIG)


def batch_of(data, target, seed=0):
    b = TB.sample_batch(data, TB.split(data)[0], torch.Generator().manual_seed(seed), 4, 24)
    return b.to(target.device, target.dtype)


def setup(target, data):
    torch.manual_seed(0)
    cfg = T.drafter_config("dflash", target, draft_vocab=64)
    drafter = T.build_drafter(cfg, target).train()
    ids = TB.draft_vocabulary(data, 64)
    return drafter, T.DraftHead(target.lm_head.weight, ids), T.vocab_lookup(ids, 49152)


def test_features_are_the_layers_and_the_greedy_token(target, data):
    s = slice(int(data["offsets"][3]), int(data["offsets"][4]))
    ids = data["tokens"][s].long()[None]
    with torch.no_grad():
        h, kept = target.forward_layers(ids, keep=(0, 1))
    want = torch.cat([kept[0], kept[1]], -1)[0].to(torch.bfloat16)
    torch.testing.assert_close(data["features"][s], want, atol=2e-2, rtol=2e-2)
    assert torch.equal(data["target_next"][s], target.lm_head(h).argmax(-1)[0])


def test_anchors_sit_in_replies(target, data, small):
    b = batch_of(data, target)
    anchors, keep = BT.sample_anchors(b, 5, 4, torch.Generator().manual_seed(1))
    pos = torch.gather(b.positions, 1, anchors)
    assert keep.any()
    assert (pos[keep] + 1 >= b.prompt_lens[:, None].expand_as(pos)[keep]).all()
    assert (anchors[keep] + 1 < b.lengths[:, None].expand_as(anchors)[keep]).all()


def test_block_loss_falls_when_overfitting(target, data, small):
    drafter, head, lookup = setup(target, data)
    b = batch_of(data, target)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(30):
        loss = BT.dflash_loss(drafter, head, target, b, lookup, torch.Generator().manual_seed(0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    assert not any(p.grad is not None for p in target.parameters())


def test_dspark_stage_trains_only_its_heads(target, data, small, tmp_path):
    drafter, head, lookup = setup(target, data)
    st = T.State(0, [], 0.0, head.ids, torch.Generator().manual_seed(0))
    trained = T.Trained(drafter, head, drafter.cfg, st, lookup)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    BT.train_dspark_heads(trained, target, data, 4, tmp_path / "d.ckpt", progress=False)
    changed = {k for k, v in drafter.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and changed <= {"prev_codes.weight", "next_codes", "mix.weight",
                                   "confidence_proj.weight", "confidence_proj.bias"}


def test_run_writes_a_loadable_block_drafter(target, raw, small, tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    monkeypatch.setattr(T, "checkpoint_path", lambda m: tmp_path / f"{m}.ckpt")
    monkeypatch.setattr(BT, "checkpoint_path", lambda m: tmp_path / f"{m}.ckpt")
    pt = BT.run_block(target, raw, steps=3, out=tmp_path / "dflash.pt", dspark_steps=2,
                      progress=False, draft_vocab=64, batch=4, width=24)
    drafter, head, man = weights.load_drafter("dflash", target, pt)
    assert man["steps"] == 3 and man["dspark_steps"] == 2
    held = man["heldout"]
    assert len(held["dflash"]["acceptance"]) == 3 and held["dflash"]["tau"] >= 1
    assert 0 <= held["calibration"]["ece"] <= 1
    assert drafter.cfg.markov_rank == 8 and len(head.ids) == 64


def test_layer_minus_one_is_the_final_normed_state(target, raw, tmp_path):
    feats = BT.block_features(raw, target, (0, -1), out=tmp_path)["features"]
    s = slice(int(raw["offsets"][1]), int(raw["offsets"][2]))
    with torch.no_grad():
        h = target.hidden_states(raw["tokens"][s].long()[None])[0]
    torch.testing.assert_close(feats[s, target.cfg.d_model:], h.to(torch.bfloat16),
                               atol=2e-2, rtol=2e-2)


def test_run_block_on_token_ids_with_live_features(target, raw, small, tmp_path, monkeypatch):
    """The corpus path: no feature file is written, each batch's layer states and the
    target's argmax are computed as it is drawn."""
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    monkeypatch.setattr(T, "checkpoint_path", lambda m: tmp_path / f"{m}.ckpt")
    monkeypatch.setattr(BT, "checkpoint_path", lambda m: tmp_path / f"{m}.ckpt")
    pt = BT.run_block(target, raw, steps=2, out=tmp_path / "dflash.pt", dspark_steps=2,
                      progress=False, draft_vocab=64, batch=4, width=24, served=target)
    _, _, man = weights.load_drafter("dflash", target, pt)
    assert man["steps"] == 2 and man["heldout"]["dflash"]["tau"] >= 1
    assert not list(tmp_path.rglob("block-*.pt"))


def test_held_out_evaluation_with_live_features_takes_several_batches(target, raw, small):
    """The corpus path's evaluation over more held-out sequences than one batch holds (a local
    once shadowed the live features after the first batch)."""
    drafter, head, lookup = setup(target, raw)
    seqs = TB.split(raw)[1]
    assert len(seqs) >= 2
    live = TB.LiveFeatures(target, CONFIG["target_layers"], next_tokens=True)
    scores = BT.evaluate_block(drafter.eval(), head, target, raw, seqs, lookup, batch=1,
                               width=24, live=live)
    assert scores["dflash"]["tau"] >= 1 and scores["dspark"]["tau"] >= 1
    assert 0 <= scores["calibration"]["ece"] <= 1


def test_a_warm_block_run_starts_from_the_file(target, raw, small, tmp_path, monkeypatch):
    """--warm for the block drafter: the backbone starts from the file's weights and keeps its
    draft vocabulary, and the manifest names the run it continues."""
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    monkeypatch.setattr(T, "checkpoint_path", lambda m: tmp_path / f"{m}.ckpt")
    monkeypatch.setattr(BT, "checkpoint_path", lambda m: tmp_path / f"{m}.ckpt")
    kw = dict(dspark_steps=2, progress=False, draft_vocab=64, batch=4, width=24)
    first = BT.run_block(target, raw, steps=3, out=tmp_path / "a" / "dflash.pt", **kw)
    seen = {}
    real = T.train_loop

    def spy(method, drafter, *args, **kwargs):
        seen.update({k: v.clone() for k, v in T.own_parameters(drafter, target).items()})
        return real(method, drafter, *args, **kwargs)

    monkeypatch.setattr(T, "train_loop", spy)
    second = BT.run_block(target, raw, steps=2, fresh=True, out=tmp_path / "b" / "dflash.pt",
                          warm_from=first, **kw)
    start, head, _ = weights.load_drafter("dflash", target, first)
    for name, p in T.own_parameters(start, target).items():
        assert torch.equal(seen[name], p), name
    _, head2, man = weights.load_drafter("dflash", target, second)
    assert man["steps"] == 2 and man["warm_start"]["steps"] == 3
    assert torch.equal(head2.ids, head.ids)
