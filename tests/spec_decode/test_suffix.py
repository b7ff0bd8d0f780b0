"""Suffix decoding: the tries against brute-force substring counts, the draft against the most
frequent continuation, the global trie across requests and its memory cap, bad options."""
from __future__ import annotations

import random

import pytest
import torch
from engine_checks import assert_all_free, prompts_of, run_all, sharp_model
from hypothesis import given, settings
from hypothesis import strategies as st
from properties import examples

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.spec_decode import SpeculativeConfig, build_speculator
from minillm.spec_decode.suffix import SuffixProposer, SuffixTrie

texts = st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=4)


def counts_of(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every substring the trie holds with its count."""
    out, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for t, child in node.children.items():
            out[path + (t,)] = child.count
            stack.append((path + (t,), child))
    return out


def brute_counts(texts: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    for text in texts:
        for i in range(len(text)):
            for n in range(1, depth + 1):
                if i + n <= len(text):
                    key = tuple(text[i:i + n])
                    out[key] = out.get(key, 0) + 1
    return out


@settings(max_examples=examples(200))
@given(texts, st.integers(1, 5), st.data())
def test_trie_counts_every_substring_and_forgets_removed_texts(texts, depth, data):
    trie = SuffixTrie(depth)
    for key, text in enumerate(texts):
        cut = data.draw(st.integers(0, len(text)))     # appended in two pieces
        trie.extend(key, text[:cut])
        trie.extend(key, text[cut:])
    assert counts_of(trie) == brute_counts(texts, depth)
    gone = data.draw(st.sets(st.integers(0, len(texts) - 1)))
    for key in gone:
        trie.remove(key)
    kept = [t for k, t in enumerate(texts) if k not in gone]
    assert counts_of(trie) == brute_counts(kept, depth)
    assert trie.num_tokens == sum(map(len, kept))


def test_the_draft_follows_the_most_frequent_continuation():
    trie = SuffixTrie(3)
    trie.extend(0, [1, 2, 3] * 3 + [1, 2, 9, 7, 1, 2])
    assert trie.match([8, 7, 1, 2])[1] == 2   # "7 1 2" never goes on: "1 2" is the longest
    node, m = trie.match([8, 1, 2])
    assert m == 2
    draft, score = trie.speculate(node, max_nodes=4, min_prob=0.1)
    # "1 2" went on with 3 three times and with 9 once (depth 3 is the trie's last level)
    assert (draft.tokens, draft.parents, score) == ([3, 9], [0, 0], 1.0)
    assert trie.speculate(node, 4, min_prob=0.5)[0].tokens == [3]    # 9 falls below
    deep = SuffixTrie(6)
    deep.extend(0, [1, 2, 3, 4] * 3 + [1, 2, 9])
    draft, score = deep.speculate(deep.match([1, 2])[0], max_nodes=4, min_prob=0.1)
    assert draft.tokens == [3, 4, 1, 2] and draft.parents == [0, 1, 2, 3]   # 9 (0.25) loses
    assert score == pytest.approx(0.75 * 4)


def test_the_draft_grows_with_the_match_and_stays_in_the_room():
    proposer = SuffixProposer(k=8, max_depth=16, max_spec_factor=1.0)
    text = list(range(20)) + [50] + list(range(20))
    assert proposer.draft(1, text[:23], 5, room=8).tokens == [2, 3]          # match "0 1"
    assert proposer.draft(1, text[:27], 5, room=8).tokens == [6, 7, 8, 9, 10, 11]
    assert proposer.draft(1, text[:27], 5, room=2).tokens == [6, 7]


def test_finished_outputs_draft_for_later_requests_within_the_memory_cap():
    proposer = SuffixProposer(k=6, max_depth=16, max_cached_tokens=40)
    rng = random.Random(0)
    answer = [rng.randrange(100, 200) for _ in range(30)]
    proposer.draft(1, [1, 2, 3] + answer, 3, room=6)
    proposer.release(1)                  # its output joins the global trie
    assert proposer.draft(2, [4, 5] + answer[:6], 2, room=6).tokens == answer[6:12]
    for seq in range(3, 10):             # more outputs push the oldest out
        proposer.draft(seq, [1] + [rng.randrange(300, 400) for _ in range(15)], 1, room=6)
        proposer.release(seq)
        assert proposer.history.num_tokens <= 40
    assert proposer.draft(99, [4, 5] + answer[:6], 2, room=6) is None


def test_clear_history_forgets_finished_outputs_but_not_live_sequences():
    proposer = SuffixProposer(k=4, max_depth=16)
    answer = list(range(100, 130))
    proposer.draft(1, [1, 2] + answer, 2, room=4)
    proposer.release(1)
    proposer.draft(2, [7, 8] + answer + [7, 8], 2, room=4)     # live: its own trie
    proposer.clear_history()
    assert proposer.history.num_tokens == 0
    assert proposer.draft(3, [4, 5] + answer[:6], 2, room=4) is None
    assert proposer.draft(2, [7, 8] + answer + [7, 8], 2, room=4).tokens == answer[:2]


@pytest.fixture(scope="module")
def model():
    return sharp_model(torch.float32, max_seq_len=256)


def suffix_engine(model, **options):
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=128, block_size=4, max_num_seqs=4))
    engine.use_speculator(build_speculator({"method": "suffix", "num_speculative_tokens": 8,
                                            **options}, engine))
    return engine


def test_a_repeated_request_is_drafted_from_the_first_ones_output(model):
    prompt = prompts_of([12], seed=4)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = suffix_engine(model)
    first = run_all(engine, [prompt], greedy)[0].outputs[0].token_ids
    rounds = engine.speculator.stats.rounds
    again = run_all(engine, [prompt], greedy)[0].outputs[0].token_ids
    assert again == first
    stats = engine.speculator.stats
    assert stats.rounds - rounds < 12, "40 tokens in fewer than 12 rounds: 3+ per round"
    assert_all_free(engine)


@pytest.mark.parametrize("options, match", [
    ({"suffix_decoding_max_tree_depth": 1}, "max_tree_depth must be an int >= 2"),
    ({"suffix_decoding_min_token_prob": 0.0}, r"min_token_prob must be in \(0, 1\]"),
    ({"suffix_decoding_max_spec_factor": -1}, "max_spec_factor must be > 0"),
    ({"suffix_decoding_max_cached_tokens": 2.5}, "max_cached_tokens must be an int >= 0"),
    ({"num_speculative_tokens": 17}, r"tokens must be in \[1, 16\]"),
    ({"drafter": "x.pt"}, "suffix has no weights"),
])
def test_bad_options_name_themselves(options, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict({"method": "suffix", **options})


def test_suffix_options_belong_to_suffix():
    with pytest.raises(ValueError, match="max_tree_depth is an option of suffix, not of ngram"):
        SpeculativeConfig.from_dict({"method": "ngram", "suffix_decoding_max_tree_depth": 8})


def test_a_memory_cap_below_one_request_is_refused(model):
    with pytest.raises(ValueError, match=r"max_cached_tokens \(100\) must hold at least one "
                                         r"request, the model's context of 256"):
        suffix_engine(model, suffix_decoding_max_cached_tokens=100)
    suffix_engine(model, suffix_decoding_max_cached_tokens=0)      # off is allowed
