"""The LLM front end's text: streamed pieces join to the generated text (multibyte characters split
over tokens, bytes that are no UTF-8), several streams read in turn, a stop string spanning tokens
never leaks, one SamplingParams per prompt, and the real model's CJK and emoji.

Reference: the tokenizer's decode of the same ids.
"""
from __future__ import annotations

import pytest
from engine_checks import assert_all_free

import minillm
from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.engine.output_processor import OutputProcessor

TEXTS = ["Café au lait, s'il vous plaît", "Emoji 😀🎉 and more 🚀", "日本語のテキスト",
         "naïve façade"]


@pytest.fixture(scope="module")
def tiny_llm():
    return minillm.LLM("tiny", dtype="float32", num_kv_blocks=200)


def test_stream_joins_to_the_generated_text(tiny_llm):
    """Random weights emit arbitrary byte tokens (characters split over tokens, and bytes that
    are no UTF-8 at all): the streamed pieces join to generate()'s text, which is the
    tokenizer's decode of the same ids minus an incomplete last character."""
    llm = tiny_llm
    tok = llm.tokenizer
    for i, text in enumerate(TEXTS):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True)
        pieces = list(llm.stream(text, params))
        out = llm.generate([text], params, use_tqdm=False)[0]
        full = tok.decode(out.token_ids)
        assert "".join(pieces) == out.text == full.removesuffix("\ufffd")
        # U+FFFD only where the ids are not valid UTF-8 at all, never a character cut in two
        assert sum(p.count("\ufffd") for p in pieces) == full.removesuffix("\ufffd").count("\ufffd")
    assert_all_free(llm.engine)


def test_several_streams_at_once(tiny_llm):
    llm = tiny_llm
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True)
              for s in range(3)]
    streams = [llm.stream(t, p) for t, p in zip(TEXTS, params)]
    got = ["", "", ""]
    live = set(range(3))
    while live:
        for i in sorted(live):
            try:
                got[i] += next(streams[i])
            except StopIteration:
                live.discard(i)
    want = [o.text for o in llm.generate(TEXTS[:3], params, use_tqdm=False)]
    assert got == want
    assert_all_free(llm.engine)


def test_stop_string_spanning_tokens_never_leaks(tiny_llm):
    llm = tiny_llm
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = llm.generate(["The weather today"], params, use_tqdm=False)[0]
    ids, tok = full.token_ids, llm.tokenizer
    pieces = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
    # a stop string made of the end of token 9's text and the start of token 10's
    a, b = pieces[9], pieces[11]
    stop = b[len(a) - 2:len(a) + 3]
    assert len(stop) == 5 and stop in full.text
    stopped = llm.generate(["The weather today"], SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, stop=(stop,)), use_tqdm=False)[0]
    streamed = "".join(llm.stream("The weather today", SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, stop=(stop,))))
    assert stopped.text == streamed == full.text[:full.text.index(stop)]
    assert stopped.outputs[0].finish_reason == "stop"


def test_generate_takes_one_params_per_prompt_and_token_ids(tiny_llm):
    llm = tiny_llm
    outs = llm.generate([[5, 6, 7], "Hello"], [SamplingParams(temperature=0, max_tokens=3),
                                               SamplingParams(temperature=0, max_tokens=5)],
                        use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 5] and outs[0].prompt_token_ids == [5, 6, 7]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    assert_all_free(llm.engine)



@pytest.mark.slow
def test_real_model_streams_multibyte_text(real):
    """The real model asked for emoji and Japanese: the stream holds no broken character and
    joins to generate()'s text."""
    model, tok = real
    llm = OutputProcessor(LLMEngine(model, tok, EngineConfig(num_kv_blocks=64)))  # LLM's loops
    prompt = tok.apply_chat_template([{"role": "user", "content":
                                       "Say 'good morning' in Japanese and add two emoji."}],
                                     add_generation_prompt=True)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    pieces = list(llm.stream(prompt, params))
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert "".join(pieces) == out.text and not any("\ufffd" in p for p in pieces)
    assert any(ord(ch) > 0x2FFF for ch in out.text)        # it did write CJK or emoji
    assert_all_free(llm.engine)
