"""Running a student's function on ranks: as threads of one process first, then on real
``torch.distributed`` processes (the shared pieces of the ``check_*_on_ranks`` checkers).

An exercise written as one rank runs it talks to the other ranks through a function it is
handed (``pass_on``, ``all_to_all``, ``all_reduce``). Its checker first runs the P ranks as
threads of one process (:class:`SimulatedRanks`: quick, and a rank that skips an exchange is
named instead of hanging), then on gloo processes started by :func:`minillm.parallel.run`
(:func:`on_ranks`). A function defined in a notebook reaches those processes by value
(:func:`shippable`, :class:`ShippedFunction`).
"""
from __future__ import annotations

import builtins
import dis
import functools
import importlib
import marshal
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.launch import run

# --- ranks simulated by threads -------------------------------------------------------------------


class Stranded(AssertionError):
    """A rank waited in an exchange that some other rank will never join."""


class SimulatedRanks:
    """``world_size`` ranks as threads of one process, meeting in :meth:`swap`: a collective
    that every rank must call the same number of times (as with real processes). It counts
    each rank's calls and the bytes it sent; a rank left waiting because another returned
    (or failed) raises :class:`Stranded` instead of hanging."""

    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self.cond = threading.Condition()
        self.rounds: list[list[Any]] = []
        self.calls = [0] * world_size
        self.sent = [0] * world_size
        self.done = [False] * world_size

    def swap(self, rank: int, sends: list[Any]) -> list[Any]:
        """``sends[j]``: what ``rank`` sends to rank j (None: nothing) -> what each rank sent
        to ``rank``, in rank order. Blocks until every rank has made this call."""
        with self.cond:
            n = self.calls[rank]
            self.calls[rank] += 1
            self.sent[rank] += sum(t.numel() * t.element_size() for j, item in enumerate(sends)
                                   if j != rank and item is not None
                                   for t in (item if isinstance(item, list) else [item]))
            if n == len(self.rounds):
                self.rounds.append([None] * self.world_size)
            box = self.rounds[n]
            box[rank] = sends
            self.cond.notify_all()
            full = lambda: all(b is not None for b in box)  # noqa: E731
            self.cond.wait_for(lambda: full() or any(self.done), timeout=self.timeout_s)
            if not full():
                raise Stranded(f"rank {rank} made exchange {n + 1} while another rank never "
                               "did: every rank must make the same exchanges")
            return [box[i][rank] for i in range(self.world_size)]

    def run(self, body: Callable[[int], Any]) -> list[Any]:
        """``body(rank)`` on every rank at once; their results in rank order. Re-raises the
        first error of a rank (a stranded rank's only when no rank failed otherwise)."""
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException | None] = [None] * self.world_size

        def one(rank: int) -> None:
            try:
                results[rank] = body(rank)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors[rank] = e
            finally:
                with self.cond:
                    self.done[rank] = True
                    self.cond.notify_all()

        threads = [threading.Thread(target=one, args=(r,), daemon=True)
                   for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = next((e for e in errors if e is not None and not isinstance(e, Stranded)),
                     next((e for e in errors if e is not None), None))
        if isinstance(first, Stranded):
            raise AssertionError(f"{first} (exchanges per rank: {self.calls})")
        if first is not None:
            raise first
        return results

    def pass_on(self, rank: int) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
        """Rank ``rank``'s ``pass_on``: send a list of tensors to the next rank, return the
        list the previous one sent (copies, as a network would deliver)."""
        def pass_on(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            sends: list[Any] = [None] * self.world_size
            sends[(rank + 1) % self.world_size] = [t.clone() for t in tensors]
            return self.swap(rank, sends)[(rank - 1) % self.world_size]

        return pass_on

    def all_to_all(self, rank: int) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
        """Rank ``rank``'s ``all_to_all``: chunks[j] goes to rank j; returns the chunks the
        ranks sent to this one, in rank order."""
        def all_to_all(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
            assert len(chunks) == self.world_size, (
                f"all_to_all takes one tensor per rank ({self.world_size}), got {len(chunks)}")
            return self.swap(rank, [c.clone() for c in chunks])

        return all_to_all

    def all_reduce(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Rank ``rank``'s ``all_reduce``: ``t`` becomes the sum of every rank's ``t`` (added
        in rank order, so every rank gets the same numbers), in place, and is returned."""
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            got = self.swap(rank, [t.clone()] * self.world_size)
            return t.copy_(functools.reduce(torch.add, got))

        return all_reduce


# --- a function shipped by value ------------------------------------------------------------------


def _global_names(code: types.CodeType) -> set[str]:
    """The global names ``code`` and the functions defined inside it read or write."""
    names = {i.argval for i in dis.get_instructions(code)
             if i.opname in ("LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _by_value(obj: object) -> bool:
    """A Python function that another process cannot import by name (one defined in a
    notebook, a script or a test module, not in minillm)."""
    return isinstance(obj, types.FunctionType) and \
        not (obj.__module__ or "").startswith("minillm")


class ShippedFunction:
    """A function made picklable by value, so that the processes of
    :func:`minillm.parallel.run` can call it although it lives in a notebook (whose
    ``__main__`` they cannot import): its code (``marshal``), defaults and closure, and the
    globals it uses, followed through the other such functions it calls (one shared
    namespace, so they may call each other): modules by name, such functions among the
    defaults and the closure shipped the same way, anything else pickled as usual. Calling
    it rebuilds the functions once in the receiving process."""

    def __init__(self, fn: types.FunctionType) -> None:
        self.name = fn.__name__
        self.functions: dict[str, tuple] = {}
        self.modules: dict[str, str] = {}
        self.values: dict[str, Any] = {}
        self._fn: Callable | None = None
        self._collect(self.name, fn)

    def _collect(self, name: str, fn: types.FunctionType) -> None:
        if name in self.functions:
            return
        closure = tuple(shippable(c.cell_contents) for c in fn.__closure__ or ())
        defaults = tuple(shippable(d) for d in fn.__defaults__ or ()) or None
        kwdefaults = {k: shippable(d) for k, d in (fn.__kwdefaults__ or {}).items()} or None
        self.functions[name] = (marshal.dumps(fn.__code__), defaults, kwdefaults, closure)
        for ref in sorted(_global_names(fn.__code__)):
            if ref not in fn.__globals__ or ref in self.modules or ref in self.values:
                continue
            value = fn.__globals__[ref]
            if isinstance(value, types.ModuleType):
                self.modules[ref] = value.__name__
            elif _by_value(value):
                self._collect(ref, value)
            else:
                self.values[ref] = value

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fn": None}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fn is None:
            ns: dict[str, Any] = {"__builtins__": builtins, "__name__": "shipped"}
            ns.update({k: importlib.import_module(m) for k, m in self.modules.items()})
            ns.update(self.values)
            for name, (code, defaults, kwdefaults, closure) in self.functions.items():
                cells = tuple(types.CellType(c) for c in closure) or None
                f = types.FunctionType(marshal.loads(code), ns, name, defaults, cells)
                f.__kwdefaults__ = kwdefaults
                ns[name] = f
            self._fn = ns[self.name]
        return self._fn(*args, **kwargs)


def shippable(obj: Any) -> Any:
    """``obj`` as the ranks of :func:`minillm.parallel.run` can receive it: a
    :class:`ShippedFunction` for a function they cannot import, else ``obj`` itself."""
    return ShippedFunction(obj) if _by_value(obj) else obj


# --- on real processes ----------------------------------------------------------------------------


class Counted:
    """A communication function that counts its calls."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self.fn(*args)


def timed(fn: Callable, *args: Any, repeats: int = 1) -> tuple[Any, float]:
    """(fn(*args), seconds): on a rank of a process group, the best of ``repeats`` calls, each
    started after a barrier of all ranks."""
    best, out = float("inf"), None
    for _ in range(max(1, repeats)):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - t0)
    return out, best


def on_ranks(worker: Callable, world_size: int, *args: Any, timeout_s: float = 120.0) -> list:
    """``worker(*args)`` on ``world_size`` gloo processes (:func:`minillm.parallel.run`,
    ``timeout_s`` for the whole call); a rank's failure becomes an AssertionError with its
    last lines (a NotImplementedError stays one)."""
    try:
        return run(worker, world_size, *args, backend="gloo", timeout_s=timeout_s)
    except RuntimeError as e:
        lines = [line for line in str(e).splitlines() if line.strip()]
        if any(line.startswith("NotImplementedError") for line in lines[-1:]):
            raise NotImplementedError from None
        raise AssertionError(f"on {world_size} gloo ranks: {lines[0]} ... {lines[-1]}") from None
