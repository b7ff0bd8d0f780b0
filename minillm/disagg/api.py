"""``DisaggLLM``: a prefill worker and decode workers in their own processes, a router in this one.

    with DisaggLLM("smollm2-135m", num_decode=1, layerwise=True) as llm:
        outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32))
        for piece in llm.stream("Tell me a story"): print(piece, end="")

The router (this process) sends each request to the prefill worker (rank 0) and to the
least-loaded live decode worker, hears the first token from the prefill side and the rest from
the decode side, and turns the token stream into text with its own incremental detokenizer (stop
strings are applied here, as a front end does). It also watches the workers: when a decode
worker dies, its unfinished requests go to another one, recomputed from prompt + tokens so far,
or, with ``standby``, resumed from the prompt KV the prefill worker still keeps; with no decode
worker left the prefill worker serves them whole. Every wait has a timeout. ``generate`` and
``stream`` are ``minillm.LLM``'s, from the same
:class:`~minillm.engine.output_processor.OutputProcessor` (with the router as its engine).
"""
from __future__ import annotations

import itertools
import queue
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.multiprocessing as mp

from ..config import PRESETS, SamplingParams
from ..device import serving_dtype
from ..engine.config import EngineConfig
from ..engine.detokenizer import IncrementalDetokenizer
from ..engine.output_processor import OutputProcessor, Prompt
from ..engine.outputs import CompletionOutput, RequestOutput
from ..engine.sequence import Metrics
from ..runinfo import free_port
from .worker import FAULTS, PREFILL_RANK, ROUTER, WorkerJob, WorkerSpec, worker_main


