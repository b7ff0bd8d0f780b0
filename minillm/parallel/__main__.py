"""Smoke check of tensor parallelism, runnable both ways:

    python -m minillm.parallel --world-size 2            # spawns the ranks itself
    torchrun --nproc-per-node 2 -m minillm.parallel      # torchrun starts them; same code
"""
from __future__ import annotations

import argparse
import os

import torch

from ..checkpoint.loader import random_model
from ..config import PRESETS
from .api import tp_logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 2)))
    parser.add_argument("--backend", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = random_model(PRESETS["tiny"].with_(vocab_size=512), seed=0).eval()
    model.requires_grad_(False)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    want = model(ids)
    results = tp_logits(model, ids, args.world_size, backend=args.backend)
    err = max((r["logits"] - want).abs().max().item() for r in results)
    print(f"rank {os.environ.get('RANK', 'parent')}: TP={args.world_size} logits vs single "
          f"process: max |diff| {err:.1e}")
    if err > 1e-4:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
