"""Training the four drafters of chapter 06 on the target's own replies (self-distillation).

The data (:mod:`.distill`) is what the frozen target SmolLM2-135M says to the training prompts,
with its final normed hidden state h_t at every position. A drafter that learns to predict
*these* tokens learns the target's habits, which is what speculative decoding rewards: a drafted
token counts only when the target would have produced it (Medusa and EAGLE both train on the
target's regenerated replies for this reason). The target never trains; its embedding and the
rows of its output head are borrowed (:class:`~.drafters.DraftHead`: logits over the ``Vd``
most frequent reply tokens, :func:`draft_vocabulary`; labels outside it are ignored by the loss
and count as misses in the held-out accuracy).

The losses, with x the tokens, h the target's states, f a drafter's output, CE over the draft
vocabulary (reply labels weigh 1, prompt labels ``PROMPT_WEIGHT``):

- ``eagle`` (EAGLE-1, Li et al. 2024): f_t = D(embed(x_{t+1}), h_t); loss CE(head(f_t), x_{t+2})
  + 0.1 smooth_l1(f_t, h_{t+1}); plus, since at serving time the drafter reads its own outputs
  after the first token, a second pass f2_t = D(embed(x_{t+2}), f_t) (f detached, positions
  one on) with loss 0.5 CE(head(f2_t), x_{t+3}).
- ``mtp`` (DeepSeek-V3, 2024): the same block with RMSNorm on both inputs; CE at depth 1 plus CE
  at depth 2, where depth 2 reads depth 1's output as its features (chained, gradients kept).
- ``medusa`` (Medusa-1, Cai et al. 2024): K residual heads on h_t, head i predicting x_{t+2+i};
  loss sum_i 0.8^i CE_i. The held-out top-8 accuracy of every head goes into the manifest
  (``head_accuracy``): Medusa's sparse tree is built from it.
- ``draft_model``: a 2-layer Llama on the target's embedding; CE of the next token (reply labels
  1, prompt labels 0.3).

Batches (:mod:`.batches`): ``BATCH`` windows of at most ``WINDOW`` positions (a random training
sequence; the window always covers the reply, its start in the prompt is random), real positions
for RoPE. AdamW, cosine decay after a linear warm-up, gradient clipping. A checkpoint (drafter,
optimizer, step, rng) goes to ``<cache>/spec-train/<method>.ckpt`` every ``CKPT_EVERY`` steps
and a rerun continues from it. The last shard's sequences are held out for the accuracies in the
manifest.

    python -m minillm.spec_decode.training.train [eagle|mtp|medusa|draft_model|dflash|all] \
        [--steps N] [--fresh] [--corpus] [--warm] [--device cuda]
    python -m minillm.spec_decode.training.train --data-only

``--corpus`` trains on the corpus of :func:`.distill.make_corpus_dataset` (token ids only):
batches are windows from each sequence's first token and their features are computed by the
target in its serving dtype as they are drawn (:class:`.batches.LiveFeatures`). ``--warm``
starts from the shipped weights (and their draft vocabulary) instead of a random drafter, for
continued training on more data, at a lower peak rate (``WARM_LR``); the manifest's
``warm_start`` names the run they came from. Resume an interrupted run with the same flags.

Shapes: B windows, T positions, D the target's width, V its vocabulary, Vd the draft one.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ...model.transformer import Transformer
from ...runinfo import device_name, git_commit
from .. import weights
from ..drafters import (
    DrafterConfig,
    DraftHead,
    build_drafter,
    eagle3_layers,
    own_parameters,
    vocab_lookup,
)
from . import distill
from .batches import (
    BATCH,
    WINDOW,
    Batch,
    LiveFeatures,
    draft_vocabulary,
    load_data,
    make_batch,
    sample_batch,
    split,
)
from .checkpoints import State, checkpoint_path, load_checkpoint, save_checkpoint, warm_start

CONFIGS = {"eagle": dict(layers=1, ffn_dim=1536), "mtp": dict(layers=1, ffn_dim=1536),
           "eagle3": dict(layers=1, ffn_dim=1536),
           "medusa": dict(num_heads=5), "draft_model": dict(layers=2, ffn_dim=1536),
           "dflash": dict(layers=2, ffn_dim=1024, target_layers=(1, 10, 19, -1), block_size=8,
                          markov_rank=32)}
# ~10 minutes each on 2 CPU cores: 1 thread measured 1.87 (eagle), 1.95 (mtp), 1.48 (medusa)
# and 1.36 (draft_model) s/step; 2 threads are about 1.6-1.9x faster
DEFAULT_STEPS = {"eagle": 500, "mtp": 480, "medusa": 400, "draft_model": 450, "dflash": 1000}
DRAFT_VOCAB = 8192
LR, WARMUP, CLIP, WEIGHT_DECAY = 1e-3, 50, 1.0, 0.0
WARM_LR = 3e-4               # peak learning rate when training continues from a trained drafter
CKPT_EVERY = 100
PROMPT_WEIGHT = 0.3          # CE weight of labels inside the prompt (replies weigh 1)
EAGLE_REG, EAGLE_SECOND = 0.1, 0.5
MEDUSA_DECAY = 0.8
EVAL_DEPTH = 5               # drafted positions measured for eagle and mtp
TOPK = 8                     # ranks measured for Medusa's heads
IGNORE = -100                # no label here (OOV, from drafters: outside the draft vocabulary)


# -------------------------------------------------------------------------------------- losses

def ahead(x: torch.Tensor, k: int, fill: float = 0) -> torch.Tensor:
    """x [B, T, ...] shifted left by k along T (x[:, t + k] at t), ``fill`` past the end."""
    out = torch.full_like(x, fill)
    if k < x.shape[1]:
        out[:, :x.shape[1] - k] = x[:, k:]
    return out


def labels_at(batch: Batch, lookup: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels [B, T]: the draft index of x_{t+k}, OOV outside the vocabulary, IGNORE past the
    window; reply [B, T] bool: x_{t+k} is a reply token)."""
    t = torch.arange(batch.tokens.shape[1], device=batch.tokens.device)
    valid = t + k < batch.lengths[:, None]
    labels = torch.where(valid, lookup[ahead(batch.tokens, k)], IGNORE)
    return labels, valid & (batch.positions + k >= batch.prompt_lens[:, None])


