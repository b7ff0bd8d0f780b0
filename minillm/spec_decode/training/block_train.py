"""Training the block drafter (DFlash) and DSpark's heads on the self-distillation data.

Data: the replies of :mod:`.distill`, run once more through the (bf16) target to keep its
residual stream after the layers ``target_layers`` (``train.CONFIGS``) at every position,
joined [N, m * D], and the target's own greedy next token after each position
(``target_next`` [N]): what verification would accept there. Cached next to the distillation
shards (:func:`block_features`).

Stage 1, ``dflash`` (Chen et al. 2026, block denoising): each training window (as in
:mod:`.train`) gets ``ANCHORS`` random anchor positions a in its reply; a block [x_a, MASK, ...,
MASK] at positions a .. a + S - 1 sees the context rows t < a and itself, and row j predicts
x_{a+j}; all blocks of a window run in one pass with a block-diagonal mask. Loss: CE over the
draft vocabulary, position j weighted exp(-(j - 1) / ``GAMMA``) (later positions matter less:
they count only if every earlier one was accepted).

Stage 2, ``dspark`` (DSpark, 2026), the backbone frozen: the Markov head is trained with the same
CE, the previous token given (teacher forcing: the true x_{a+j-1}); the confidence head with
BCE against "the drafted token equals the target's greedy token there", the drafted token being
the argmax of base + Markov logits. DSpark trains the three together and regresses 1 - TV
(the acceptance rate of sampling); we keep DFlash's backbone as it is, so that dflash, ddtree
and dspark share one drafter, and use the greedy event, the one our benchmark verifies.

    python -m minillm.spec_decode.training.train dflash [--steps N] [--fresh]

Shapes: B windows, T positions, A anchors, S the block size, D the width, Vd the draft
vocabulary.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..drafters import BlockDrafter, DraftHead
from . import distill
from .batches import BATCH, WINDOW, Batch, LiveFeatures, make_batch, sample_batch, split
from .checkpoints import State, checkpoint_path, save_checkpoint
from .train import CLIP, Trained, lr_at

ANCHORS = 12
GAMMA = 3.0
MARKOV_RANK = 32
DSPARK_STEPS = 150
DSPARK_LR = 3e-3


# ---------------------------------------------------------------------------------------- data

@torch.inference_mode()
def block_features(data: dict, model, layers: tuple[int, ...], batch: int = 16,
                   out: Path | None = None) -> dict:
    """{"features": [N, m * D] bf16, "target_next": [N] int64} for ``data``'s sequences: the
    residual stream after each of ``layers`` (-1: the final normed state) and the target's
    argmax after each position, from right-padded batches (made once, cached in the
    distillation folder)."""
    check = int(data["tokens"].long().sum()) % 1_000_003
    name = "block-" + "-".join(map(str, layers)) + f"-{len(data['tokens'])}-{check}.pt"
    path = Path(out or distill.default_data_dir()) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return torch.load(path)
    offsets = data["offsets"].tolist()
    spans = sorted(range(len(offsets) - 1), key=lambda s: offsets[s + 1] - offsets[s])
    d = model.cfg.d_model
    feats = torch.zeros(len(data["tokens"]), len(layers) * d, dtype=torch.bfloat16)
    nxt = torch.zeros(len(data["tokens"]), dtype=torch.long)
    for i in tqdm(range(0, len(spans), batch), desc="block features"):
        idx = spans[i:i + batch]
        width = max(offsets[s + 1] - offsets[s] for s in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        for row, s in enumerate(idx):
            ids[row, :offsets[s + 1] - offsets[s]] = data["tokens"][offsets[s]:offsets[s + 1]]
        h, kept = model.forward_layers(ids.to(model.device), keep=[i for i in layers if i >= 0])
        kept[-1] = h                                  # -1: the final normed state
        joined = torch.cat([kept[layer] for layer in layers], -1)
        greedy = model.lm_head(h).argmax(-1)
        for row, s in enumerate(idx):
            n = offsets[s + 1] - offsets[s]
            feats[offsets[s]:offsets[s + 1]] = joined[row, :n].to(torch.bfloat16).cpu()
            nxt[offsets[s]:offsets[s + 1]] = greedy[row, :n].cpu()
    blob = {"features": feats, "target_next": nxt}
    torch.save(blob, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    return blob


def with_block_features(data: dict, model, layers: tuple[int, ...]) -> dict:
    """``data`` whose "features" are the joined layer states (and with "target_next")."""
    return {**data, **block_features(data, model, layers)}


# ------------------------------------------------------------------------------------- batches

def sample_anchors(batch: Batch, num: int, block: int, gen: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [B, A] window indices, keep [B, A] bool): up to ``num`` distinct random a per
    window with x_{a+1} a reply token inside the window (padding anchors: 0, keep False)."""
    b, t = batch.tokens.shape
    idx = torch.arange(t)
    valid = (batch.positions.cpu() + 1 >= batch.prompt_lens.cpu()[:, None]) & \
        (idx + 1 < batch.lengths.cpu()[:, None])
    score = torch.rand(b, t, generator=gen).masked_fill(~valid, 2.0)
    order = score.argsort(1)[:, :num]
    keep = torch.gather(valid, 1, order)
    return torch.where(keep, order, 0), keep


