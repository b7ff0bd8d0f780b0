"""The front end's output processor over a scripted engine (no model): an inbox merges the deltas
of a request nobody is reading, ``generate`` answers in prompt order and refuses a bad prompt before
queueing any, a stream closed early aborts its request, a stalled engine times out."""
from __future__ import annotations

import time

import pytest
from engine_checks import read_in_turn

from minillm import SamplingParams
from minillm.engine import output_processor as op
from minillm.engine.outputs import CompletionOutput, RequestOutput
from minillm.engine.sequence import Metrics


class ScriptedEngine:
    """An engine whose request for prompt ``"w1 w2 ..."`` produces one word per step (the text
    delta "w1 ", then "w2 ", ...) and finishes with the last; a prompt "bad" is refused."""

    def __init__(self, stall: bool = False) -> None:
        self.stall = stall                  # step() produces nothing (and takes a moment)
        self.words: dict[str, list[str]] = {}
        self.done: dict[str, int] = {}      # words handed out so far, per running request
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.steps = 0

    def validate(self, prompt, params: SamplingParams) -> tuple[list[int], str | None]:
        if prompt == "bad":
            raise ValueError("prompt 'bad' is refused")
        return [len(w) for w in prompt.split()], prompt

    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        self.validate(prompt, params)
        rid = request_id or f"r{len(self.added)}"
        self.added.append(rid)
        self.words[rid], self.done[rid] = prompt.split(), 0
        return rid

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.stall:
            time.sleep(0.01)
            return []
        outs = []
        for rid in list(self.done):
            self.done[rid] += 1
            words, n = self.words[rid], self.done[rid]
            finished = n == len(words)
            text = " ".join(words[:n]) + " "
            c = CompletionOutput(0, text, list(range(n)), None, "length" if finished else None,
                                 words[n - 1] + " ")
            outs.append(RequestOutput(rid, None, [], [c], finished, Metrics(0.0)))
            if finished:
                del self.done[rid]
        return outs

    def abort(self, request_id: str) -> bool:
        if self.done.pop(request_id, None) is None:
            return False
        self.aborted.append(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.done)


def test_the_scripted_engine_is_engine_like():
    engine: op.EngineLike = ScriptedEngine()            # checked by type checkers; here: runs
    assert op.OutputProcessor(engine).generate("a b", None)[0].text == "a b "


def test_a_waiting_request_holds_one_output_with_the_deltas_joined():
    engine = ScriptedEngine()
    proc = op.OutputProcessor(engine)
    a, b = (proc.watch(engine.add_request(p)) for p in ("a1 a2 a3 a4 a5", "b1 b2 b3 b4"))
    for _ in range(3):
        assert proc.next_output(a).outputs[0].text_delta.startswith("a")
    out = proc.next_output(b)               # three steps of b waited, merged into one output
    assert out.outputs[0].text_delta == "b1 b2 b3 " and out.token_ids == [0, 1, 2]
    assert not out.finished
    last = proc.next_output(b)
    assert last.outputs[0].text_delta == "b4 " and last.finished
    assert engine.steps == 4


def test_a_sink_gets_every_output_pushed_and_its_request_is_then_forgotten():
    """The server's way in: outputs pushed to a sink as each step is filed, one per step
    (never merged), the request forgotten after its last one; an inbox request beside it
    still merges, and a sink request has no inbox to read."""
    engine = ScriptedEngine()
    proc = op.OutputProcessor(engine)
    pushed: list[RequestOutput] = []
    a = proc.watch(engine.add_request("a1 a2 a3"), sink=pushed.append)
    b = proc.watch(engine.add_request("b1 b2 b3 b4"))
    with pytest.raises(ValueError, match="inbox"):
        proc.next_output(a)
    for _ in range(3):
        proc.deliver(engine.step())
    assert [o.outputs[0].text_delta for o in pushed] == ["a1 ", "a2 ", "a3 "]
    assert pushed[-1].finished and proc.watched == [b]
    assert proc.next_output(b).outputs[0].text_delta == "b1 b2 b3 "
    c = proc.watch(engine.add_request("c1 c2"), sink=pushed.append)
    proc.forget([c])                      # a client gone: aborted, nothing more pushed
    proc.deliver(engine.step())
    assert engine.aborted == [c] and len(pushed) == 3