def ce(head: DraftHead, x: torch.Tensor, labels: torch.Tensor, reply: torch.Tensor
       ) -> torch.Tensor:
    """Weighted mean CE of head(x) [B, T, D] over in-vocabulary labels [B, T] (reply labels
    weigh 1, prompt labels PROMPT_WEIGHT); the head runs only where there is a label."""
    sel = labels >= 0
    w = torch.where(reply[sel], 1.0, PROMPT_WEIGHT)
    loss = F.cross_entropy(head(x[sel]), labels[sel], reduction="none")
    return (loss * w).sum() / w.sum().clamp_min(1e-6)


def feature_step(drafter: nn.Module, target: Transformer, batch: Batch, features: torch.Tensor,
                 k: int) -> torch.Tensor:
    """Depth k of a feature drafter: D(embed(x_{t+k}), features [B, T, D]) at positions + k - 1
    -> f [B, T, D], a guess of h_{t+k} (predicting x_{t+k+1})."""
    tokens = target.embed(ahead(batch.tokens, k))
    return drafter(tokens, features, batch.positions + k - 1)


def eagle_loss(drafter, head, target, batch: Batch, lookup) -> torch.Tensor:
    """CE(head(f), x_{t+2}) + 0.1 smooth_l1(f, h_{t+1}) + 0.5 CE(head(f2), x_{t+3})."""
    f = feature_step(drafter, target, batch, batch.features, 1)
    loss = ce(head, f, *labels_at(batch, lookup, 2))
    t = torch.arange(f.shape[1], device=f.device)
    has_next = t + 1 < batch.lengths[:, None]
    reg = F.smooth_l1_loss(f[has_next], ahead(batch.features, 1)[has_next])
    f2 = feature_step(drafter, target, batch, f.detach(), 2)
    return loss + EAGLE_REG * reg + EAGLE_SECOND * ce(head, f2, *labels_at(batch, lookup, 3))


def mtp_loss(drafter, head, target, batch: Batch, lookup) -> torch.Tensor:
    """CE at depth 1 plus CE at depth 2 (depth 2 reads depth 1's output, not detached)."""
    f = feature_step(drafter, target, batch, batch.features, 1)
    f2 = feature_step(drafter, target, batch, f, 2)
    return ce(head, f, *labels_at(batch, lookup, 2)) + ce(head, f2, *labels_at(batch, lookup, 3))


