"""A trained drafter where it is trained to work: held-out corpus prompts against the benchmark's.

    python benchmarks/spec_corpus_bench.py [--method eagle3] [--shard shard-0039.npz]
                                           [--prompts 12] [--max-tokens 64]

``python -m minillm bench spec`` measures every drafter on the prompt bank's held-out topics,
whose templates the corpus-trained drafters never saw. This script asks how much of the gap
to the drafter's held-out accuracy is the prompts: it measures the same engine configurations
on ``--prompts`` prompts taken evenly from one corpus shard that the drafter's training held out
(``minillm.spec_decode.training.distill.load_corpus`` holds out the last shard it finds, the
default here; the corpus folder is ``minillm/spec_decode/training/corpus_shards``, made by
``python -m minillm.spec_decode.training.distill``),
and on as many of the benchmark's prompts (chat and free kinds), each against the plain engine
on the same prompts, at batch 1, greedy. Configurations: a chain of 4 (``tree_topk`` 1), a
4-node tree of depth 2, EAGLE-2's 16-node tree of depth 5. It prints one table (speedup,
tokens per round, acceptance by position) with the CPU and the load average.
"""
from __future__ import annotations

import argparse
import os

import torch

from minillm import SamplingParams, load_model
from minillm.bench.spec import chat_prompts, measure
from minillm.device import serving_dtype
from minillm.runinfo import machine_info
from minillm.spec_decode.training.distill import (
    corpus_data_dir,
    corpus_shard_paths,
    read_corpus_shard,
)

CONFIGS = {"chain of 4": (4, {"tree_topk": 1, "tree_nodes": 4}),
           "tree of 4, depth 2": (2, {"tree_topk": 2, "tree_nodes": 4}),
           "tree of 16, depth 5": (5, {"tree_topk": 4, "tree_nodes": 16})}


def shard_prompts(path: os.PathLike, n: int) -> list[list[int]]:
    """``n`` prompts (chat-templated token ids) spread evenly over a corpus shard."""
    shard = read_corpus_shard(path)
    count = len(shard["prompt_lens"])
    picks = [i * count // n for i in range(n)]
    return [shard["tokens"][shard["offsets"][i]:shard["offsets"][i] + shard["prompt_lens"][i]]
            .tolist() for i in picks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="eagle3", choices=("eagle", "eagle3"))
    parser.add_argument("--shard", default=None,
                        help="a shard in the corpus folder that the drafter's training held out "
                             "(default: the last one, which training holds out)")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    shards = corpus_shard_paths()
    path = corpus_data_dir() / args.shard if args.shard else (shards or [None])[-1]
    if path is None or not path.exists():
        raise SystemExit(f"--shard {args.shard}: no {path or corpus_data_dir()} (make the "
                         f"corpus with `python -m "
                         f"minillm.spec_decode.training.distill`)")
    dtype, _ = serving_dtype(None, torch.device("cpu"))
    target, tok = load_model("smollm2-135m", dtype=dtype)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    half = args.prompts // 2
    sets = {f"held-out corpus ({path.name})": shard_prompts(path, args.prompts),
            "benchmark (chat, free)": chat_prompts(tok, "chat", half)
            + chat_prompts(tok, "free", args.prompts - half)}
    info = machine_info(torch.device("cpu"), torch.get_num_threads())
    print(f"{args.method}, {dtype}, {args.prompts} prompts per set, {args.max_tokens} tokens, "
          f"batch 1; {info['device']}, {info['threads']} threads, commit {info['git_commit']}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'prompts':<34} {'configuration':<20} {'speedup':>8} {'tok/round':>10}  "
          f"acceptance by position")
    for name, prompts in sets.items():
        plain = measure(target, tok, None, 0, "mixed", prompts, 1, params)
        for label, (k, extra) in CONFIGS.items():
            run = measure(target, tok, args.method, k, "mixed", prompts, 1, params, extra=extra)
            print(f"{name:<34} {label:<20} {run.rate / plain.rate:>7.2f}x "
                  f"{run.mean_accepted:>10.2f}  "
                  + " ".join(f"{a:.2f}" for a in run.acceptance), flush=True)


if __name__ == "__main__":
    main()
