"""The vLLM peer of bench throughput / serve (minillm.bench.vllm_peer): without vLLM (CI) the
skip message, the HF folder and the server spec; with .venv-vllm one real offline run."""
import json

import pytest
import torch

from minillm.bench import vllm_peer


def test_missing_interpreter_is_skipped_saying_how_to_set_up(monkeypatch, tmp_path):
    monkeypatch.setenv("MINILLM_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    why = vllm_peer.vllm_missing()
    assert why.startswith("skipped:") and "make setup-vllm" in why
    assert vllm_peer.vllm_version() is None


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return vllm_peer.hf_folder("smollm2-135m", tmp_path_factory.mktemp("hf"))


def test_hf_folder_loads_in_transformers_with_our_logits(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import minillm

    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    model, tok = minillm.load_model("smollm2-135m", device="cpu", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    text = "The history of computing"
    assert AutoTokenizer.from_pretrained(str(folder)).encode(text) == tok.encode(text)
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=1e-4)


def test_server_spec_is_well_formed(folder, monkeypatch):
    monkeypatch.setattr(vllm_peer, "hf_folder", lambda name: folder)
    spec = vllm_peer.vllm_spec(port=8123, threads=2, max_model_len=2048, max_num_seqs=16)
    cmd = spec.command
    assert spec.name == "vllm" and spec.ready_path == "/health"
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--model"] == str(folder) and flags["--port"] == "8123"
    assert flags["--served-model-name"] == "smollm2-135m" and flags["--host"] == "127.0.0.1"
    assert flags["--dtype"] in ("float32", "bfloat16") and flags["--max-num-seqs"] == "16"
    assert spec.extra(7)["ignore_eos"] is True
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] and spec.env["VLLM_CPU_OMP_THREADS_BIND"]


def test_throughput_bench_skips_vllm_without_it(monkeypatch, tmp_path):
    from minillm.bench.throughput import run_throughput_bench, throughput_table

    monkeypatch.setenv("MINILLM_VLLM_PYTHON", str(tmp_path / "python"))
    report = run_throughput_bench(num_requests=2, dtype="float32", device="cpu",
                                  peers=("vllm",), prompt_range=(4, 8), output_range=(2, 3),
                                  say=lambda m: None)
    assert "make setup-vllm" in report["vllm"]["skipped"] and len(report["results"]) == 1
    assert "make setup-vllm" in throughput_table(report)


@pytest.mark.skipif(vllm_peer.vllm_missing() is not None,
                    reason=str(vllm_peer.vllm_missing()))
def test_vllm_offline_greedy_ids_equal_minillm():
    import minillm
    from minillm.config import SamplingParams
    from minillm.engine import EngineConfig, LLMEngine

    model, tok = minillm.load_model("smollm2-135m", device="cpu", dtype="float32")
    prompts = [tok.encode("The history of computing is"), tok.encode("Once upon a time")]
    lens = [8, 6]
    out = vllm_peer.run_offline(prompts, lens, torch.float32, threads=2)
    engine = LLMEngine(model, tok, EngineConfig())
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n,
                                                ignore_eos=True)) for p, n in zip(prompts, lens)]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert out["token_ids"] == [list(done[i]) for i in ids]
    assert out["version"] == vllm_peer.vllm_version()
