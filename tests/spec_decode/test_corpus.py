"""The drafters' training corpus (minillm.spec_decode.training.corpus and the shards of
distill.make_corpus_dataset): prompts deterministic for a seed, in their shares, never holding a
benchmark prompt's words or passages, and a shard that holds the target's own replies."""
from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from minillm.spec_decode.prompts import all_benchmark_prompts
from minillm.spec_decode.training import corpus as C
from minillm.spec_decode.training import distill


@pytest.fixture(scope="module")
def small_stdlib():
    """The corpus read from a handful of standard-library files (all of them take ~40 s)."""
    files = [p for p in C.stdlib_files() if p.name in ("argparse.py", "textwrap.py",
                                                        "heapq.py", "bisect.py", "fractions.py")]
    assert len(files) == 5
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(C, "stdlib_files", lambda: files)
        C.stdlib_texts.cache_clear()
        yield C.stdlib_texts()
    C.stdlib_texts.cache_clear()


def test_passages_and_code_are_real_and_bounded(small_stdlib):
    passages, code = small_stdlib
    assert len(passages) >= 10 and len(code) >= 10
    for p in passages:
        assert C.MIN_WORDS <= len(p.split()) <= C.MAX_WORDS
    for c in code:
        assert c.startswith("def ") and compile(c, "<corpus>", "exec")   # dedented, whole


def test_prompts_keep_their_shares_and_are_deterministic(small_stdlib, real):
    tok = real[1]
    prompts = C.corpus_prompts(400, tok, seed=3)
    assert prompts == C.corpus_prompts(400, tok, seed=3) != C.corpus_prompts(400, tok, seed=4)
    counts = Counter(kind for kind, _ in prompts)
    assert counts == {k: round(400 * s) for k, s in C.KIND_SHARES.items()}
    assert len({m for _, m in prompts}) > 0.9 * 400


def test_no_benchmark_words_or_passages(small_stdlib, real):
    words = set(C.vocabulary_words(real[1]))
    assert len(words) > 5000
    held_out = all_benchmark_prompts()
    seen = {w.lower() for m in held_out for w in re.findall(r"[A-Za-z]+", m)}
    assert not words & seen
    passages, _ = small_stdlib
    assert not any(p in m or m in p for p in passages for m in held_out)


def test_a_shard_holds_the_targets_replies_and_its_own_questions(small_stdlib, real):
    from minillm import LLM
    llm = LLM("smollm2-135m", dtype="float32", max_num_seqs=8)
    prompts = [("self", C.SELF_ASK.format(t="volcanoes")), ("chat", "What is a river?")]
    shard = distill.make_corpus_shard(llm, prompts, 0, max_tokens=6)
    offsets, plens = shard["offsets"], shard["prompt_lens"]
    assert shard["kinds"] == ["self", "chat"] and len(offsets) == 3
    first = real[1].decode(shard["tokens"][:plens[0]].tolist())
    assert "volcano" in first.lower() and C.SELF_ASK[:20] not in first   # its own question
    replies = [shard["tokens"][offsets[i] + plens[i]:offsets[i + 1]] for i in range(2)]
    assert all(1 <= len(r) <= 6 for r in replies) and shard["tokens"].dtype == torch.int32


def test_shards_are_stored_whole_and_read_back_exactly(tmp_path):
    """A shard goes to disk as compressed uint16 ids and comes back as it was; the corpus
    joins the shards in order, rebases their offsets and holds out the last one."""
    def shard(tokens, lens, plens, kinds):
        return {"tokens": torch.tensor(tokens, dtype=torch.int32),
                "offsets": torch.tensor([0, *lens]).cumsum(0),
                "prompt_lens": torch.tensor(plens), "kinds": kinds}
    a = shard([1, 2, 49151, 5, 6], [3, 2], [2, 1], ["chat", "self"])
    b = shard([7, 8, 9, 10], [4], [3], ["code"])
    distill.save_corpus_shard(a, tmp_path / "shard-0000.npz")
    distill.save_corpus_shard(b, tmp_path / "shard-0001.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-0000.npz", "shard-0001.npz"]
    back = distill.read_corpus_shard(tmp_path / "shard-0000.npz")
    for key in ("tokens", "offsets", "prompt_lens"):
        assert torch.equal(back[key], a[key]) and back[key].dtype == a[key].dtype
    assert back["kinds"] == a["kinds"]
    data = distill.load_corpus(tmp_path)
    assert data["tokens"].tolist() == [1, 2, 49151, 5, 6, 7, 8, 9, 10]
    assert data["offsets"].tolist() == [0, 3, 5, 9] and data["heldout"] == 1
    assert data["kinds"] == ["chat", "self", "code"]
    with pytest.raises(ValueError, match="uint16"):
        distill.save_corpus_shard(shard([70000], [1], [1], ["chat"]), tmp_path / "x.npz")
    with pytest.raises(FileNotFoundError, match="no corpus shards"):
        distill.load_corpus(tmp_path / "empty")
