"""Self-distillation data for the drafters: the target's own replies, with its hidden states.

Every drafter of chapter 06 learns to predict what *this* target says, so the training text is
the target's: each prompt of :func:`minillm.spec_decode.prompts.training_prompts`, in the chat
template, answered by SmolLM2 through our engine (most greedily, a share sampled at
temperature 0.8, seeded), then run once more through the target to record its final hidden
state at every position (what EAGLE, MTP and Medusa read at serving time). Made once, shared by
every drafter's training (:mod:`.train`).

Work is done in shards of ``shard_size`` prompts written to ``<dir>/shard-XXXX.pt``, so an
interrupted run resumes where it stopped. A shard holds, for S sequences and N tokens in all:
tokens int32 [N], offsets int64 [S + 1], prompt_lens int64 [S], features bfloat16 [N, D].
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ...config import SamplingParams
from ..prompts import training_prompts

SAMPLED_SHARE = 0.25        # replies drawn at temperature 0.8 instead of greedily
POOL = 2400                 # prompts are the first num_prompts of training_prompts(POOL)
TRAINING_PROMPTS = "minillm.spec_decode.prompts.training_prompts"       # each data's source,
CORPUS_PROMPTS = "minillm.spec_decode.training.corpus.corpus_prompts"   # as manifests name it


def cache_dir() -> Path:
    """Where made data lives: $MINILLM_CACHE or ~/.cache/minillm."""
    return Path(os.environ.get("MINILLM_CACHE", Path.home() / ".cache" / "minillm"))


def default_data_dir() -> Path:
    return cache_dir() / "spec-distill"


def reply_params(index: int, max_tokens: int) -> SamplingParams:
    """Greedy for most prompts; every 4th sampled at temperature 0.8 with its own seed."""
    if index % round(1 / SAMPLED_SHARE) == 0:
        return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, seed=index)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@torch.inference_mode()
def target_features(model, sequences: list[list[int]], batch: int = 16) -> list[torch.Tensor]:
    """The target's final normed hidden state at every position of each sequence
    ([len, D] each), from right-padded batches of similar lengths (causal: padding after a
    sequence does not change it)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[torch.Tensor | None] = [None] * len(sequences)
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        width = max(len(sequences[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long, device=model.device)
        for row, i in enumerate(idx):
            ids[row, :len(sequences[i])] = torch.tensor(sequences[i])
        h = model.hidden_states(ids)
        for row, i in enumerate(idx):
            out[i] = h[row, :len(sequences[i])].to(torch.bfloat16).cpu()
    return out


def make_shard(llm, prompts: list[tuple[str, str]], first_index: int, max_tokens: int) -> dict:
    """Answer ``prompts`` with the target and record its features."""
    tok = llm.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": m}],
                                     add_generation_prompt=True) for _, m in prompts]
    params = [reply_params(first_index + i, max_tokens) for i in range(len(prompts))]
    outs = llm.generate(chats, params, use_tqdm=False)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    feats = target_features(llm.model, seqs)
    lens = torch.tensor([len(s) for s in seqs])
    return {"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
            "prompt_lens": torch.tensor([len(o.prompt_token_ids) for o in outs]),
            "features": torch.cat(feats), "kinds": [k for k, _ in prompts]}


def make_dataset(out_dir: Path | None = None, num_prompts: int = 1600, max_tokens: int = 96,
                 shard_size: int = 200, model: str = "smollm2-135m") -> Path:
    """Write (or finish writing) the shards; returns the folder."""
    from ...engine.llm import LLM
    out_dir = Path(out_dir or default_data_dir())
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(POOL)[:num_prompts]
    shards = range(0, num_prompts, shard_size)
    todo = [s for s in shards if not (out_dir / f"shard-{s // shard_size:04d}.pt").exists()]
    if not todo:
        return out_dir
    llm = LLM(model, max_num_seqs=64)
    for start in tqdm(todo, desc="distillation shards", initial=len(shards) - len(todo),
                      total=len(shards)):
        shard = make_shard(llm, prompts[start:start + shard_size], start, max_tokens)
        path = out_dir / f"shard-{start // shard_size:04d}.pt"
        torch.save(shard, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)           # a shard is whole or absent
    return out_dir