def medusa_loss(drafter, head, target, batch: Batch, lookup) -> torch.Tensor:
    """sum_i 0.8^i CE(head(head_i(h_t)), x_{t+2+i})."""
    states = drafter(batch.features)                         # [K, B, T, D]
    return sum(MEDUSA_DECAY ** i * ce(head, s, *labels_at(batch, lookup, 2 + i))
               for i, s in enumerate(states))


def draft_model_loss(drafter, head, target, batch: Batch, lookup) -> torch.Tensor:
    """Next-token CE of the small Llama (reply labels 1, prompt labels 0.3)."""
    h = drafter.hidden_states(batch.tokens, positions=batch.positions)
    return ce(head, h, *labels_at(batch, lookup, 1))


LOSSES = {"eagle": eagle_loss, "mtp": mtp_loss, "medusa": medusa_loss,
          "draft_model": draft_model_loss}


# ---------------------------------------------------------------------------------- evaluation

def eval_states(method: str, drafter, target, batch: Batch) -> list[tuple[torch.Tensor, int]]:
    """(states [B, T, D], k) per drafted position: head(states) at t predicts x_{t+k}. Feature
    drafters read their own outputs from depth 2 on (the true tokens, as after acceptances)."""
    if method == "medusa":
        return [(s, 2 + i) for i, s in enumerate(drafter(batch.features))]
    if method == "draft_model":
        return [(drafter.hidden_states(batch.tokens, positions=batch.positions), 1)]
    out, f = [], batch.features
    for k in range(1, EVAL_DEPTH + 1):
        f = feature_step(drafter, target, batch, f, k)
        out.append((f, k + 1))
    return out


@torch.no_grad()
def evaluate(method: str, drafter, head: DraftHead, target, data: dict, seqs: torch.Tensor,
             lookup: torch.Tensor, batch: int = BATCH, width: int = WINDOW,
             states_fn=None, whole: bool = False) -> dict:
    """Held-out accuracy at reply labels: ``heldout_accuracy`` [positions] (top-1) and
    ``topk_accuracy`` [positions][TOPK] (P(the rank-r candidate is the true token)).
    ``states_fn(drafter, target, batch)``: instead of :func:`eval_states`; ``whole``: windows
    from each sequence's first token (else its last ``width``)."""
    device, dtype = target.device, target.dtype
    hits, counts = 0, 0
    lengths = data["offsets"].diff()
    for i in range(0, len(seqs), batch):
        spans = [(s, 0 if whole else max(0, int(lengths[s]) - width))
                 for s in seqs[i:i + batch].tolist()]
        b = make_batch(data, spans, width).to(device, dtype)
        rows, n = [], []
        depths = states_fn(drafter, target, b) if states_fn is not None else \
            eval_states(method, drafter, target, b)
        for states, k in depths:
            labels, reply = labels_at(b, lookup.to(device), k)
            top = head(states[reply]).topk(TOPK, dim=-1).indices
            rows.append((top == labels[reply][:, None]).double().sum(0).cpu())
            n.append(float(reply.sum()))
        hits, counts = hits + torch.stack(rows), counts + torch.tensor(n, dtype=torch.double)
    acc = hits / counts.clamp_min(1.0)[:, None]
    return {"heldout_accuracy": [round(float(a), 4) for a in acc[:, 0]],
            "topk_accuracy": [[round(float(a), 4) for a in row] for row in acc]}


# ------------------------------------------------------------------------------------ training

def drafter_config(method: str, target: Transformer, draft_vocab: int | None = None
                   ) -> DrafterConfig:
    """The method's config at the target's width, heads and RoPE."""
    c, draft_vocab = target.cfg, draft_vocab or DRAFT_VOCAB
    extra = {"target_layers": eagle3_layers(c.n_layers)} if method == "eagle3" else {}
    return DrafterConfig(method=method, d_model=c.d_model, n_heads=c.n_heads,
                         n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                         norm_eps=c.norm_eps, draft_vocab=draft_vocab, **CONFIGS[method],
                         **extra)


def lr_at(step: int, steps: int, lr: float = LR, warmup: int = WARMUP) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def make_optimizer(drafter: nn.Module, target: Transformer) -> torch.optim.Optimizer:
    params = [p for p in own_parameters(drafter, target).values()
              if isinstance(p, nn.Parameter) and p.requires_grad]
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def train_step(method: str, drafter, head, target, batch: Batch, lookup: torch.Tensor,
               opt: torch.optim.Optimizer, loss_fn=None, amp: torch.dtype | None = None
               ) -> float:
    """One optimizer step on ``batch``; returns the loss. ``amp``: the dtype the forward's
    matmuls run in (autocast; weights, gradients and optimizer stay in theirs)."""
    with torch.autocast(target.device.type, dtype=amp or torch.float32, enabled=amp is not None):
        loss = (loss_fn or LOSSES[method])(drafter, head, target, batch, lookup)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], CLIP)
    opt.step()
    return loss.item()


