"""lm-evaluation-harness through the server, offline: ``local-completions`` with the server's own
tokenizer routes (``tokenizer_backend=remote``) on the two small tasks in benchmarks/lm_eval/.

Each choice's log-likelihood lm-eval reads from the server (echo, logprobs for every prompt
token) equals the offline engine's (``LLM`` with ``prompt_logprobs``, fp32) within 1e-3, and
the multiple-choice accuracy equals lm-eval's own ``hf`` backend on the same GGUF file.
"""
from __future__ import annotations

import os

import pytest
import torch
from test_serve import running

import minillm
from minillm import SamplingParams
from minillm.serve.api import create_app

# Offline before lm-eval (and the datasets library it imports) reads these switches.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
TASKS = ["minillm_mc", "minillm_gen"]


@pytest.fixture(scope="module")
def llm():
    return minillm.LLM(MODEL, dtype=torch.float32, max_num_seqs=16)


def evaluate(model: object, model_args: str, tasks: list[str]) -> dict:
    """lm-eval's ``simple_evaluate`` of ``model`` (a registered name with ``model_args``, or an
    lm-eval LM object) on our task folder, samples kept."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from test_layout import ROOT

    manager = TaskManager(include_path=str(ROOT / "benchmarks" / "lm_eval"),
                          include_defaults=False)     # our two tasks: no index of 14k
    return simple_evaluate(model=model, model_args=model_args, tasks=tasks,
                           task_manager=manager, log_samples=True, batch_size=1)


def engine_loglikelihoods(llm, pairs: list[tuple[str, str]]) -> list[float]:
    """log P(continuation | context) for each (context, continuation) pair, from the offline
    engine's prompt logprobs in one batched call, each pair split as lm-eval splits it (the
    context's tokens, then the rest of the whole's)."""
    wholes = [llm.tokenizer.encode(context + continuation) for context, continuation in pairs]
    starts = [len(llm.tokenizer.encode(context)) for context, _ in pairs]
    outs = llm.generate(wholes, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    return [sum(out.prompt_logprobs[i][whole[i]] for i in range(start, len(whole)))
            for out, whole, start in zip(outs, wholes, starts)]     # one {token: logprob} each


def test_lm_eval_through_the_server_equals_the_offline_engine_and_hf(llm, hf_model,
                                                                     hf_tokenizer):
    with running(create_app(llm.engine, MODEL)) as url:
        ours = evaluate("local-completions",
                        f"model={MODEL},base_url={url}/v1/completions,"
                        f"tokenizer_backend=remote,tokenized_requests=True,num_concurrent=1",
                        TASKS)
    samples = ours["samples"]["minillm_mc"]
    assert len(samples) == 20
    pairs = [tuple(pair) for sample in samples for pair in sample["arguments"]]
    got = [resp[0][0] for sample in samples for resp in sample["resps"]]
    for pair, g, want in zip(pairs, got, engine_loglikelihoods(llm, pairs), strict=True):
        assert g == pytest.approx(want, abs=1e-3), pair
    gen = ours["samples"]["minillm_gen"]
    assert len(gen) == 10 and all(isinstance(s["resps"][0][0], str) for s in gen)
    from lm_eval.models.huggingface import HFLM

    # lm-eval's own hf backend over HF's model of the same GGUF file (the session's fixture:
    # transformers' GGUF loader, fp32), not over ours
    hf = evaluate(HFLM(pretrained=hf_model, tokenizer=hf_tokenizer, batch_size=1), "",
                  ["minillm_mc"])
    acc = ours["results"]["minillm_mc"]["acc,none"]
    assert acc == hf["results"]["minillm_mc"]["acc,none"]
