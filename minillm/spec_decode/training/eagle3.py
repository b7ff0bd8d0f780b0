"""EAGLE-3's drafter, trained with training-time test (Li et al. 2025, "EAGLE-3: Scaling up
Inference Acceleration of Large Language Models via Training-Time Test").

Data: the target's own replies to the corpus prompts, as token ids
(:func:`.distill.make_corpus_dataset`); every batch is a set of whole sequences (from their
first token, at most ``WIDTH``), so the target's states can be recomputed exactly:

- **features**: the target's residual streams after a low, a middle and a high layer
  (:func:`~minillm.spec_decode.drafters.eagle3_layers`: 2, n/2 and n-3 of n), [B, T, 3D],
  fused by the drafter's ``fuse``;
- **training-time test**: the drafter runs ``STEPS`` times over the batch. Step 1 reads the
  fused target features; step j > 1 reads at position t its own step j-1 output at t-1, which
  is what it reads at serving time after drafting j-1 tokens. A step-j row at t is the j-th
  token of a draft that starts after position t-(j-1): it attends to the step-1 rows up to
  t-(j-1) (the committed context, computed from the target's features) and to its own chain,
  the step-i rows at t-(j-i) (:func:`ttt_mask`), as the serving-time cache holds them. Every
  row predicts x_{t+2}: cross-entropy only (no feature regression), step j weighted
  ``DECAY^(j-1)``.

    python -m minillm.spec_decode.training.eagle3 [--steps N] [--fresh] [--warm] [--device cuda]

Shapes: B sequences, T positions, D the target's width, m the feature layers.
"""
from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
import torch.nn.functional as F

from ...model.transformer import Transformer
from .. import weights
from . import distill
from .batches import Batch, sample_whole, split
from .train import Trained, ahead, ce, evaluate, labels_at, run_facts, train, warm_origin

STEPS = 4                 # training-time test depth
DECAY = 0.8               # weight of step j: DECAY^(j-1)
WIDTH = 384               # longest sequence prefix a batch row holds
BATCH = 16
DEFAULT_STEPS = 1200


@torch.no_grad()
def target_states(target: Transformer, tokens: torch.Tensor, layers: tuple[int, ...]
                  ) -> torch.Tensor:
    """tokens [B, T] (whole sequences from position 0, right-padded) -> [B, T, m * D]."""
    _, kept = target.forward_layers(tokens, keep=layers)
    return torch.cat([kept[i] for i in layers], -1)


def ttt_mask(step: int, t: int, device=None) -> torch.Tensor:
    """Which keys a step-``step`` query row sees, [T, step * T] bool: the keys are the rows of
    steps 1..step side by side. Query t sees step-1 keys s <= t - (step - 1) and, for each
    later step i <= step, the one key s = t - (step - i)."""
    q = torch.arange(t, device=device)[:, None]
    s = torch.arange(t, device=device)[None]
    blocks = [s <= q - (step - 1)] + [s == q - (step - i) for i in range(2, step + 1)]
    return torch.cat(blocks, 1)


class StepCache:
    """The keys and values of the earlier training-time test steps, per layer: each call of
    ``attend`` adds this step's and attends with :func:`ttt_mask` (the step is the number of
    calls for that layer so far); one StepCache per batch."""

    def __init__(self) -> None:
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_fn=None) -> torch.Tensor:
        """q [B, Hq, T, hd], k/v [B, Hkv, T, hd] of this step -> [B, Hq, T, hd]."""
        ks, vs = self.keys.setdefault(layer, []), self.values.setdefault(layer, [])
        ks.append(k)
        vs.append(v)
        group = q.shape[1] // k.shape[1]
        keys = torch.cat(ks, 2).repeat_interleave(group, 1)
        values = torch.cat(vs, 2).repeat_interleave(group, 1)
        mask = ttt_mask(len(ks), q.shape[2], q.device)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    def advance(self, t: int) -> None: ...


def shifted(x: torch.Tensor) -> torch.Tensor:
    """x [B, T, D] moved one position on (x[:, t - 1] at t, zeros at 0)."""
    out = torch.zeros_like(x)
    out[:, 1:] = x[:, :-1]
    return out