def load_dataset(data_dir: Path | None = None) -> dict:
    """All shards joined: tokens [N], offsets [S + 1], prompt_lens [S], features [N, D];
    ``prompts``: their source."""
    data_dir = Path(data_dir or default_data_dir())
    paths = sorted(data_dir.glob("shard-*.pt"))
    if not paths:
        raise FileNotFoundError(f"no distillation shards in {data_dir}: run `python -m "
                                f"minillm.spec_decode.training.train --data-only` (or make "
                                f"drafters)")
    return join_shards([torch.load(p) for p in paths]) | {"prompts": TRAINING_PROMPTS}


def join_shards(parts: list[dict]) -> dict:
    """Shards as one dataset: tokens [N], offsets [S + 1] (rebased), prompt_lens [S], kinds
    [S], and features [N, D] when the shards hold them."""
    base = torch.tensor([0] + [int(p["offsets"][-1]) for p in parts]).cumsum(0)
    out = {"tokens": torch.cat([p["tokens"] for p in parts]),
           "offsets": torch.cat([parts[0]["offsets"][:1]] +
                                [p["offsets"][1:] + b for p, b in zip(parts, base)]),
           "prompt_lens": torch.cat([p["prompt_lens"] for p in parts]),
           "kinds": [k for p in parts for k in p["kinds"]]}
    if "features" in parts[0]:
        out["features"] = torch.cat([p["features"] for p in parts])
    return out


# ---------------------------------------------------------------------------------- at scale

CORPUS_SHARDS = Path(__file__).with_name("corpus_shards")


def corpus_data_dir() -> Path:
    """The corpus shards, kept in the repository beside this module: made once (about 2.5 hours
    for 40 shards on 2 CPU cores), they are token ids only, about 90 KB a shard compressed."""
    return CORPUS_SHARDS


def save_corpus_shard(shard: dict, path: Path) -> None:
    """Write a corpus shard (:func:`make_corpus_shard`) to ``path`` (``.npz``) whole or not at
    all: token ids as uint16 (the vocabulary has 49,152 ids), compressed."""
    if int(shard["tokens"].max()) > np.iinfo(np.uint16).max:
        raise ValueError("token ids above 65,535 do not fit a corpus shard's uint16")
    tmp = path.with_name(f".{path.name}")              # unseen by the shard-*.npz glob
    np.savez_compressed(tmp, tokens=shard["tokens"].numpy().astype(np.uint16),
                        offsets=shard["offsets"].numpy(),
                        prompt_lens=shard["prompt_lens"].numpy(),
                        kinds=np.array(shard["kinds"], dtype=str))
    tmp.rename(path)


def read_corpus_shard(path: Path) -> dict:
    """A shard written by :func:`save_corpus_shard`: tokens int32 [N], offsets int64 [S + 1],
    prompt_lens int64 [S], kinds [S]."""
    with np.load(path) as f:
        return {"tokens": torch.from_numpy(f["tokens"].astype(np.int32)),
                "offsets": torch.from_numpy(f["offsets"].astype(np.int64)),
                "prompt_lens": torch.from_numpy(f["prompt_lens"].astype(np.int64)),
                "kinds": f["kinds"].tolist()}


def corpus_shard_paths(data_dir: Path | None = None) -> list[Path]:
    return sorted(Path(data_dir or corpus_data_dir()).glob("shard-*.npz"))


