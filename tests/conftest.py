"""Shared fixtures: the real model and its independent reference (HF transformers), loaded once."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from properties import load_profile  # noqa: E402

# Triton reads its interpreter switch when it is first imported, and loading the model may
# import it: switch it on (no GPU) before any test or fixture runs.
from minillm.device import setup_triton  # noqa: E402

setup_triton()
load_profile()    # hypothesis: a fixed seed in CI, random seeds under `make soak`


@pytest.fixture(scope="session", autouse=True)
def plans_keep_their_limits():
    """Every plan any scheduler makes during the session is checked against its token budget
    and sequence limit (``plan_limits``); a plan breaking a rule fails the test that made it."""
    from plan_limits import checked

    from minillm.engine.scheduler import Scheduler

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Scheduler, "schedule", checked(Scheduler.schedule))
        yield


@pytest.fixture(scope="session")
def gguf_path():
    from minillm.checkpoint import find_smollm2_gguf

    return find_smollm2_gguf()


@pytest.fixture(scope="session")
def real():
    """(model, tokenizer): SmolLM2-135M-Instruct in fp32 on the CPU."""
    import minillm

    return minillm.load_model("smollm2-135m", device="cpu", dtype="float32")


def hf_conversion(gguf_path: Path) -> Path:
    """A folder holding HF transformers' own conversion of the GGUF file (its GGUF loader's
    model, fp32, as safetensors with its config, and its tokenizer), made once per file and
    transformers version in the temporary directory. Converting takes about 25 s; every later
    test process (the other xdist worker, the next run) loads the folder in about 2 s. The
    reference stays HF's: the folder holds what its loader produced, nothing of ours."""
    import transformers
    from filelock import FileLock
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:"
                         f"{transformers.__version__}".encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"minillm-hf-reference-{key}"
    with FileLock(f"{folder}.lock"):
        if not (folder / "done").exists():
            where = dict(pretrained_model_name_or_path=gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
            model.config.save_pretrained(folder)  # save_pretrained refuses GGUF-loaded models
            save_model(model, str(folder / "model.safetensors"))     # (tied weights once)
            AutoTokenizer.from_pretrained(**where).save_pretrained(folder)
            (folder / "done").touch()
    return folder


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    """HF transformers' tokenizer of the GGUF file (its GGUF loader's, via ``hf_conversion``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_conversion(gguf_path))


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    """HF transformers' own GGUF loader and Llama implementation, fp32 (its default attention,
    SDPA, as when loading the GGUF file directly)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_conversion(gguf_path), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny():
    import minillm

    return minillm.load_model("tiny", device="cpu", dtype="float32")


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """``forget(*libraries)``: from then on in the test, CXX names no compiler, the build cache
    is empty and those CPU kernel libraries (``kernels.cpu_build.Library``) rebuild, and fail;
    after the test they load again as before."""
    forgotten = []

    def forget(*libraries) -> None:
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
        monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
        for library in libraries:
            library.clear()
            forgotten.append(library)

    yield forget
    monkeypatch.undo()
    for library in forgotten:
        library.clear()