def test_merge_joins_deltas_per_completion_and_leaves_the_new_output_alone():
    def output(deltas: list[str]) -> RequestOutput:
        cs = [CompletionOutput(i, "", [], None, None, d) for i, d in enumerate(deltas)]
        return RequestOutput("r", None, [], cs, False, Metrics(0.0))

    old, new = output(["a", "x"]), output(["b", "y"])
    merged = op.merge_outputs(old, new)
    assert [c.text_delta for c in merged.outputs] == ["ab", "xy"]
    assert [c.text_delta for c in new.outputs] == ["b", "y"]
    assert op.merge_outputs(None, new) is new


def test_generate_answers_in_prompt_order_whatever_finishes_first():
    engine = ScriptedEngine()
    prompts = ["a b c d e", "f", "g h h", "i j"]       # finish second, fourth, third, first
    outs = op.OutputProcessor(engine).generate(prompts, SamplingParams())
    assert [o.text for o in outs] == [p + " " for p in prompts]
    assert [o.request_id for o in outs] == engine.added and all(o.finished for o in outs)


def test_generate_refuses_a_bad_prompt_before_queueing_any():
    engine = ScriptedEngine()
    proc = op.OutputProcessor(engine)
    with pytest.raises(ValueError, match="bad"):
        proc.generate(["a b", "bad", "c"])
    with pytest.raises(ValueError, match="one per prompt"):
        proc.generate(["a b", "c"], [SamplingParams()])
    with pytest.raises(ValueError, match="priorities"):
        proc.generate(["a b", "c"], priorities=[1])
    assert engine.added == [] and proc.watched == []


def test_streams_consumed_in_turn_each_get_their_whole_text():
    engine = ScriptedEngine()
    proc = op.OutputProcessor(engine)
    texts = ["a1 a2 a3 a4 a5 a6", "b1 b2 b3"]
    assert read_in_turn([proc.stream(t) for t in texts]) == [t + " " for t in texts]
    assert engine.aborted == [] and proc.watched == []


def test_closing_a_stream_early_aborts_its_request_and_the_other_goes_on():
    engine = ScriptedEngine()
    proc = op.OutputProcessor(engine)
    short, other = proc.stream("a1 a2 a3 a4"), proc.stream("b1 b2 b3")
    assert next(short) == "a1 "
    assert next(other) == "b1 "
    short.close()
    assert engine.aborted == ["r0"] and proc.watched == ["r1"]
    assert "".join(other) == "b2 b3 "
    assert not engine.has_unfinished() and proc.watched == []


def test_a_stalled_engine_times_out_naming_the_waiting_requests():
    engine = ScriptedEngine(stall=True)
    proc = op.OutputProcessor(engine, timeout_s=0.05, explain=lambda ids: f"explained {ids}")
    stream = proc.stream("a b")
    with pytest.raises(TimeoutError, match=r"'r0' \(.*explained \['r0'\]"):
        next(stream)
    assert engine.aborted == ["r0"] and proc.watched == []
    with pytest.raises(ValueError, match="timeout_s"):
        op.OutputProcessor(engine, timeout_s=0)


def test_prompts_and_params_are_normalised():
    assert op.as_prompt_list("hi") == ["hi"] and op.as_prompt_list([1, 2]) == [[1, 2]]
    assert op.as_prompt_list(["a", [1]]) == ["a", [1]] and op.as_prompt_list([]) == []
    sp = SamplingParams(max_tokens=3)
    assert op.one_per_prompt(sp, 2) == [sp, sp]
    assert op.one_per_prompt([None, sp], 2) == [SamplingParams(), sp]
