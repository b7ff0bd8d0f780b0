"""Model sharding on real torch.distributed processes (gloo on CPU) against the single process."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from minillm import parallel
from minillm.checkpoint import random_model
from minillm.config import PRESETS
from minillm.parallel import comm
from minillm.parallel.launch import run
from minillm.parallel.pipeline import bubble_formula, measured_bubble, stage_layers
from minillm.parallel.tensor import check_tp, expected_collectives

ROOT = Path(__file__).resolve().parents[2]


def _model(name: str, **changes):
    model = random_model(PRESETS[name].with_(vocab_size=512, **changes), seed=0).eval()
    return model.requires_grad_(False)


def _ids(batch: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (batch, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def dense():
    model = _model("tiny", n_layers=4)
    ids = _ids(4, 11)
    with torch.no_grad():
        return model, ids, model(ids)


@pytest.fixture(scope="module")
def moe():
    model = _model("moe-tiny", n_layers=2)
    ids = _ids(4, 9, seed=1)
    with torch.no_grad():
        return model, ids, model(ids)


# --- the launcher -----------------------------------------------------------------------------

def _whoami() -> tuple[int, int, int]:
    return dist.get_rank(), dist.get_world_size(), torch.get_num_threads()


def _fail_on_rank_one(pid_dir: str) -> None:
    Path(pid_dir, str(os.getpid())).touch()
    dist.barrier()  # every rank has written its pid
    if dist.get_rank() == 1:
        raise KeyError("rank one gives up")
    dist.barrier()  # the others block here until they are terminated


def _never_called(path: str) -> None:
    Path(path).touch()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_run_returns_every_rank(world):
    assert run(_whoami, world) == [(r, world, 1) for r in range(world)]


def test_failing_rank_raises_with_traceback_and_leaves_no_process(tmp_path):
    with pytest.raises(RuntimeError, match="(?s)rank 1 of 3 failed.*KeyError.*rank one gives up"):
        run(_fail_on_rank_one, 3, str(tmp_path), timeout_s=60)
    pids = [int(p.name) for p in tmp_path.iterdir()]
    assert len(pids) == 3
    time.sleep(0.5)
    for pid in pids:
        status = Path(f"/proc/{pid}/status")
        alive = status.exists() and "zombie" not in status.read_text()
        assert not alive, f"worker {pid} outlived run()"


@pytest.mark.parametrize("kwargs,match", [
    (dict(world_size=0), "world_size must be an int >= 1"),
    (dict(world_size="2"), "world_size must be an int >= 1"),
    (dict(world_size=2, backend="mpi"), "backend must be one of"),
    (dict(world_size=torch.cuda.device_count() + 1, backend="nccl"), "needs one CUDA GPU"),
])
def test_bad_launch_arguments_fail_before_any_process(tmp_path, kwargs, match):
    flag = tmp_path / "started"
    world = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=match):
        run(_never_called, world, str(flag), **kwargs)
    assert not flag.exists()


def test_same_code_runs_under_torchrun():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "-m", "minillm.parallel"], capture_output=True, text=True, env=env,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("TP=2 logits vs single process") == 2, out.stdout


# --- tensor parallelism -----------------------------------------------------------------------

def _check_tp_results(results, model, want) -> None:
    """Every rank has the full logits and did 2 L + 1 all-reduces and 1 all-gather."""
    for r in results:
        torch.testing.assert_close(r["logits"], want, atol=1e-5, rtol=1e-5)
        counts = {op: row["calls"] for op, row in comm.summary(r["events"]).items()}
        assert counts == expected_collectives(model.cfg)


@pytest.mark.parametrize("world", [2, 4])
def test_tp_logits_equal_single_process(dense, world):
    model, ids, want = dense
    results = parallel.tp_logits(model, ids, world)
    _check_tp_results(results, model, want)
    for r in results:
        reduces = [e for e in r["events"] if e.op == "all_reduce"]
        assert all(e.payload == ids.numel() * model.cfg.d_model * 4 for e in reduces)
    # the shards hold 1/P of every matrix; norms are replicated, and so are KV heads when
    # there are more ranks than KV heads
    cfg = model.cfg
    norms = cfg.d_model * (2 * cfg.n_layers + 1)
    extra_kv = cfg.n_layers * 2 * cfg.d_model * cfg.head_dim * (max(world, cfg.n_kv_heads)
                                                                - cfg.n_kv_heads)
    total = sum(p.numel() for p in model.parameters())
    assert sum(r["params"] for r in results) == total + (world - 1) * norms + extra_kv


def test_tp_replicates_kv_heads_when_ranks_exceed_them():
    cfg = PRESETS["tiny"]  # 4 query heads, 2 KV heads
    check_tp(cfg, 4)  # 4 ranks: each KV head on 2 ranks
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        check_tp(cfg.with_(n_heads=6, n_kv_heads=2), 3)
    with pytest.raises(ValueError, match="must divide n_heads=9"):
        check_tp(PRESETS["smollm2-135m"], 2)


def test_tp_bad_world_size_fails_before_any_process(dense):
    model, ids, _ = dense
    with pytest.raises(ValueError, match="n_heads=4"):
        parallel.tp_logits(model, ids, 3)


# --- pipeline parallelism ---------------------------------------------------------------------

@pytest.mark.parametrize("world,n_micro", [(2, 2), (4, 4), (4, 1)])
def test_pp_logits_equal_single_process(dense, world, n_micro):
    model, ids, want = dense
    results = parallel.pp_logits(model, ids, world, n_micro)
    torch.testing.assert_close(results[-1]["logits"], want, atol=1e-5, rtol=1e-5)
    assert all(r["logits"] is None for r in results[:-1])
    for s in range(world):
        assert [m for m, _, _ in results[s]["timeline"]] == list(range(n_micro))
        if s:  # a stage starts micro-batch i only after the previous stage finished it
            for (_, start, _), (_, _, prev_end) in zip(results[s]["timeline"],
                                                       results[s - 1]["timeline"]):
                assert start >= prev_end
        sent = sum(e.sent for e in results[s]["events"] if e.op == "send")
        assert sent == (0 if s == world - 1 else ids.numel() * model.cfg.d_model * 4)


def test_pipeline_helpers():
    assert stage_layers(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert bubble_formula(4, 1) == 0.75 and bubble_formula(2, 3) == 0.25
    # two stages, two micro-batches of one second each: a perfect GPipe schedule
    timelines = [[(0, 0, 1), (1, 1, 2)], [(0, 1, 2), (1, 2, 3)]]
    assert measured_bubble(timelines) == pytest.approx(bubble_formula(2, 2))
    with pytest.raises(ValueError, match=r"world_size must be in \[1, n_layers=4\]"):
        stage_layers(4, 5)


def test_pp_bad_input_fails_before_any_process(dense):
    model, ids, _ = dense
    with pytest.raises(ValueError, match="n_micro must be in"):
        parallel.pp_logits(model, ids, 2, n_micro=5)
    with pytest.raises(ValueError, match="n_layers=4"):
        parallel.pp_logits(model, ids, 8, n_micro=1)


# --- expert parallelism and the hybrid ----------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])
def test_ep_equals_single_process_and_loses_no_token(moe, world):
    model, ids, want = moe
    results = parallel.ep_logits(model, ids, world)
    got = torch.cat([r["logits"] for r in results])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for layer in range(model.cfg.n_layers):
        slots = sum(r["stats"][layer]["slots"] for r in results)
        assert slots == ids.numel() * model.cfg.top_k
    assert any(e.op == "all_to_all" and e.sent > 0 for e in results[0]["events"])


@pytest.mark.parametrize("world", [2, 4])
def test_hybrid_tp_attention_ep_experts(moe, world):
    model, ids, want = moe
    _check_tp_results(parallel.hybrid_logits(model, ids, world), model, want)


def test_ep_bad_input_fails_before_any_process(dense, moe):
    with pytest.raises(ValueError, match="needs an MoE model"):
        parallel.ep_logits(dense[0], dense[1], 2)
    with pytest.raises(ValueError, match="must divide n_experts=8"):
        parallel.ep_logits(moe[0], moe[1], 3)


@pytest.mark.slow
def test_real_model_tp3_equals_single_process(real):
    model, tok = real
    ids = torch.tensor([tok.encode("Tensor parallelism splits every layer across ranks.")])
    with torch.no_grad():
        want = model(ids)
    results = parallel.tp_logits(model, ids, 3)
    for r in results:
        torch.testing.assert_close(r["logits"], want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="n_heads=9"):
        parallel.tp_logits(model, ids, 2)