@dataclass
class Tracked:
    """The router's view of one request."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None
    decode_rank: int | None
    detok: IncrementalDetokenizer | None
    metrics: Metrics = field(default_factory=lambda: Metrics(time.perf_counter()))
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    delta: str = ""
    reroutes: int = 0
    key: str = ""        # the current job's key in the workers' messages (one per dispatch)
    kv_key: str = ""     # the key the prefill worker keeps this request's prompt KV under


class DisaggLLM:
    """Serve ``model`` with 1 prefill and ``num_decode`` decode worker processes.

    ``layerwise``: the prompt's KV goes out layer by layer during the forward pass that
    completes it (else all at once after it). ``standby``: the prefill worker keeps every
    prompt's KV until its request ends, so a request whose decode worker dies resumes without
    recomputing its prompt. ``threads`` per worker (default: the cores split between them).
    ``faults`` {rank: (name, arg)} makes a decode worker exit for real at a point (tests).
    ``engine_options`` are :class:`~minillm.engine.EngineConfig` fields, for every worker.

    The workers run on the CPU and move KV over gloo. (NCCL is not used: its point-to-point
    messages carry no tags, so the per-layer messages of requests in flight together would
    need another way to match them.)"""

    def __init__(self, model: str = "smollm2-135m", *, num_decode: int = 1,
                 layerwise: bool = True, standby: bool = False, dtype=None, seed: int = 0,
                 random_weights: bool = False, threads: int | None = None,
                 timeout_s: float = 120.0, faults: dict | None = None,
                 **engine_options) -> None:
        if isinstance(num_decode, bool) or not isinstance(num_decode, int) or num_decode < 1:
            raise ValueError(f"num_decode must be an int >= 1 (one prefill worker plus at least "
                             f"one decode worker), got {num_decode!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        _check_faults(faults or {}, num_decode)
        EngineConfig(**engine_options)   # bad options fail here, before any process starts
        world = 1 + num_decode
        threads = threads or max(1, torch.get_num_threads() // world)
        dtype, _ = serving_dtype(dtype, torch.device("cpu"))
        self.spec = WorkerSpec(model, dtype, seed, random_weights, dict(engine_options), world,
                               free_port(), layerwise, standby, timeout_s, threads,
                               dict(faults or {}))
        self.tokenizer = _router_tokenizer(model)
        self.timeout_s = timeout_s
        self.requests: dict[str, Tracked] = {}          # not yet handed back finished
        self.finished: OrderedDict[str, Tracked] = OrderedDict()   # the latest finished
        self.by_key: dict[str, Tracked] = {}           # job key -> request, while it runs
        # rid -> {"sent": {...}, "received": {...}, "arrival", "first_token", "first_decode"}:
        # the transfer as each worker saw it and the router's times (perf_counter, one clock)
        self.transfers: dict[str, dict] = {}
        self.dead: set[int] = set()
        self._ids, self._index = itertools.count(), itertools.count()
        self._stats: dict[int, dict] = {}
        self.output_processor = OutputProcessor(self, timeout_s=timeout_s,
                                                explain=self._explain_stall)
        self._start_workers()

    # ---- processes ----------------------------------------------------------------------------
    def _start_workers(self) -> None:
        ctx = mp.get_context("spawn")
        world = self.spec.world_size
        pairs = [(ROUTER, r) for r in range(world)] + [(r, ROUTER) for r in range(world)] + \
            [(r, PREFILL_RANK) for r in range(1, world)]
        self.links = {pair: ctx.Queue() for pair in pairs}
        self.procs = [ctx.Process(target=worker_main, daemon=True, name=f"minillm-disagg{r}",
                                  args=(r, self.spec, self.links))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.pids: dict[int, int] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(self.pids) < world:
            for msg in self._receive(0.2):
                if msg[0] == "error":
                    self.close()
                    raise RuntimeError(f"disaggregated worker {msg[1]} failed to start:\n"
                                       f"{msg[2]}")
                self.pids[msg[1]] = msg[2]
            gone = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
            if gone or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"workers {gone} exited during start-up" if gone else
                                   f"workers not ready within {self.timeout_s} s")

    def _send(self, rank: int, msg: tuple) -> None:
        self.links[ROUTER, rank].put(msg)

    def _receive(self, wait_s: float) -> list[tuple]:
        """What live workers sent (waiting up to ``wait_s`` for the first message). A dead
        worker's queue is not read: its last message may be cut short."""
        deadline = time.monotonic() + wait_s
        while True:
            msgs = []
            for r in range(self.spec.world_size):
                if r in self.dead:
                    continue
                q = self.links[r, ROUTER]
                try:
                    while True:
                        msgs.append(q.get_nowait())
                except queue.Empty:
                    pass
            if msgs or time.monotonic() >= deadline:
                return msgs
            time.sleep(0.002)

    def close(self) -> None:
        """Stop every worker (politely, then by force); the object is unusable afterwards."""
        for r in range(self.spec.world_size):
            if r not in self.dead and hasattr(self, "links"):
                self._send(r, ("stop",))
        for p in getattr(self, "procs", []):
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self) -> DisaggLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        ids, text = self.validate(prompt, params)
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        detok = IncrementalDetokenizer(self.tokenizer, params.stop) if self.tokenizer else None
        tr = Tracked(rid, ids, params, text, None, detok)
        self.requests[rid] = tr
        self._dispatch(tr, ids, params)
        return rid

    def validate(self, prompt: Prompt, params: SamplingParams) -> tuple[list[int], str | None]:
        """Prompt token ids (and text) if the request is acceptable, else ValueError."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n > 1 or params.use_beam_search:
            raise ValueError("disaggregated serving runs one sequence per request: n and "
                             "beam_width must be 1")
        if params.logprobs is not None or params.prompt_logprobs is not None:
            raise ValueError("logprobs and prompt_logprobs are not supported by DisaggLLM")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            return self.tokenizer.encode(prompt), prompt
        ids = [int(i) for i in prompt]
        if not ids:
            raise ValueError("prompt must contain at least one token")
        return ids, None

    def _dispatch(self, tr: Tracked, prompt_ids: list[int], params: SamplingParams,
                  output_ids: list[int] | None = None) -> None:
        """Send ``tr`` to the prefill worker and a decode worker (or, with ``output_ids``, only
        to a decode worker, which pulls the prompt KV the prefill worker kept)."""
        tr.decode_rank = self._pick_decode()
        index = next(self._index)
        tr.key = f"{tr.request_id}#{index}"
        if output_ids is None or tr.decode_rank is None:
            tr.kv_key = tr.key
        self.by_key[tr.key] = tr
        job = WorkerJob(tr.key, index, prompt_ids, params, tr.decode_rank, list(output_ids or []),
                  tr.kv_key)
        if tr.decode_rank is not None:
            self._send(tr.decode_rank, ("expect", job))
        if output_ids is None or tr.decode_rank is None:
            self._send(PREFILL_RANK, ("prefill", job))

    def _pick_decode(self) -> int | None:
        alive = [r for r in range(1, self.spec.world_size) if r not in self.dead]
        if not alive:
            return None
        load = {r: 0 for r in alive}
        for tr in self.requests.values():
            if tr.finish_reason is None and tr.decode_rank in load:
                load[tr.decode_rank] += 1
        return min(alive, key=lambda r: (load[r], r))

    def abort(self, request_id: str) -> bool:
        tr = self.requests.pop(str(request_id), None)
        if tr is None or tr.finish_reason is not None:
            return False
        self._finish(tr, "abort")
        self.finished[tr.request_id] = tr
        return True

    def has_unfinished(self) -> bool:
        return any(tr.finish_reason is None for tr in self.requests.values())

    # ---- the router's loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Read what the workers reported (waiting up to 50 ms for something), re-route the
        requests of dead decode workers; returns the outputs of requests that changed."""
        self._check_workers()
        changed: dict[str, Tracked] = {}
        for msg in self._receive(0.05):
            tr = self._handle(msg)
            if tr is not None:
                changed[tr.request_id] = tr
        outs = [self._output(tr) for tr in changed.values()]
        for tr in changed.values():
            if tr.finish_reason is not None:       # kept a while for inspection, then dropped
                self.finished[tr.request_id] = self.requests.pop(tr.request_id)
                while len(self.finished) > 10_000:
                    self.finished.popitem(last=False)
        return outs

    def _handle(self, msg: tuple) -> Tracked | None:
        kind = msg[0]
        if kind == "error":
            raise RuntimeError(f"disaggregated worker {msg[1]} failed:\n{msg[2]}")
        if kind == "stats":
            self._stats[msg[1]] = msg[2]
            return None
        if kind in ("sent", "received"):
            rid = msg[1].rpartition("#")[0]      # a job key is "request id#index"
            self.transfers.setdefault(rid, {})[kind] = msg[2]
            return None
        tr = self.by_key.get(msg[1])
        if tr is None or tr.finish_reason is not None:
            return None
        if kind == "first" and msg[1] == tr.kv_key:     # from the prefill holding its KV
            if tr.decode_rank is not None:
                self._send(tr.decode_rank, ("first", tr.key, *msg[2:]))
            tr.metrics.first_token = tr.metrics.first_token or time.perf_counter()
            self._timeline(tr, "first_token")
            self._extend(tr, [msg[2]], msg[3])
        elif kind == "tokens" and msg[1] == tr.key:
            self._timeline(tr, "first_decode")
            self._extend(tr, msg[2], msg[3])
        else:
            return None           # an old job's message (re-routed since)
        return tr

    def _timeline(self, tr: Tracked, event: str) -> None:
        """Note when ``event`` first happened to ``tr`` (its arrival with it)."""
        times = self.transfers.setdefault(tr.request_id, {})
        times.setdefault("arrival", tr.metrics.arrival)
        times.setdefault(event, time.perf_counter())

    def _extend(self, tr: Tracked, tokens: list[int], reason: str | None) -> None:
        """Append tokens; the workers end a request at EOS or max_tokens (``reason``), the
        router at a stop string, which may span the prefill worker's token and the decode
        worker's (or a re-route)."""
        for t in tokens:
            tr.tokens.append(t)
            if tr.detok is not None:
                tr.delta += tr.detok.push([t])
                if tr.detok.stopped:
                    return self._finish(tr, "stop")
        if reason is not None:
            self._finish(tr, reason)

    def _finish(self, tr: Tracked, reason: str) -> None:
        tr.finish_reason = reason
        tr.metrics.finished = time.perf_counter()
        if tr.detok is not None:
            tr.delta += tr.detok.finish()
        if tr.decode_rank is not None and tr.decode_rank not in self.dead:
            self._send(tr.decode_rank, ("cancel", tr.key))
        self._send(PREFILL_RANK, ("release", tr.kv_key))
        for key in [k for k, t in self.by_key.items() if t is tr]:
            del self.by_key[key]

    def _output(self, tr: Tracked) -> RequestOutput:
        text = tr.detok.text if tr.detok is not None else ""
        out = CompletionOutput(0, text, list(tr.tokens), None, tr.finish_reason, tr.delta)
        tr.delta = ""
        return RequestOutput(tr.request_id, tr.prompt, tr.prompt_ids, [out],
                             tr.finish_reason is not None, tr.metrics)

    # ---- faults -------------------------------------------------------------------------------
    def _check_workers(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is None or rank in self.dead:
                continue
            if rank == PREFILL_RANK:
                raise RuntimeError(f"the prefill worker exited with code {proc.exitcode}")
            self.dead.add(rank)
            for tr in self.requests.values():
                if tr.finish_reason is None and tr.decode_rank == rank:
                    self._reroute(tr)

    def _reroute(self, tr: Tracked) -> None:
        """Give a request of a dead decode worker to a live one: resume from the kept prompt
        KV (standby) or recompute prompt + tokens so far."""
        tr.reroutes += 1
        if self.spec.standby:
            return self._dispatch(tr, tr.prompt_ids, tr.params, output_ids=tr.tokens)
        self._send(PREFILL_RANK, ("release", tr.kv_key))
        left = replace(tr.params, max_tokens=tr.params.max_tokens - len(tr.tokens))
        self._dispatch(tr, tr.prompt_ids + tr.tokens, left)

    def worker_stats(self, timeout_s: float = 10.0) -> dict[int, dict]:
        """{rank: blocks used/free, blocks held for transfer, requests} of every live worker,
        asked now (the router's loop keeps running while it waits)."""
        alive = [r for r in range(self.spec.world_size) if r not in self.dead]
        self._stats = {}
        for r in alive:
            self._send(r, ("stats",))
        deadline = time.monotonic() + timeout_s
        while not self._stats.keys() >= set(alive):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {sorted(set(alive) - self._stats.keys())} did not "
                                   f"answer within {timeout_s} s")
            self.output_processor.deliver(self.step())   # open streams keep their outputs
        return dict(self._stats)

    # ---- the LLM-style API --------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order (as ``minillm.LLM``)."""
        return self.output_processor.generate(prompts, params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the new text of one request as its tokens arrive (several streams may be
        consumed at once); closing early aborts it."""
        return self.output_processor.stream(prompt, params)

    def _explain_stall(self, request_ids: list[str]) -> str:
        """Where the stuck requests are and what the live workers hold (for a TimeoutError)."""
        where = {rid: (self.requests[rid].decode_rank, len(self.requests[rid].tokens))
                 for rid in request_ids if rid in self.requests}
        return f"(decode rank, tokens): {where}; workers: {self.worker_stats()}"


def _router_tokenizer(model: str):
    """The tokenizer the router detokenizes with (SmolLM2's for its vocabulary), or None."""
    from ..checkpoint.loader import smollm2_tokenizer

    real = PRESETS["smollm2-135m"].vocab_size
    if model not in PRESETS or PRESETS[model].vocab_size == real:
        return smollm2_tokenizer()
    return None


def _check_faults(faults: dict, num_decode: int) -> None:
    for rank, (name, _) in faults.items():
        if not 1 <= rank <= num_decode:
            raise ValueError(f"faults: rank must be a decode worker in [1, {num_decode}], "
                             f"got {rank}")
        if name not in FAULTS:
            raise ValueError(f"faults: name must be one of {FAULTS}, got {name!r}")