def block_inputs(drafter: BlockDrafter, embed: nn.Embedding, batch: Batch,
                 anchors: torch.Tensor, keep: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [B, T + A*S, D], is_context [T + A*S], positions [B, T + A*S], mask [B, R, R]) for a
    dense pass: the window's context rows, then every anchor's block."""
    b, t = batch.tokens.shape
    s = drafter.cfg.block_size
    dev = batch.tokens.device
    anchors, keep = anchors.to(dev), keep.to(dev)
    a = anchors.shape[1]
    ctx = drafter.context(batch.features)
    first = embed(torch.gather(batch.tokens, 1, anchors))                    # [B, A, D]
    rows = drafter.mask_embedding.to(ctx.dtype).expand(b, a, s, -1).clone()
    rows[:, :, 0] = first
    x = torch.cat([ctx, rows.view(b, a * s, -1)], 1)
    offs = torch.arange(s, device=dev)
    pos_block = torch.gather(batch.positions, 1, anchors)[..., None] + offs  # [B, A, S]
    positions = torch.cat([batch.positions, pos_block.view(b, -1)], 1)
    is_context = torch.arange(t + a * s, device=dev) < t
    r = t + a * s
    mask = torch.zeros(b, r, r, dtype=torch.bool, device=dev)
    mask[:, torch.arange(t), torch.arange(t)] = True
    sees_ctx = torch.arange(t, device=dev)[None, None] < anchors[..., None]  # [B, A, T]
    sees_ctx = sees_ctx & keep[..., None]
    mask[:, t:, :t] = sees_ctx.repeat_interleave(s, 1)
    blocks = torch.arange(a * s, device=dev) // s
    mask[:, t:, t:] = (blocks[:, None] == blocks[None, :])
    return x, is_context, positions, mask


def block_labels(batch: Batch, anchors: torch.Tensor, keep: torch.Tensor, block: int,
                 lookup: torch.Tensor, key: str = "tokens") -> tuple[torch.Tensor, torch.Tensor]:
    """(labels [B, A, S] draft-vocabulary index of x_{a+j} (or, ``key`` "target_next", of the
    target's greedy token there; OOV outside, -100 past the window or for j = 0), valid)."""
    dev = batch.tokens.device
    j = torch.arange(block, device=dev)
    at = anchors.to(dev)[..., None] + j                                       # [B, A, S]
    valid = (at < batch.lengths[:, None, None]) & keep.to(dev)[..., None] & (j > 0)
    src = batch.tokens if key == "tokens" else batch.target_next
    shift = 0 if key == "tokens" else 1       # target_next[t] is the target's token at t + 1
    idx = (at - shift).clamp(0, batch.tokens.shape[1] - 1)
    tok = torch.gather(src, 1, idx.view(len(at), -1)).view(at.shape)
    return torch.where(valid, lookup[tok], -100), valid


def position_weights(block: int, device: torch.device, gamma: float = GAMMA) -> torch.Tensor:
    """[S]: 0 at j = 0, exp(-(j - 1) / gamma) after."""
    j = torch.arange(block, device=device, dtype=torch.float32)
    return torch.where(j > 0, torch.exp(-(j - 1) / gamma), 0.0)


def run_blocks(drafter: BlockDrafter, embed, batch: Batch, anchors, keep) -> torch.Tensor:
    """The block rows' outputs [B, A, S, D]."""
    x, is_ctx, pos, mask = block_inputs(drafter, embed, batch, anchors, keep)
    out = drafter(x, is_ctx, pos, mask=mask)[:, batch.tokens.shape[1]:]
    return out.view(*anchors.shape, drafter.cfg.block_size, -1)


def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
    sel = labels >= 0
    w = weights.expand_as(labels)[sel]
    loss = F.cross_entropy(logits[sel].float(), labels[sel], reduction="none")
    return (loss * w).sum() / w.sum().clamp_min(1e-6)


def prev_index(batch: Batch, anchors, lookup: torch.Tensor, block: int, vd: int
               ) -> torch.Tensor:
    """[B, A, S]: the draft index of the true token before each block row (x_{a+j-1}), Vd for
    a token outside the draft vocabulary."""
    dev = batch.tokens.device
    at = (anchors.to(dev)[..., None] + torch.arange(block, device=dev) - 1).clamp_min(0)
    at = at.clamp_max(batch.tokens.shape[1] - 1)
    tok = torch.gather(batch.tokens, 1, at.view(len(at), -1)).view(at.shape)
    idx = lookup[tok]
    return torch.where(idx >= 0, idx, vd)


# -------------------------------------------------------------------------------------- losses

def dflash_loss(drafter, head, target, batch: Batch, lookup, gen=None) -> torch.Tensor:
    s = drafter.cfg.block_size
    anchors, keep = sample_anchors(batch, ANCHORS, s, gen)
    out = run_blocks(drafter, target.embed, batch, anchors, keep)
    labels, _ = block_labels(batch, anchors, keep, s, lookup)
    return weighted_ce(head(out), labels, position_weights(s, out.device))


def dspark_terms(drafter, head, target, batch: Batch, lookup, anchors, keep):
    """(Markov logits [B, A, S, Vd], confidence logits [B, A, S], accepted [B, A, S] bool,
    labels, valid) with the backbone run without gradients."""
    s, vd = drafter.cfg.block_size, drafter.cfg.draft_vocab
    with torch.no_grad():
        out = run_blocks(drafter, target.embed, batch, anchors, keep)
        base = head(out).float()
    prev = prev_index(batch, anchors, lookup, s, vd)
    logits = base + drafter.markov(out, prev).float()
    labels, valid = block_labels(batch, anchors, keep, s, lookup)
    greedy, _ = block_labels(batch, anchors, keep, s, lookup, key="target_next")
    logp = logits.detach().log_softmax(-1)
    drafted = logp.argmax(-1)
    accepted = drafted == greedy
    conf = drafter.confidence(out, prev, logp.gather(-1, drafted[..., None])[..., 0])
    return logits, conf.float(), accepted, labels, valid


def dspark_loss(drafter, head, target, batch: Batch, lookup, gen) -> torch.Tensor:
    s = drafter.cfg.block_size
    anchors, keep = sample_anchors(batch, ANCHORS, s, gen)
    logits, conf, accepted, labels, valid = dspark_terms(drafter, head, target, batch, lookup,
                                                         anchors, keep)
    w = position_weights(s, logits.device)
    bce = F.binary_cross_entropy_with_logits(conf[valid], accepted[valid].float(),
                                             weight=w.expand_as(conf)[valid])
    return weighted_ce(logits, labels, w) + bce


# ---------------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate_block(drafter, head: DraftHead, target, data: dict, seqs: torch.Tensor, lookup,
                   batch: int = BATCH, width: int = WINDOW, seed: int = 0,
                   live: LiveFeatures | None = None) -> dict:
    """Held-out greedy acceptance at random reply anchors: per drafted position j, P(the
    block's token j is the target's | all before it were), for DFlash's independent argmax
    (``dflash_acceptance``) and DSpark's Markov chain decoded as at serving time (the drafted
    token, not the true one, feeds the next position: ``dspark_acceptance``); the expected
    tokens per round of each (``*_tau``: 1 + sum_j prod_i<=j acc_i); and the confidence head's
    calibration (mean predicted vs observed acceptance per position, ECE over 10 bins).
    ``live``: features computed per batch, windows from each sequence's first token."""
    gen = torch.Generator().manual_seed(seed)
    s, vd = drafter.cfg.block_size, drafter.cfg.draft_vocab
    lengths = data["offsets"].diff()
    stats = {"dflash": [], "dspark": [], "conf": [], "hit": []}
    for i in range(0, len(seqs), batch):
        spans = [(q, 0 if live else max(0, int(lengths[q]) - width))
                 for q in seqs[i:i + batch].tolist()]
        b = make_batch(data, spans, width)
        b = (live(b) if live else b).to(target.device, target.dtype)
        anchors, keep = sample_anchors(b, ANCHORS, s, gen)
        out = run_blocks(drafter, target.embed, b, anchors, keep)
        greedy, valid = block_labels(b, anchors, keep, s, lookup, key="target_next")
        base = head(out).float()
        stats["dflash"].append(prefix_hits(base.argmax(-1) == greedy, valid))
        if drafter.cfg.markov_rank:
            first = prev_index(b, anchors, lookup, s, vd)[..., 1]      # the anchor token
            drafted, conf = markov_decode(drafter, out, base, first, vd)
            hits = drafted == greedy
            stats["dspark"].append(prefix_hits(hits, valid))
            reached = valid & prefix_alive(hits)
            stats["conf"].append(conf[reached].float().cpu())
            stats["hit"].append(hits[reached].float().cpu())
    out = {"dflash": acceptance(stats["dflash"])}
    if stats["dspark"]:
        out["dspark"] = acceptance(stats["dspark"])
        out["calibration"] = calibration(torch.cat(stats["conf"]), torch.cat(stats["hit"]))
    return out


def markov_decode(drafter, h: torch.Tensor, base: torch.Tensor, first_prev: torch.Tensor,
                  vd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding along the block with the Markov head: h [..., S, D], base [..., S, Vd],
    first_prev [...] (the anchor token's draft index) -> (drafted draft indices [..., S],
    confidences [..., S] in (0, 1)); position 0 is the anchor (drafted -1, confidence 1)."""
    s = h.shape[-2]
    drafted = torch.full(h.shape[:-1], -1, dtype=torch.long, device=h.device)
    conf = torch.ones(h.shape[:-1], device=h.device)
    prev = first_prev
    for j in range(1, s):
        logits = base[..., j, :] + drafter.markov(h[..., j, :], prev).float()
        logp = logits.log_softmax(-1)
        tok = logp.argmax(-1)
        drafted[..., j] = tok
        conf[..., j] = torch.sigmoid(drafter.confidence(
            h[..., j, :], prev, logp.gather(-1, tok[..., None])[..., 0]).float())
        prev = tok
    return drafted, conf


def prefix_alive(hits: torch.Tensor) -> torch.Tensor:
    """[..., S]: True where every drafted position before j (from 1) was accepted."""
    h = hits.clone()
    h[..., 0] = True
    alive = torch.ones_like(h)
    alive[..., 1:] = h[..., :-1].long().cumprod(-1).bool()
    return alive


def prefix_hits(hits: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted counts [S], tried counts [S]) for a chain: position j is tried when every
    earlier one was accepted."""
    tried = valid & prefix_alive(hits)
    return (tried & hits).sum(dim=tuple(range(hits.dim() - 1))).cpu(), \
        tried.sum(dim=tuple(range(hits.dim() - 1))).cpu()


def acceptance(parts: list) -> dict:
    acc = sum(p[0] for p in parts).double()
    tried = sum(p[1] for p in parts).double()
    rate = (acc / tried.clamp_min(1))[1:]
    tau = 1 + float(rate.cumprod(0).sum())
    return {"acceptance": [round(float(x), 4) for x in rate], "tau": round(tau, 3)}


def calibration(conf: torch.Tensor, hit: torch.Tensor, bins: int = 10) -> dict:
    """Reliability bins (mean confidence, observed rate, count) and the ECE."""
    which = (conf * bins).long().clamp(0, bins - 1)
    rows, ece = [], 0.0
    for k in range(bins):
        sel = which == k
        n = int(sel.sum())
        if n:
            c, h = float(conf[sel].mean()), float(hit[sel].mean())
            rows.append([round(c, 4), round(h, 4), n])
            ece += n * abs(c - h)
    return {"bins": rows, "ece": round(ece / max(1, len(conf)), 4)}


# ------------------------------------------------------------------------------------ training

def train_dspark_heads(trained: Trained, target, data: dict, steps: int, ckpt: Path,
                       progress: bool = True, sample=sample_batch) -> None:
    """Stage 2: freeze the backbone, train the Markov and confidence heads (``sample``: how
    a batch is drawn, as :func:`.train.train` takes it)."""
    drafter = trained.drafter.train()
    heads = [drafter.prev_codes.weight, drafter.next_codes, drafter.mix.weight,
             *drafter.confidence_proj.parameters()]
    keep = {id(p) for p in heads}
    for p in drafter.parameters():
        p.requires_grad_(id(p) in keep)
    with torch.no_grad():
        nn.init.normal_(drafter.next_codes, std=0.02)
    opt = torch.optim.AdamW(heads, lr=DSPARK_LR, weight_decay=0.0)
    st = State(0, [], 0.0, trained.state.draft_ids, torch.Generator().manual_seed(1))
    seqs, _ = split(data)
    for step in tqdm(range(steps), desc="dspark heads", disable=not progress):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, DSPARK_LR, warmup=10)
        b = sample(data, seqs, st.gen, BATCH, WINDOW).to(target.device, target.dtype)
        loss = dspark_loss(drafter, trained.head, target, b, trained.lookup, st.gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(heads, CLIP)
        opt.step()
        st.losses.append(loss.item())
        st.step += 1
        st.seconds += time.perf_counter() - t0
    save_checkpoint(ckpt, drafter, target, opt, st)
    trained.state.seconds += st.seconds
    drafter.eval()


def run_block(target, data: dict, steps: int | None = None, fresh: bool = False,
              out: Path | None = None, dspark_steps: int = DSPARK_STEPS,
              progress: bool = True, served=None, warm_from: Path | None = None,
              **train_kw) -> Path:
    """Both stages, the held-out measurements, the weights file (``dflash``: the backbone and
    DSpark's heads, shared by dflash, ddtree and dspark) and its manifest. ``served``: the
    target in its serving dtype computing each batch's features as it is drawn (data of token
    ids only, the corpus); else they are computed once for the whole set and cached.
    ``warm_from``: a drafter file the backbone starts from (continued training, the manifest's
    ``warm_start`` names that run; DSpark's heads are trained again on the new backbone)."""
    import copy

    from .. import weights
    from .train import CONFIGS, DEFAULT_STEPS, run_facts, train, warm_origin
    before = warm_origin("dflash", warm_from) if warm_from else None
    layers = CONFIGS["dflash"]["target_layers"]
    live = LiveFeatures(served, layers, next_tokens=True) if served is not None else None
    if live is None:
        fast = copy.deepcopy(target).to(torch.bfloat16)
        bdata = with_block_features(data, fast, layers)
        del fast
    else:
        bdata = data
    sample = live.sampler() if live else sample_batch
    trained = train("dflash", target, bdata, steps or DEFAULT_STEPS["dflash"], fresh=fresh,
                    loss_fn=dflash_loss, progress=progress, sample=sample, warm_from=warm_from,
                    **train_kw)
    train_dspark_heads(trained, target, bdata, dspark_steps, checkpoint_path("dspark"),
                       progress=progress, sample=sample)
    scores = evaluate_block(trained.drafter, trained.head, target, bdata, split(bdata)[1],
                            trained.lookup, live=live)
    st = trained.state
    manifest = run_facts("minillm/spec_decode/training/block_train.py", data, st, target.device)
    manifest |= {"dspark_steps": dspark_steps,
                 "heldout_accuracy": scores["dflash"]["acceptance"], "heldout": scores}
    manifest |= {"warm_start": before} if before else {}
    path = weights.save_drafter(trained.drafter, target, trained.cfg, st.draft_ids, manifest,
                                path=out)
    print(f"dflash: held-out tau {scores['dflash']['tau']} (dspark "
          f"{scores.get('dspark', {}).get('tau')}) -> {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return path


