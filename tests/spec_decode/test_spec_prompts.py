"""The speculative-decoding prompt set: determinism, sizes, kind shares and the held-out rule."""
from __future__ import annotations

from collections import Counter

import pytest

from minillm.spec_decode import prompts as P


@pytest.fixture(scope="module")
def train():
    return P.training_prompts(3000, seed=0)


def _bench_all(kind: str) -> list[str]:
    return list(P._benchmark_pool(kind))


def _content(message: str) -> str:
    """The passage or fenced code block of a grounded message: its longest paragraph."""
    return max(message.split("\n\n"), key=len)


def test_deterministic_for_a_seed(train):
    assert P.training_prompts(3000, seed=0) == train
    assert P.training_prompts(50, seed=7) == P.training_prompts(50, seed=7)
    assert P.training_prompts(50, seed=7) != P.training_prompts(50, seed=8)
    assert P.benchmark_prompts("chat") == P.benchmark_prompts("chat")


@pytest.mark.parametrize("n", [0, 1, 2, 10, 301, 3000])
def test_n_respected_and_kind_thirds(n):
    pairs = P.training_prompts(n, seed=3)
    assert len(pairs) == n
    counts = Counter(kind for kind, _ in pairs)
    assert set(counts) <= set(P.KINDS)
    for kind in P.KINDS:
        assert abs(counts[kind] - n / 3) <= 1


def test_no_duplicates_and_sane_messages(train):
    messages = [m for _, m in train]
    assert len(set(messages)) == len(messages)
    for kind, m in train:
        assert m.strip() and len(m) < 1200
        if kind != "grounded":
            assert "\n" not in m
    assert any("```python" in m for k, m in train if k == "grounded")


def _passages() -> list[str]:
    return [p["passage"] for p in P._bank()["grounded"]["passages"]]


def _snippets() -> list[str]:
    return [s["code"].strip("\n") for s in P._bank()["grounded"]["snippets"]]


def test_enough_distinct_prompts():
    assert sum(P.num_training_prompts().values()) >= 3000
    assert all(v >= 1000 for v in P.num_training_prompts().values())
    assert len(_passages()) >= 40 and len(_snippets()) >= 20
    for code in _snippets():
        assert 4 <= len(code.splitlines()) <= 15
    for kind in P.KINDS:
        assert len(_bench_all(kind)) >= 16


def test_benchmark_shares_no_passage_or_snippet(train):
    train_text = "\x00".join(m for _, m in train)
    bench = _bench_all("grounded")
    bench_text = "\x00".join(bench)
    for m in bench:
        assert _content(m) not in train_text
    for kind, m in train:
        if kind == "grounded":
            assert _content(m) not in bench_text
    used = {_content(m) for m in bench}
    assert any(p in used for p in _passages()) and any("```" in c for c in used)


def test_every_bank_item_on_one_side_only():
    train_text = "\x00".join(m for k in P.KINDS for m in P._training_pool(k))
    bench_text = "\x00".join(m for k in P.KINDS for m in _bench_all(k))
    bank = P._bank()
    banks = [f["topics"] for kind in ("chat", "free") for f in bank[kind]["families"]]
    banks += [_passages(), _snippets()]
    assert len(banks) == 9
    for bank in banks:
        for i, item in enumerate(bank):
            held_out = i % 5 == 4
            assert (item in bench_text) == held_out, item
            assert (item in train_text) != held_out, item


def test_benchmark_prompts_api():
    for kind in P.KINDS:
        first = P.benchmark_prompts(kind, 16)
        assert len(first) == 16 and len(set(first)) == 16
        assert P.benchmark_prompts(kind) == first[:8]
    assert P.benchmark_prompts("grounded", 1)[0] == _bench_all("grounded")[0]


@pytest.mark.parametrize("kind", ["code", "", "Chat"])
def test_bad_kind(kind):
    with pytest.raises(ValueError, match="chat") as err:
        P.benchmark_prompts(kind)
    assert repr(kind) in str(err.value)


@pytest.mark.parametrize("n", [0, -1, 10**6])
def test_bad_benchmark_n(n):
    with pytest.raises(ValueError):
        P.benchmark_prompts("free", n)


def test_bad_training_n():
    with pytest.raises(ValueError):
        P.training_prompts(-1)
    with pytest.raises(ValueError):
        P.training_prompts(10**6)
