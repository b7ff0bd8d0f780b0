"""What a drafter's training run keeps between sessions and what it can start from: the
checkpoint (drafter, optimizer, step, losses, seconds, draft vocabulary, rng), written whole or
not at all, and a warm start from a drafter file."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ...model.transformer import Transformer
from .. import weights
from ..drafters import own_parameters
from . import distill


def checkpoint_path(method: str) -> Path:
    """Where ``method``'s training checkpoint lives (outside the repository: the cache)."""
    return distill.cache_dir() / "spec-train" / f"{method}.ckpt"


@dataclass
class State:
    """What a checkpoint holds besides the drafter and the optimizer."""

    step: int
    losses: list[float]
    seconds: float
    draft_ids: torch.Tensor
    gen: torch.Generator


def save_checkpoint(path: Path, drafter, target, opt, st: State) -> None:
    """The drafter's own parameters (not the target's it borrows), the optimizer and ``st``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {"drafter": {k: v.detach() for k, v in own_parameters(drafter, target).items()},
            "optimizer": opt.state_dict(), "step": st.step, "losses": st.losses,
            "seconds": st.seconds, "draft_ids": st.draft_ids, "rng": st.gen.get_state()}
    torch.save(blob, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)                   # whole or absent


def load_checkpoint(path: Path, drafter, opt) -> State:
    """Fill ``drafter`` and ``opt`` from ``path``; returns the rest of the checkpoint."""
    blob = torch.load(path, map_location="cpu")
    drafter.load_state_dict(blob["drafter"], strict=False)
    opt.load_state_dict(blob["optimizer"])
    gen = torch.Generator()
    gen.set_state(blob["rng"])
    return State(blob["step"], blob["losses"], blob["seconds"], blob["draft_ids"], gen)


def warm_start(method: str, target: Transformer, drafter: nn.Module, path: Path
               ) -> torch.Tensor:
    """Copy the weights of the ``method`` drafter file ``path`` into ``drafter`` (continued
    training on more data: the schedule restarts, the steps count afresh); returns its draft
    vocabulary, which the head must keep."""
    start, head, _ = weights.load_drafter(method, target, path)
    drafter.load_state_dict(own_parameters(start, target), strict=False)
    return head.ids.cpu()
