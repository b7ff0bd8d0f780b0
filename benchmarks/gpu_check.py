"""Model checks at real shapes on a GPU: parity with HF transformers and the decode benchmark.

The GPU machine cannot carry the real model file, so each model here is a preset's exact shape
with seeded random weights (``load_model(name, random_weights=True)``), and HF's
``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` gets the same weights
(:mod:`minillm.checkpoint.hf_interop`).

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_model_check.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from minillm.bench.common import bench_prompt, rates, time_hf, time_minillm
from minillm.checkpoint import load_model
from minillm.checkpoint.hf_interop import to_hf_model
from minillm.runinfo import machine_info

MODELS = ("smollm2-135m", "qwen3-0.6b", "llama-3.2-1b")


@torch.inference_mode()
def parity(name: str, device: torch.device, seq: int = 256) -> dict:
    """Max |logit difference| minillm vs HF (same weights), fp32 (TF32 off) and bf16."""
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {"model": name, "seq": seq}
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = load_model(name, device=device, dtype=dtype, random_weights=True)
        hf = to_hf_model(model)
        ids = torch.randint(0, model.cfg.vocab_size, (2, seq), device=device,
                            generator=torch.Generator(device).manual_seed(0))
        ours, ref = model(ids).float(), hf(ids).logits.float()
        key = str(dtype).removeprefix("torch.")
        out[f"max_abs_diff_{key}"] = (ours - ref).abs().max().item()
        out[f"logit_scale_{key}"] = ref.abs().max().item()
        out[f"argmax_agree_{key}"] = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
        del model, hf
        torch.cuda.empty_cache()
    return out


def decode(name: str, device: torch.device, prompt_len: int, new_tokens: int,
           repeats: int) -> list[dict]:
    """Prefill and batch-1 decode tokens/s of minillm and HF in bf16, same weights."""
    model, _ = load_model(name, device=device, dtype=torch.bfloat16, random_weights=True)
    hf = to_hf_model(model)
    prompt = bench_prompt(None, model.cfg.vocab_size, prompt_len)
    rows = []
    for engine, timer in (("minillm", lambda: time_minillm(model, prompt, new_tokens, repeats)),
                          ("hf", lambda: time_hf(hf, prompt, new_tokens, repeats, device,
                                                 model.cfg.eos_token_id))):
        p_s, g_s, _ = timer()
        pre, dec = rates(prompt_len, new_tokens, p_s, g_s)
        rows.append({"model": name, "engine": engine, "dtype": "bfloat16",
                     "prefill_tok_s": pre, "decode_tok_s": dec})
        print(f"{name:14s} {engine:8s} prefill {pre:10.0f} tok/s   decode {dec:7.1f} tok/s",
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results/gpu_model_check.json")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA GPU")
    dev = torch.device("cuda")
    report = {"benchmark": "gpu_model_check", **machine_info(dev, torch.get_num_threads()),
              "parity": [], "decode": []}
    for name in MODELS:
        report["parity"].append(parity(name, dev))
        print(json.dumps(report["parity"][-1]), flush=True)
    for name in MODELS:
        report["decode"] += decode(name, dev, args.prompt_len, args.new_tokens, args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
