"""The server's engine loop: one background thread owns the engine and batches every request.

The engine is not thread-safe, so only this thread touches it. HTTP handlers (on the asyncio
event loop) talk to it through a thread-safe command queue, and it answers through each job's
``asyncio.Queue`` with ``loop.call_soon_threadsafe``:

    handler                         engine thread
    job = loop.submit(prompts, p)   -> ("add", job)    validate + add_request, one per prompt
    await job.accepted              <- True or the ValueError (a 400 before any byte is sent)
    async for i, out in job         <- (prompt index, RequestOutput) after each step it changed
    job.close()                     -> ("abort", job)  a client gone early: blocks freed

The thread files each step's outputs through an
:class:`~minillm.engine.output_processor.OutputProcessor` (what ``minillm.LLM`` uses), which
pushes each to its job's queue. Between two steps the thread takes every pending command, so
requests that arrive while a step runs join the next one (continuous batching); with nothing
to run it sleeps on the queue.
``max_queue`` caps the engine requests waiting beyond a full batch: :meth:`EngineLoop.submit`
raises :class:`QueueFull` when more than ``max_num_seqs + max_queue`` would be in flight.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..config import SamplingParams
from ..device import release_openmp_threads
from ..engine.engine import LLMEngine
from ..engine.output_processor import OutputProcessor
from ..engine.outputs import EngineStats, RequestOutput
from .metrics import ServerMetrics

Prompt = str | list[int]
IDLE_WAIT = 0.1      # seconds the idle thread sleeps on the command queue between checks


class QueueFull(Exception):
    """The server holds as many requests as it may (answered with 503)."""


class EngineStopped(Exception):
    """The engine loop stopped (shutdown, or the engine failed) before the request finished."""


@dataclass(eq=False)
class Job:
    """One HTTP request's engine requests (one per prompt) and the queue their outputs go to.
    Created and consumed on the event loop; the engine thread only calls :meth:`put`."""

    job_id: str
    prompts: list[Prompt]
    params: SamplingParams
    owner: EngineLoop
    aio: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    accepted: asyncio.Future = field(init=False)
    outputs: asyncio.Queue = field(init=False, default_factory=asyncio.Queue)
    unfinished: set[int] = field(init=False)
    closed: bool = False

    def __post_init__(self) -> None:
        self.accepted = self.aio.create_future()
        self.unfinished = set(range(len(self.prompts)))

    @property
    def request_ids(self) -> list[str]:
        return [f"{self.job_id}-{i}" for i in range(len(self.prompts))]

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def put(self, item: tuple[int, RequestOutput] | BaseException) -> None:
        """Hand an output (or the error that ends the job) to the event loop; thread-safe."""
        self._call(self.outputs.put_nowait, item)

    def settle(self, error: BaseException | None = None) -> None:
        """Accept the job, or refuse it with ``error``; thread-safe, the first verdict counts."""
        self._call(_settle, self.accepted, error)

    def _call(self, fn, *args) -> None:
        try:
            self.aio.call_soon_threadsafe(fn, *args)   # FIFO: a verdict precedes the outputs
        except RuntimeError:      # the event loop is closed: nobody is listening any more
            pass

    async def next(self) -> tuple[int, RequestOutput]:
        """The next (prompt index, output); raises what ended the job early."""
        item = await self.outputs.get()
        if isinstance(item, BaseException):
            raise item
        if item[1].finished:
            self.unfinished.discard(item[0])
        return item

    def __aiter__(self) -> Job:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if self.finished:
            raise StopAsyncIteration
        return await self.next()

    def close(self) -> None:
        """The handler is done with the job: abort what is unfinished and free its place."""
        if not self.closed:
            self.closed = True
            self.owner.release(self)


class EngineLoop:
    """The thread that steps ``engine``; see the module docstring for the protocol."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None,
                 max_queue: int = 1024) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.outputs = OutputProcessor(engine)     # the engine thread's only
        self.metrics = metrics or ServerMetrics()
        self.capacity = engine.config.max_num_seqs + max_queue
        self.in_flight = 0               # engine requests of open jobs (event loop side only)
        self.stats: EngineStats = engine.stats()     # the latest, published by the thread
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[str, tuple[Job, int]] = {}   # engine request id -> (job, prompt index)
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)

    # ---- event loop side -------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread. The starting thread (``serve``'s, which loaded the model)
        first gives back its OpenMP workers, so that the engine thread's are the only ones and
        stay awake between operators (:func:`minillm.device.release_openmp_threads`)."""
        release_openmp_threads()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def submit(self, prompts: Sequence[Prompt], params: SamplingParams) -> Job:
        """Queue one engine request per prompt (await ``job.accepted`` for the verdict)."""
        if not self.alive:
            raise EngineStopped("the engine loop is not running")
        if self.in_flight + len(prompts) > self.capacity:
            raise QueueFull(f"the server holds {self.in_flight} requests, at most "
                            f"{self.capacity}; retry later")
        job = Job(f"req-{next(self._ids)}", list(prompts), params, self,
                  asyncio.get_running_loop())
        self.in_flight += len(job.prompts)
        self._commands.put(("add", job))
        return job

    def release(self, job: Job) -> None:
        self.in_flight -= len(job.prompts)
        if not job.finished:
            self._commands.put(("abort", job))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every unfinished request and end the thread."""
        self._stopping.set()
        self._commands.put(("wake", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._take_commands(wait=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self.outputs.deliver(self.engine.step())
                self.stats = self.engine.stats()
        except BaseException as e:          # a bug in the engine: fail loudly, never hang
            self.error = e
            self._stopping.set()
        finally:
            self._abort_all(EngineStopped(f"the engine stopped: {self.error!r}" if self.error
                                          else "the server is shutting down"))

    def _take_commands(self, wait: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT) if wait else \
                self._commands.get_nowait()
            while True:
                self._do(*command)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _do(self, verb: str, job: Job | None) -> None:
        if verb == "add":
            self._add(job)
        elif verb == "abort":
            self._abort(job)

    def _add(self, job: Job) -> None:
        """Validate every prompt first, so a bad one leaves nothing queued; a failure past
        validation takes back what was added. Only an engine bug escapes (after refusing)."""
        try:
            checked = [self.engine.validate(p, job.params)[0] for p in job.prompts]
            for rid, i, ids in zip(job.request_ids, itertools.count(), checked):
                self.engine.add_request(ids, job.params, request_id=rid,
                                        arrival_time=job.arrival)
                self._jobs[rid] = (job, i)
                self.outputs.watch(rid, sink=functools.partial(self._to_client, rid))
        except ValueError as e:
            self._abort(job)
            job.settle(e)
            return
        except BaseException as e:
            job.settle(EngineStopped(f"the engine failed: {e!r}"))
            raise
        job.settle()

    def _abort(self, job: Job) -> None:
        for rid in job.request_ids:
            if self._jobs.pop(rid, None) is not None:
                self.outputs.forget([rid])           # aborts it in the engine

    def _to_client(self, request_id: str, out: RequestOutput) -> None:
        """The sink of one engine request: its output to its job's queue."""
        job, index = self._jobs.pop(request_id) if out.finished else self._jobs[request_id]
        if out.finished:
            self.metrics.observe_finished(out)
        job.put((index, out))

    def _abort_all(self, error: BaseException) -> None:
        jobs = {job for job, _ in self._jobs.values()}
        self.outputs.forget(list(self._jobs))      # aborts them in the engine
        self._jobs.clear()
        while True:                      # requests never added: answer them too
            try:
                verb, job = self._commands.get_nowait()
            except queue.Empty:
                break
            if verb == "add":
                jobs.add(job)
        for job in jobs:
            job.settle(error)
            job.put(error)
        self.stats = self.engine.stats()


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        future.set_result(True) if error is None else future.set_exception(error)
