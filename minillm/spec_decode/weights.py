"""Drafter weights shipped as package data: ``minillm/spec_decode/weights/<method>.pt`` and a
manifest ``<method>.json`` (script, data size, steps, final loss, commit, the target it was trained
for, the file's SHA-256).

Matrices are stored as int4 in groups of ``GROUP`` input columns, each group with an fp16 scale
(symmetric, like :mod:`minillm.quant`'s weight-only int4; two values a byte), so that every
drafter fits the package's weight budget; a matrix whose width is not a multiple of the group
as int8 with one fp16 scale per row (files written so before load too); everything else as
fp16. The draft vocabulary's ids are stored too, the target's own rows are not.
Loading checks that the file exists, that its
hash is the manifest's, and that the model it serves is the one it was trained for: each is a
clear error naming the file.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..model.transformer import Transformer
from .drafters import DrafterConfig, DraftHead, build_drafter, own_parameters

WEIGHTS_DIR = Path(__file__).parent / "weights"
BUDGET_BYTES = 24_000_000    # every shipped drafter together (the package stays small)


def weight_files(method: str, path: str | Path | None = None) -> tuple[Path, Path]:
    pt = Path(path) if path is not None else WEIGHTS_DIR / f"{method}.pt"
    return pt, pt.with_suffix(".json")


def target_fingerprint(target: Transformer) -> dict:
    """What identifies the target a drafter was trained on: its shape and a checksum of its
    embedding (a model with the same shape and other weights differs in it)."""
    c = target.cfg
    emb = target.embed.weight.detach()[:256].float()
    return {"vocab_size": c.vocab_size, "d_model": c.d_model, "n_layers": c.n_layers,
            "embed_checksum": round(float(emb.abs().sum()), 1)}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


GROUP = 64                   # input columns sharing one int4 scale
STORAGE = f"int4 matrices in groups of {GROUP} columns"     # as manifests record it


def quantize(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict as stored: ``name.int4`` uint8 [rows, cols / 2] (two values, low nibble
    first, offset by 8) and ``name.scale`` fp16 [rows, cols / GROUP] per matrix; ``name.int8``
    and a per-row scale for a matrix of another width; the rest fp16."""
    out = {}
    for k, v in state.items():
        v = v.detach().float().cpu()
        if v.dim() == 2 and v.numel() >= 4096 and v.shape[1] % GROUP == 0:
            groups = v.view(v.shape[0], -1, GROUP)
            scale = (groups.abs().amax(-1, keepdim=True) / 7).clamp_min(1e-6).half().float()
            q = ((groups / scale).round().clamp(-8, 7) + 8).to(torch.uint8).view(v.shape)
            out[k + ".int4"] = q[:, 0::2] | (q[:, 1::2] << 4)
            out[k + ".scale"] = scale[..., 0].half()
        elif v.dim() == 2 and v.numel() >= 4096:
            scale = (v.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-6).half().float()
            out[k + ".int8"] = (v / scale).round().clamp(-127, 127).to(torch.int8)
            out[k + ".scale"] = scale.half()
        else:
            out[k] = v.half()
    return out


def dequantize(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`quantize`'s output back to a float32 state dict."""
    out = {}
    for k, v in stored.items():
        if k.endswith(".int4"):
            name, scale = k[:-5], stored[k[:-5] + ".scale"].float()
            q = torch.stack([v & 15, v >> 4], -1).view(v.shape[0], -1).float() - 8
            out[name] = (q.view(v.shape[0], -1, GROUP) * scale[..., None]).view(q.shape)
        elif k.endswith(".int8"):
            out[k[:-5]] = v.float() * stored[k[:-5] + ".scale"].float()
        elif not k.endswith(".scale"):
            out[k] = v.float()
    return out


def save_drafter(drafter: torch.nn.Module, target: Transformer, cfg: DrafterConfig,
                 draft_ids: torch.Tensor, manifest: dict, path: str | Path | None = None,
                 extra: dict | None = None) -> Path:
    """Write the weights (int4 matrices) and the manifest; returns the weights' path."""
    pt, js = weight_files(cfg.method, path)
    pt.parent.mkdir(parents=True, exist_ok=True)
    state = quantize(own_parameters(drafter, target))
    torch.save({"state": state, "draft_ids": draft_ids.int().cpu()}, pt)
    full = {**manifest, "method": cfg.method, "config": cfg.to_dict(),
            "target": target_fingerprint(target), "storage": STORAGE,
            "bytes": pt.stat().st_size, "sha256": _sha256(pt), **(extra or {})}
    js.write_text(json.dumps(full, indent=2) + "\n")
    return pt


def read_manifest(method: str, path: str | Path | None = None) -> dict:
    pt, js = weight_files(method, path)
    if not pt.exists() or not js.exists():
        missing = pt if not pt.exists() else js
        make = "make drafters-corpus` (python -m minillm.spec_decode.training.eagle3)" \
            if method == "eagle3" else \
            f"make drafters` (python -m minillm.spec_decode.training.train {method})"
        raise FileNotFoundError(f"speculative_config method {method!r} needs the drafter file "
                                f"{missing}, which is missing: make it with `{make}")
    return json.loads(js.read_text())


def training_run(manifest: dict) -> str:
    """How a drafter was trained, from its manifest: its steps and data, and those of the run it
    continued (``--warm``), e.g. "600 steps on 20,000 replies (3,932,967 tokens), after 480
    steps on 1,600 replies (247,421 tokens)"."""
    data = manifest["data"]
    text = f"{manifest['steps']} steps on {data['sequences']:,} replies ({data['tokens']:,} tokens)"
    before = manifest.get("warm_start")
    return text + (f", after {training_run(before)}" if before else "")


def load_drafter(method: str, target: Transformer, path: str | Path | None = None
                 ) -> tuple[torch.nn.Module, DraftHead, dict]:
    """(drafter on the target's device and dtype, its head, the manifest)."""
    pt, _ = weight_files(method, path)
    manifest = read_manifest(method, path)
    if manifest.get("method") != method:
        raise ValueError(f"drafter file {pt} holds a {manifest.get('method')!r} drafter, "
                         f"not {method!r}")
    if _sha256(pt) != manifest["sha256"]:
        raise ValueError(f"drafter file {pt} does not match its manifest's sha256: it was "
                         f"changed or cut short; retrain with `make drafters`")
    if manifest["target"] != target_fingerprint(target):
        raise ValueError(f"drafter file {pt} was trained for another model "
                         f"({manifest['target']}), not this one ({target_fingerprint(target)})")
    blob = torch.load(pt, map_location="cpu")
    cfg = DrafterConfig(**manifest["config"])
    drafter = build_drafter(cfg, target)
    missing, unexpected = drafter.load_state_dict(dequantize(blob["state"]), strict=False)
    own = set(own_parameters(drafter, target))
    if unexpected or own & set(missing):
        raise ValueError(f"drafter file {pt} does not fit a {method} drafter: missing "
                         f"{sorted(own & set(missing))[:3]}, unexpected {unexpected[:3]}")
    drafter.to(device=target.device, dtype=target.dtype).eval()
    head = DraftHead(target.lm_head.weight, blob["draft_ids"].to(target.device))
    return drafter, head, manifest