def load_corpus(data_dir: Path | None = None) -> dict:
    """The corpus shards joined (token ids only): tokens [N], offsets [S + 1], prompt_lens
    [S], kinds; ``heldout``: the last shard's sequences, held out; ``prompts``: their source."""
    parts = [read_corpus_shard(p) for p in corpus_shard_paths(data_dir)]
    if not parts:
        raise FileNotFoundError(f"no corpus shards in {data_dir or corpus_data_dir()}: run "
                                f"`python -m minillm.spec_decode.training.distill`")
    data = join_shards(parts)
    data["heldout"] = len(parts[-1]["prompt_lens"]) if len(parts) > 1 else 0
    data["prompts"] = CORPUS_PROMPTS
    return data


def self_questions(llm, asks: list[str]) -> list[str]:
    """The target's own questions: its greedy first line for each request to write one (the
    request itself where it wrote nothing)."""
    tok = llm.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": m}],
                                     add_generation_prompt=True) for m in asks]
    outs = llm.generate(chats, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
    lines = [o.outputs[0].text.strip().split("\n")[0].strip() for o in outs]
    return [line if len(line) > 8 else ask for line, ask in zip(lines, asks)]


def make_corpus_shard(llm, prompts: list[tuple[str, str]], first_index: int,
                      max_tokens: int) -> dict:
    """Answer ``prompts`` (:func:`.corpus.corpus_prompts`; a ``self`` one first becomes the
    target's own question). A shard holds token ids only, for S sequences and N tokens:
    tokens int32 [N], offsets int64 [S + 1], prompt_lens int64 [S], kinds [S]; features are
    recomputed from them when a drafter trains."""
    asks = [i for i, (kind, _) in enumerate(prompts) if kind == "self"]
    messages = [m for _, m in prompts]
    for i, q in zip(asks, self_questions(llm, [messages[i] for i in asks]) if asks else []):
        messages[i] = q
    tok = llm.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": m}],
                                     add_generation_prompt=True) for m in messages]
    params = [reply_params(first_index + i, max_tokens) for i in range(len(prompts))]
    outs = llm.generate(chats, params, use_tqdm=False)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    lens = torch.tensor([len(s) for s in seqs])
    return {"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
            "prompt_lens": torch.tensor([len(o.prompt_token_ids) for o in outs]),
            "kinds": [k for k, _ in prompts]}


def make_corpus_dataset(out_dir: Path | None = None, num_prompts: int = 20000,
                        max_tokens: int = 128, shard_size: int = 500, seed: int = 0,
                        max_num_seqs: int = 128, model: str = "smollm2-135m") -> Path:
    """Write (or finish writing) the shards of the target's replies to ``num_prompts``
    corpus prompts; returns the folder. Resumable: a shard is whole or absent."""
    from ...engine.llm import LLM
    from .corpus import corpus_prompts
    out_dir = Path(out_dir or corpus_data_dir())
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = range(0, num_prompts, shard_size)
    todo = [s for s in shards if not (out_dir / f"shard-{s // shard_size:04d}.npz").exists()]
    if not todo:
        return out_dir
    llm = LLM(model, max_num_seqs=max_num_seqs)
    prompts = corpus_prompts(num_prompts, llm.tokenizer, seed)
    bar = tqdm(todo, desc="corpus shards", initial=len(shards) - len(todo), total=len(shards))
    for start in bar:
        shard = make_corpus_shard(llm, prompts[start:start + shard_size], start, max_tokens)
        save_corpus_shard(shard, out_dir / f"shard-{start // shard_size:04d}.npz")
        bar.set_postfix(tokens=int(shard["offsets"][-1]))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """``python -m minillm.spec_decode.training.distill``: the corpus dataset."""
    import argparse
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"(default: {corpus_data_dir()})")
    parser.add_argument("--prompts", type=int, default=20000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--shard-size", type=int, default=500)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    args = parser.parse_args(argv)
    print(make_corpus_dataset(args.out, args.prompts, args.max_tokens, args.shard_size,
                              max_num_seqs=args.max_num_seqs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