def compute_dtype(target: Transformer) -> torch.dtype | None:
    """bfloat16 for the training forward where the target is float32 on a device that serves
    bfloat16 (measured on an AVX-512-BF16 CPU: an EAGLE-3 step's drafter part about 1.8x
    faster); None (float32 throughout) elsewhere."""
    from ...device import serving_dtype
    served, _ = serving_dtype(None, target.device)
    return served if target.dtype == torch.float32 and served == torch.bfloat16 else None


def peak_lr(warm_from: Path | None) -> float:
    """The schedule's peak: lower when training continues from a trained drafter (as in
    fine-tuning), so that its first steps do not pull it far from what it has learnt."""
    return WARM_LR if warm_from is not None else LR


def warm_origin(method: str, path: Path) -> dict:
    """What a warm start starts from: that run's data, steps, loss, commit, seconds (and its
    own warm start, if it had one), and the peak learning rate of the run that continues."""
    start = weights.read_manifest(method, path)
    return {k: start[k] for k in ("data", "steps", "final_loss", "commit", "seconds",
                                  "warm_start") if k in start} | {"peak_lr": WARM_LR}


@dataclass
class Trained:
    drafter: nn.Module
    head: DraftHead
    cfg: DrafterConfig
    state: State
    lookup: torch.Tensor


def train(method: str, target: Transformer, data: dict, steps: int, *, fresh: bool = False,
          ckpt: Path | None = None, draft_vocab: int | None = None, batch: int = BATCH,
          width: int = WINDOW, seed: int = 0, progress: bool = True, loss_fn=None,
          sample=None, warm_from: Path | None = None) -> Trained:
    """Train (or resume training) ``method``'s drafter for ``steps`` steps in all
    (``loss_fn``: instead of LOSSES[method]; ``sample``: instead of :func:`sample_batch`;
    ``warm_from``: a drafter file a new run starts from, see :func:`warm_start`; such a run
    keeps its checkpoint apart from a first run's, ``<method>-warm.ckpt``)."""
    ckpt = ckpt or checkpoint_path(f"{method}-warm" if warm_from else method)
    draft_vocab = draft_vocab or DRAFT_VOCAB
    cfg = drafter_config(method, target, draft_vocab)
    torch.manual_seed(seed)
    drafter = build_drafter(cfg, target).to(target.device, target.dtype).train()
    opt = make_optimizer(drafter, target)
    if ckpt.exists() and not fresh:
        st = load_checkpoint(ckpt, drafter, opt)
    elif warm_from is not None:
        st = State(0, [], 0.0, warm_start(method, target, drafter, warm_from),
                   torch.Generator().manual_seed(seed))
    else:
        st = State(0, [], 0.0, draft_vocabulary(data, draft_vocab),
                   torch.Generator().manual_seed(seed))
    head = DraftHead(target.lm_head.weight, st.draft_ids.to(target.device))
    lookup = vocab_lookup(st.draft_ids, target.cfg.vocab_size).to(target.device)
    train_loop(method, drafter, head, target, data, opt, st, steps, ckpt, lookup,
               batch, width, progress, loss_fn, sample or sample_batch, peak_lr(warm_from))
    return Trained(drafter.eval(), head, cfg, st, lookup)


def train_loop(method, drafter, head, target, data, opt, st: State, steps: int, ckpt: Path,
               lookup, batch: int, width: int, progress: bool, loss_fn=None,
               sample=sample_batch, lr: float = LR) -> None:
    """Steps st.step .. steps - 1, a checkpoint every CKPT_EVERY steps and at the end; ``lr``:
    the peak of the schedule (:func:`lr_at`)."""
    seqs, _ = split(data)
    amp = compute_dtype(target)
    bar = tqdm(total=steps, initial=st.step, desc=method, disable=not progress)
    while st.step < steps:
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(st.step, steps, lr)
        b = sample(data, seqs, st.gen, batch, width).to(target.device, target.dtype)
        st.losses.append(train_step(method, drafter, head, target, b, lookup, opt, loss_fn,
                                    amp))
        st.step += 1
        st.seconds += time.perf_counter() - t0
        bar.update(1)
        bar.set_postfix(loss=f"{sum(st.losses[-20:]) / len(st.losses[-20:]):.3f}")
        if st.step % CKPT_EVERY == 0 or st.step == steps:
            save_checkpoint(ckpt, drafter, target, opt, st)
    bar.close()


