"""The command line, run as a user would: ``python -m minillm ...`` in a subprocess."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import minillm
from minillm.cli import stream_text
from minillm.config import SamplingParams
from minillm.generate import generate

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "minillm", *args], input=stdin, cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def real():
    return minillm.load_model("smollm2-135m", device="cpu", dtype="float32")


def greedy_reply(model, tok, messages, max_tokens):
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    new = generate(model, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    new = [i for i in new if i != tok.eos_token_id]
    return tok.decode(new, skip_special_tokens=True)


@pytest.mark.slow
def test_generate_prints_the_greedy_continuation(real):
    model, tok = real
    prompt = "What is 2+2?"
    expected = greedy_reply(model, tok, [{"role": "user", "content": prompt}], 8)
    proc = run_cli("generate", "--prompt", prompt, "--max-tokens", "8", "--temperature", "0",
                   "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"


@pytest.mark.slow
def test_generate_with_quantized_weights(real):
    """--quantization int8: the greedy continuation of the same model quantized in-process."""
    from minillm.quant import quantize_model

    model, tok = real
    quantized = quantize_model(copy.deepcopy(model), "int8")
    prompt = "What is 2+2?"
    expected = greedy_reply(quantized, tok, [{"role": "user", "content": prompt}], 8)
    proc = run_cli("generate", "--prompt", prompt, "--max-tokens", "8", "--temperature", "0",
                   "--device", "cpu", "--quantization", "int8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"


@pytest.mark.slow
def test_chat_keeps_the_history(real):
    model, tok = real
    turns = ["My name is Ada.", "What is my name?"]
    messages, expected = [], ""
    for text in turns:
        messages.append({"role": "user", "content": text})
        answer = greedy_reply(model, tok, messages, 12)
        messages.append({"role": "assistant", "content": answer})
        expected += answer + "\n"
    proc = run_cli("chat", "--max-tokens", "12", "--temperature", "0", "--device", "cpu",
                   stdin="\n".join(turns) + "\nexit\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected


@pytest.mark.parametrize("flag, value, name", [
    ("--temperature", "-1", "temperature"),
    ("--top-p", "1.5", "top_p"),
    ("--top-p", "0", "top_p"),
    ("--max-tokens", "0", "max_tokens"),
    ("--model", "no-such-model", "model name"),
    ("--quantization", "int3", "quantization"),
])
def test_bad_arguments_exit_2_with_one_line(flag, value, name):
    args = ["generate", "--prompt", "hi", "--device", "cpu"]
    if flag != "--model":
        args += ["--model", "tiny"]
    proc = run_cli(*args, flag, value)
    assert proc.returncode == 2
    assert name in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_stream_text_handles_multibyte_characters():
    tok = minillm.checkpoint.loader.smollm2_tokenizer()
    text = "naïve café — 日本語 🙂 done"
    ids = tok.encode(text)
    pieces = list(stream_text(tok, ids))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stream_text_stops_at_eos():
    tok = minillm.checkpoint.loader.smollm2_tokenizer()
    ids = tok.encode("hello") + [tok.eos_token_id] + tok.encode(" world")
    assert "".join(stream_text(tok, ids)) == "hello"


def test_bench_decode_tiny_writes_json_and_png(tmp_path):
    out, fig = tmp_path / "decode.json", tmp_path / "decode.png"
    proc = run_cli("bench", "decode", "--model", "tiny", "--device", "cpu", "--dtypes", "float32",
                   "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1", "--peers", "none",
                   "--out", str(out), "--figure", str(fig))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    for key in ("device", "date", "torch", "threads", "git_commit", "results"):
        assert key in report
    [row] = report["results"]
    assert row["engine"] == "minillm" and row["dtype"] == "float32"
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_decode_rejects_bad_sizes():
    proc = run_cli("bench", "decode", "--model", "tiny", "--device", "cpu", "--new-tokens", "1",
                   "--peers", "none", "--figure", "none")
    assert proc.returncode == 2
    assert "new_tokens" in proc.stderr
