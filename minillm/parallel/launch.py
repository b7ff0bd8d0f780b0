"""Start ``world_size`` processes, give them a process group, return what each rank returned.

``run(fn, world_size, *args)`` is the one entry point. ``fn`` must be importable (defined in a
module, not in a notebook cell) because the workers are *spawned*: fresh interpreters that
import ``fn`` by name. Each worker:

1. sets ``torch.set_num_threads(1)`` (processes, not threads, share the cores),
2. joins a process group over a free loopback port (gloo on CPU, NCCL on GPUs),
3. calls ``fn(*args)``: inside, ``dist.get_rank()`` / ``dist.get_world_size()`` say who it is,
4. sends its return value back (tensors moved to the CPU) or its traceback.

If any rank raises, the others are terminated and the caller gets a ``RuntimeError`` carrying
that rank's traceback; no process outlives the call. Under ``torchrun`` (the environment already
names the rank and world), ``run`` does not spawn: it joins the group torchrun set up, calls
``fn`` and all-gathers the results, so the same script runs either way.
"""
from __future__ import annotations

import io
import os
import queue as queue_mod
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..runinfo import free_port

BACKENDS = ("gloo", "nccl")


def default_backend(world_size: int) -> str:
    """NCCL when there are at least ``world_size`` GPUs, else gloo (CPU processes)."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size \
            and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def check_launch(world_size: int, backend: str | None) -> str:
    """Validate the arguments of :func:`run` and return the backend to use (no process started)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if backend is None:
        return default_backend(world_size)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "gloo" and not dist.is_gloo_available():
        raise ValueError("backend='gloo' is not available in this PyTorch build")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not dist.is_nccl_available() or gpus < world_size:
            raise ValueError(f"backend='nccl' needs one CUDA GPU per rank: world_size="
                             f"{world_size} but this machine has {gpus} GPU(s); use "
                             "backend='gloo' (CPU processes) or a smaller world_size")
    return backend


def under_torchrun() -> bool:
    """True inside a process started by torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR...)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def device_for_rank(rank: int) -> torch.device:
    """The device a rank computes on: its own GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _to_bytes(obj: Any) -> bytes:
    """Serialise a result with its tensors on the CPU (safe after the worker exits)."""
    buf = io.BytesIO()
    torch.save(_cpu(obj), buf)
    return buf.getvalue()


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def _worker(rank: int, world_size: int, port: int, backend: str, timeout_s: float,
            task: str, results) -> None:
    """Body of one process: read (fn, args), join the group, run fn, report the outcome."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        fn, args = torch.load(task, map_location="cpu", mmap=True, weights_only=False)
        out = fn(*args)
        results.put((rank, True, _to_bytes(out)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the caller
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_torchrun(fn: Callable, world_size: int, args: tuple, backend: str) -> list:
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(f"world_size={world_size} but torchrun started "
                         f"{os.environ['WORLD_SIZE']} processes")
    created = not dist.is_initialized()
    if created:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    try:
        out = _cpu(fn(*args))
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, out)
    finally:
        if created:   # a group left alive aborts the process at exit ("terminate called ...")
            dist.barrier()
            dist.destroy_process_group()
    return gathered


def run(fn: Callable, world_size: int, *args: Any, backend: str | None = None,
        timeout_s: float = 300.0) -> list:
    """Run ``fn(*args)`` on ``world_size`` ranks; return ``[result of rank 0, rank 1, ...]``.

    backend: "gloo" (CPU processes), "nccl" (one GPU per rank) or None (NCCL when enough GPUs,
    else gloo). Arguments are checked before any process starts. ``args`` are pickled to every
    worker through one file that each worker memory-maps (a large model is written once, and
    the ranks share its pages until they modify them). A rank that raises makes ``run`` raise
    RuntimeError with that rank's traceback; ``timeout_s`` bounds the whole call (TimeoutError).
    """
    backend = check_launch(world_size, backend)
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {fn!r}")
    if under_torchrun():
        return _run_torchrun(fn, world_size, args, backend)
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    ok, procs = False, []
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # RAM, not disk, when there
    with tempfile.TemporaryDirectory(prefix="minillm-run-", dir=shm) as tmp:
        task = os.path.join(tmp, "task.pt")
        torch.save((fn, _cpu(args)), task)
        try:
            for r in range(world_size):
                procs.append(ctx.Process(target=_worker, daemon=True, name=f"minillm-rank{r}",
                                         args=(r, world_size, port, backend, timeout_s, task,
                                               results)))
                procs[-1].start()
            out = _collect(procs, results, world_size, timeout_s)
            ok = True
            return out
        finally:
            _stop(procs, grace_s=5.0 if ok else 0.0)
            results.close()


def _context():
    """A forkserver context whose server has imported torch and minillm once: each later run
    forks ready workers in a fraction of a second instead of spawning fresh interpreters."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "minillm.parallel.workers", "minillm.parallel.sequence"])
    return ctx


def _collect(procs: list, results, world_size: int, timeout_s: float) -> list:
    """Wait for every rank's report; raise at the first failure, crash or timeout."""
    out: list = [None] * world_size
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout_s
    while pending:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue_mod.Empty:
            dead = [r for r in pending if procs[r].exitcode is not None]
            if dead:  # died without reporting (killed, segfault): give its queue a moment
                try:
                    rank, ok, payload = results.get(timeout=2.0)
                except queue_mod.Empty:
                    raise RuntimeError(f"rank {dead[0]} exited with code "
                                       f"{procs[dead[0]].exitcode} without a result") from None
            elif time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(pending)} did not finish within "
                                   f"{timeout_s:.0f} s") from None
            else:
                continue
        if not ok:
            raise RuntimeError(f"rank {rank} of {world_size} failed:\n{payload}")
        out[rank] = _from_bytes(payload)
        pending.discard(rank)
    return out


def _stop(procs: list, grace_s: float) -> None:
    """Give workers ``grace_s`` to exit; terminate, then kill, any still running."""
    for p in procs:
        p.join(timeout=grace_s)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join()