# ---------------------------------------------------------------------------------- the runner

def run_facts(script: str, data: dict, st: State, device: torch.device) -> dict:
    """The manifest fields every training script records: the script, the data (its
    sequences, tokens and the prompts' source: ``data["prompts"]``, set by the loaders), steps,
    the last 100 steps' mean loss, the commit, the seconds and the device trained on."""
    where = device_name(device) + (f", {torch.get_num_threads()} threads"
                                   if device.type == "cpu" else "")
    return {"script": script,
            "data": {"sequences": len(data["prompt_lens"]), "tokens": len(data["tokens"]),
                     "prompts": data.get("prompts", distill.TRAINING_PROMPTS)},
            "steps": st.step,
            "final_loss": round(sum(st.losses[-100:]) / max(1, len(st.losses[-100:])), 4),
            "commit": git_commit(short=True), "seconds": round(st.seconds, 1), "device": where}


def manifest(method: str, data: dict, trained: Trained, scores: dict) -> dict:
    """The manifest fields :func:`weights.save_drafter` is given."""
    out = run_facts("minillm/spec_decode/training/train.py", data, trained.state,
                    trained.head.rows.device)
    out |= {"heldout_accuracy": scores["heldout_accuracy"]}
    if method == "medusa":
        out["head_accuracy"] = scores["topk_accuracy"]
    return out


def run(method: str, target: Transformer, data: dict, steps: int | None = None,
        fresh: bool = False, out: Path | None = None,
        live: LiveFeatures | None = None, warm_from: Path | None = None) -> Path:
    """Train ``method``, measure it on the held-out sequences, write weights + manifest.
    ``live``: features computed per batch (data of token ids only: the corpus);
    ``warm_from``: a drafter file to start from (:func:`warm_start`)."""
    before = warm_origin(method, warm_from) if warm_from else None
    trained = train(method, target, data, steps or DEFAULT_STEPS[method], fresh=fresh,
                    sample=live.sampler() if live else None, warm_from=warm_from)
    states_fn = (lambda d, t, b: eval_states(method, d, t, live(b).to(t.device, t.dtype))) \
        if live else None
    scores = evaluate(method, trained.drafter, trained.head, target, data, split(data)[1],
                      trained.lookup, states_fn=states_fn, whole=live is not None)
    facts = manifest(method, data, trained, scores) | ({"warm_start": before} if before else {})
    path = weights.save_drafter(trained.drafter, target, trained.cfg, trained.state.draft_ids,
                                facts, path=out)
    print(f"{method}: held-out accuracy {scores['heldout_accuracy']} -> {path} "
          f"({path.stat().st_size / 1e6:.1f} MB)")
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minillm.spec_decode.training.train",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("method", nargs="?", default="all", choices=[*LOSSES, "dflash", "all"])
    p.add_argument("--steps", type=int, default=None, help="steps per drafter")
    p.add_argument("--fresh", action="store_true", help="ignore a saved checkpoint")
    p.add_argument("--data-only", action="store_true", help="only make the distillation data")
    p.add_argument("--corpus", action="store_true",
                   help="train on the corpus (python -m minillm.spec_decode.training.distill; "
                        "token ids, features computed per batch) instead of the templated set")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--warm", action="store_true",
                   help="start from the shipped weights (continued training on more data)")
    args = p.parse_args(argv)
    if not args.corpus and (args.data_only or args.method == "all"):
        distill.make_dataset()
        if args.data_only:
            return
    from ...checkpoint.loader import load_model
    from .eagle3 import serving_copy
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target, _ = load_model("smollm2-135m", device=device, dtype=torch.float32)
    data = distill.load_corpus() if args.corpus else load_data()
    served = serving_copy(target) if args.corpus else None
    for method in [*LOSSES, "dflash"] if args.method == "all" else [args.method]:
        warm = weights.weight_files(method)[0] if args.warm else None
        if method == "dflash":
            from .block_train import run_block
            run_block(target, data, args.steps, args.fresh, served=served, warm_from=warm)
        else:
            run(method, target, data, args.steps, args.fresh,
                live=LiveFeatures(served) if served is not None else None, warm_from=warm)


if __name__ == "__main__":
    main()