def ttt_outputs(drafter, target: Transformer, batch: Batch, steps: int = STEPS,
                features_from: Transformer | None = None) -> list[torch.Tensor]:
    """The drafter's outputs [B, T, D] at steps 1..steps (row t of each predicts x_{t+2});
    ``features_from``: the target in the dtype it serves in, for its states (default
    ``target``)."""
    states = target_states(features_from or target, batch.tokens, drafter.cfg.target_layers)
    tokens = target.embed(ahead(batch.tokens, 1))
    features = drafter.fuse(states.to(tokens.dtype))
    cache, outs = StepCache(), []
    for _ in range(steps):
        f = drafter(tokens, features, batch.positions, cache)
        outs.append(f)
        features = shifted(f)
    return outs


def eagle3_loss(drafter, head, target, batch: Batch, lookup,
                features_from: Transformer | None = None) -> torch.Tensor:
    """sum_j DECAY^(j-1) CE(head(f^j), x_{t+2}), rows with a whole chain only."""
    labels, reply = labels_at(batch, lookup, 2)
    t = torch.arange(labels.shape[1], device=labels.device)
    loss = 0.0
    for j, f in enumerate(ttt_outputs(drafter, target, batch, features_from=features_from)):
        ok = t >= j                                      # a chain of j + 1 rows fits
        loss = loss + DECAY ** j * ce(head, f, torch.where(ok, labels, -100), reply)
    return loss


def eval_states(drafter, target, batch: Batch, features_from: Transformer | None = None
                ) -> list[tuple[torch.Tensor, int]]:
    """For :func:`.train.evaluate`: step j's outputs, each predicting x_{t+2}; the accuracy of
    step j is that of the j-th drafted token when the j - 1 before it were right."""
    return [(f, 2) for f in ttt_outputs(drafter, target, batch, 5, features_from)]


def serving_copy(target: Transformer) -> Transformer:
    """The target in the dtype the engine serves it in on this device (bfloat16 where the CPU
    has fast bf16 kernels: what the drafter reads at serving time, and twice as fast)."""
    from ...device import serving_dtype
    dtype, _ = serving_dtype(None, target.device)
    if dtype == target.dtype:
        return target
    return copy.deepcopy(target).to(dtype).eval().requires_grad_(False)


def train_eagle3(target: Transformer, data: dict, steps: int,
                 features_from: Transformer | None = None, **options) -> Trained:
    """:func:`.train.train` with EAGLE-3's loss and whole-sequence batches."""
    def loss(drafter, head, target, batch, lookup):
        return eagle3_loss(drafter, head, target, batch, lookup, features_from)

    return train("eagle3", target, data, steps, loss_fn=loss, sample=sample_whole,
                 batch=options.pop("batch", BATCH), width=options.pop("width", WIDTH),
                 **options)


def run(target: Transformer, data: dict, steps: int | None = None, fresh: bool = False,
        out: Path | None = None, warm_from: Path | None = None) -> Path:
    """Train, measure on the held-out sequences, write the weights and their manifest
    (``warm_from``: a drafter file to start from; the manifest names the run it came from)."""
    served = serving_copy(target)
    before = warm_origin("eagle3", warm_from) if warm_from else None
    trained = train_eagle3(target, data, steps or DEFAULT_STEPS, served, fresh=fresh,
                           warm_from=warm_from)
    scores = evaluate("eagle3", trained.drafter, trained.head, target, data, split(data)[1],
                      trained.lookup, BATCH, WIDTH, whole=True,
                      states_fn=lambda d, t, b: eval_states(d, t, b, served))
    st = trained.state
    manifest = run_facts("minillm/spec_decode/training/eagle3.py", data, st, target.device)
    manifest |= {"ttt_steps": STEPS, "heldout_accuracy": scores["heldout_accuracy"],
                 "features_dtype": str(served.dtype).removeprefix("torch.")}
    if before:
        manifest["warm_start"] = before
    path = weights.save_drafter(trained.drafter, target, trained.cfg, st.draft_ids, manifest,
                                path=out)
    print(f"eagle3: held-out accuracy by step {scores['heldout_accuracy']} -> {path}")
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minillm.spec_decode.training.eagle3",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help=f"(default: {DEFAULT_STEPS})")
    p.add_argument("--fresh", action="store_true", help="ignore a saved checkpoint")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--data", type=Path, default=None, help="corpus shards' folder")
    p.add_argument("--warm", action="store_true",
                   help="start from the shipped weights (continued training on more data)")
    args = p.parse_args(argv)
    from ...checkpoint.loader import load_model
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target, _ = load_model("smollm2-135m", device=device, dtype=torch.float32)
    warm_from = weights.weight_files("eagle3")[0] if args.warm else None
    run(target, distill.load_corpus(args.data), args.steps, args.fresh, warm_from=warm_from)


if __name__ == "__main__":
    main()
