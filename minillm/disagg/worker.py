"""The two kinds of worker process of a disaggregated pair, and the messages between them.

Control messages are tuples on multiprocessing queues, one queue per (sender, receiver) pair
(``links[(src, dst)]``, the router is :data:`ROUTER`): a worker killed while writing can then
jam only its own queues, never another sender's. KV moves over ``torch.distributed``
(:mod:`.transfer`). Ranks: the prefill worker is
rank 0, decode workers are ranks 1..n. The protocol, for each request:

1. router -> prefill: ``("prefill", job)``; router -> its decode worker: ``("expect", job)``.
2. decode -> prefill: ``("pull", rid, rank, index)`` once it has room (blocks allocated,
   receives posted): the decode side pulls, as in DistServe and Mooncake.
3. prefill computes the prompt and samples the first token, ``("first", rid, token, finished,
   time)`` to the router and the decode worker. Its layers go to the puller as soon as both the
   pull and the KV are there: with ``layerwise``, from inside the forward pass of the step that
   completes the prompt, one layer after the other while the next layers compute.
4. decode: all layers in -> scatter into its blocks, ``("ack", rid)`` to prefill, and the request
   joins its running batch (``LLMEngine.add_prefilled``); tokens go to the router as they come.
   A request that the first token already finished is dropped (``("dropped", rid)`` if it was
   never pulled), so every request ends its prefill-side hold with exactly one ack or drop.

The prefill worker keeps a prompt's blocks (``LLMEngine.hold_kv``) until that ack; with
``standby`` (DejaVu-style) it keeps them until the router's ``("release", rid)`` at the end of
the request, so a re-routed request can pull its prompt KV again instead of recomputing it.
Workers use the engine's public API; their KV connector (:class:`WorkerConnector`) is how they
read and write its KV pool, and how the prefill worker sends layers from inside the forward.
"""
from __future__ import annotations

import os
import queue
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from ..cache.block_manager import blocks_for
from ..cache.pool import PagedKVPool
from ..config import SamplingParams
from ..engine.config import EngineConfig
from ..engine.connector import KVConnector
from ..engine.engine import LLMEngine
from ..engine.plan import SchedulerOutput
from .transfer import (
    Transfer,
    Waiter,
    receive_all,
    scatter,
    send_layer,
    send_tensor,
    staging_buffer,
)

PREFILL_RANK = 0
ROUTER = -1
FAULTS = ("exit_after_pull", "exit_after_tokens")


@dataclass
class WorkerJob:
    """One request as a worker sees it: ``request_id`` is the job's key (a request re-routed
    gets a new one). ``index``: its transfer number (message tags).
    ``decode_rank`` None: the prefill worker runs it to the end (no decode worker is left).
    ``output_ids``: tokens generated before a re-route (a standby resume continues after them)."""

    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    decode_rank: int | None
    output_ids: list[int] = field(default_factory=list)
    kv_key: str = ""     # the prefill-side key of the prompt KV to pull (its first job's)


@dataclass
class WorkerSpec:
    """What every worker process needs to start (picklable)."""

    model: str
    dtype: torch.dtype
    seed: int
    random_weights: bool
    engine_options: dict
    world_size: int
    port: int
    layerwise: bool = True
    standby: bool = False
    timeout_s: float = 60.0
    threads: int = 1
    faults: dict = field(default_factory=dict)   # rank -> (fault name, argument)


def worker_main(rank: int, spec: WorkerSpec, links: dict) -> None:
    """Body of worker ``rank``: join the group, load the model, serve until ``("stop",)``."""
    torch.set_num_threads(spec.threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank,
                                world_size=spec.world_size,
                                timeout=timedelta(seconds=spec.timeout_s))
        from ..checkpoint.loader import load_model
        model, tok = load_model(spec.model, device="cpu", dtype=spec.dtype, seed=spec.seed,
                                random_weights=spec.random_weights)
        connector = WorkerConnector()
        engine = LLMEngine(model, tok, EngineConfig(**spec.engine_options,
                                                    kv_connector=connector))
        role = PrefillWorker if rank == PREFILL_RANK else DecodeWorker
        worker = role(rank, engine, spec, links, connector)
        links[rank, ROUTER].put(("ready", rank, os.getpid()))
        worker.serve()
    except BaseException:  # noqa: BLE001 - every failure goes back to the router
        links[rank, ROUTER].put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class WorkerConnector(KVConnector):
    """A worker's KV connector: the engine's KV pool for the worker's transfers, and, on the
    prefill worker, the layer-by-layer sends of the step that completes a pulled prompt (its
    scheduler half notes the held prompts a plan completes; the runner calls ``save_layer``
    after each layer)."""

    def __init__(self) -> None:
        self.pool: PagedKVPool | None = None
        self.sender: PrefillWorker | None = None

    def register_kv_pool(self, pool: PagedKVPool, tables: dict[int, list[int]]) -> None:
        self.pool = pool

    def build_meta(self, plan: SchedulerOutput) -> list[tuple[str, list[int]]]:
        return self.sender.completing_prompts(plan) if self.sender is not None else []

    def start_load(self, plan: SchedulerOutput) -> dict[int, int]:
        if self.sender is not None:
            self.sender.start_streams(plan.connector_meta)
        return {}

    def save_layer(self, layer: int) -> None:
        if self.sender is not None:
            self.sender.layer_done(layer)


class Worker:
    """The loop both roles share: read messages, note finished transfers, step the engine."""

    def __init__(self, rank: int, engine: LLMEngine, spec: WorkerSpec, links: dict,
                 connector: WorkerConnector) -> None:
        self.rank, self.engine, self.spec, self.links = rank, engine, spec, links
        self.kv = connector
        self.incoming = [q for (src, dst), q in sorted(links.items()) if dst == rank]
        self.jobs: dict[str, WorkerJob] = {}
        self.sent_tokens: dict[str, int] = {}      # request -> output tokens reported so far
        self.waiter = Waiter(spec.timeout_s)
        self.fault = spec.faults.get(rank)
        self.deferred: list[tuple] = []    # messages read during a forward pass

    def send(self, dst: int, msg: tuple) -> None:
        self.links[self.rank, dst].put(msg)

    def serve(self) -> None:
        while True:
            for msg in self._drain(block=not self.engine.has_unfinished()):
                if msg[0] == "stop":
                    return
                if msg[0] == "stats":
                    self.send(ROUTER, ("stats", self.rank, self.stats()))
                else:
                    self.handle(msg)
            for transfer in self.waiter.finished():
                self.transfer_done(transfer)
            self.work()

    def _drain(self, block: bool) -> list:
        """The messages read during a forward pass, then every message waiting."""
        msgs, self.deferred = self.deferred + self._read(block), []
        return msgs

    def _read(self, block: bool) -> list:
        """Every message waiting on the incoming queues (waiting up to 5 ms if ``block``)."""
        msgs = []
        for i, q in enumerate(self.incoming):
            try:
                msgs.append(q.get(timeout=0.005) if block and i == 0 else q.get_nowait())
                while True:
                    msgs.append(q.get_nowait())
            except queue.Empty:
                pass
        return msgs

    def stats(self) -> dict:
        s = self.engine.stats()
        return {"num_used": s.blocks_used, "num_free": s.blocks_free, "held": s.num_held,
                "requests": len(self.engine.requests)}

    def report_tokens(self, outs) -> None:
        for out in outs:
            c = out.outputs[0]
            sent = self.sent_tokens.get(out.request_id, 0)
            self.send(ROUTER, ("tokens", out.request_id, list(c.token_ids[sent:]),
                             c.finish_reason if out.finished else None, time.perf_counter()))
            self.sent_tokens[out.request_id] = len(c.token_ids)
            if out.finished:
                self.sent_tokens.pop(out.request_id, None)
                self.jobs.pop(out.request_id, None)

    def handle(self, msg: tuple) -> None:
        raise NotImplementedError

    def transfer_done(self, transfer: Transfer) -> None:
        raise NotImplementedError

    def work(self) -> None:
        raise NotImplementedError


class PrefillWorker(Worker):
    """Computes prompts and their first tokens; keeps each prompt's blocks until it is pulled."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.seq_of: dict[str, int] = {}          # request -> its (held) sequence id
        self.pulls: dict[str, tuple[int, int]] = {}   # pulled, not yet sent: (rank, index)
        self.kv_ready: dict[str, float] = {}      # prompt KV complete since (perf_counter)
        self.streaming: list[tuple[str, Transfer, list[int]]] = []
        self.completing: list[tuple[str, list[int]]] = []    # this step's, not yet pulled
        self.sending: dict[str, Transfer] = {}
        self.over: OrderedDict[str, None] = OrderedDict()   # released requests (recent ones)
        self.kv.sender = self

    def handle(self, msg: tuple) -> None:
        kind, rid = msg[0], msg[1]
        if kind == "prefill":
            self._start(msg[1])
        elif kind == "pull":
            self._pulled(rid, *msg[2:])
        elif kind in ("ack", "dropped"):
            if not self.spec.standby or kind == "dropped":
                self._release(rid)
        elif kind == "release":        # the request is over, or its decode worker died
            self.engine.abort(rid)
            self._release(rid)

    def _start(self, job: WorkerJob) -> None:
        rid = job.request_id
        self.over.pop(rid, None)
        self.jobs[rid] = job
        colocated = job.decode_rank is None
        params = job.params if colocated else replace(job.params, max_tokens=1)
        self.engine.add_request(job.prompt_ids, params, request_id=rid)
        if not colocated:
            self.seq_of[rid] = self.engine.hold_kv(rid)

    def _pulled(self, rid: str, rank: int, index: int, num_blocks: int) -> None:
        """Every pull is answered once: with the KV when it is complete (now, or from the
        forward that completes it), or with zeros for a request that is already over. (A pull
        may overtake the router's job message: it waits for the job.)"""
        if rid in self.over:
            transfer = Transfer(rid)
            zeros = staging_buffer(self.kv.pool, num_blocks)
            zeros.zero_()
            for layer in range(zeros.shape[0]):
                send_tensor(transfer, zeros[layer], rank, index, layer, zeros.shape[0])
            self.waiter.watch(transfer)
            return
        self.pulls[rid] = (rank, index, num_blocks)
        if rid in self.kv_ready:
            self._send_whole(rid)

    def _release(self, rid: str) -> None:
        self.over[rid] = None
        while len(self.over) > 10_000:
            self.over.popitem(last=False)
        seq_id = self.seq_of.pop(rid, None)
        if seq_id is not None:
            self.engine.release_kv(seq_id)
        self.kv_ready.pop(rid, None)
        self.jobs.pop(rid, None)
        if rid in self.pulls:           # pulled but never sent: answered with zeros
            self._pulled(rid, *self.pulls.pop(rid))

    def _blocks(self, rid: str) -> list[int]:
        return self.engine.kv_blocks(self.seq_of[rid], len(self.jobs[rid].prompt_ids))

    # ---- layer by layer: the step that completes a pulled prompt sends it as it computes ------
    def completing_prompts(self, plan: SchedulerOutput) -> list[tuple[str, list[int]]]:
        """(request, blocks) of the held prompts ``plan`` completes (with ``layerwise``)."""
        if not self.spec.layerwise:
            return []
        owner = {s: r for r, s in self.seq_of.items()}
        return [(owner[w.seq.seq_id], self._blocks(owner[w.seq.seq_id]))
                for w in plan.seqs if w.completes and w.seq.seq_id in owner]

    def start_streams(self, completing: list[tuple[str, list[int]]]) -> None:
        """The forward pass begins: stream the completing prompts already pulled."""
        self.streaming, self.completing = [], list(completing or ())
        self._stream_pulled(0)

    def _stream_pulled(self, done_layers: int) -> None:
        """Start streaming every completing prompt that has been pulled by now, catching up
        on its first ``done_layers`` layers (a pull may arrive while the forward runs)."""
        for rid, blocks in list(self.completing):
            if rid in self.pulls:
                self.completing.remove((rid, blocks))
                transfer = self._new_transfer(rid)
                self.streaming.append((rid, transfer, blocks))
                rank, index, _ = self.pulls[rid]
                for layer in range(done_layers):
                    send_layer(transfer, self.kv.pool, blocks, layer, rank, index)

    def _new_transfer(self, rid: str) -> Transfer:
        self.sending[rid] = Transfer(rid)
        return self.sending[rid]

    def layer_done(self, layer: int) -> None:
        """Layer ``layer`` of the forward pass has computed: send it for every streaming
        prompt (first picking up pulls that came in since the step began)."""
        if self.completing:
            for msg in self._read(block=False):
                if msg[0] == "pull":
                    self.handle(msg)
                else:
                    self.deferred.append(msg)
            self._stream_pulled(layer)
        for rid, transfer, blocks in self.streaming:
            rank, index, _ = self.pulls[rid]
            send_layer(transfer, self.kv.pool, blocks, layer, rank, index)

    def _send_whole(self, rid: str) -> None:
        """All layers of a prompt whose KV is complete, to the rank that pulled it."""
        rank, index, _ = self.pulls.pop(rid)
        transfer, blocks = self._new_transfer(rid), self._blocks(rid)
        transfer.ready = self.kv_ready[rid]
        for layer in range(self.engine.model.cfg.n_layers):
            send_layer(transfer, self.kv.pool, blocks, layer, rank, index)
        self.waiter.watch(transfer)

    def work(self) -> None:
        if not self.engine.has_unfinished():
            return
        outs = self.engine.step()
        now = time.perf_counter()
        for rid, transfer, _ in self.streaming:   # sent during the forward: now wait for them
            self.pulls.pop(rid, None)
            transfer.ready = now
            self.waiter.watch(transfer)
        self.streaming = []
        for out in outs:
            job = self.jobs.get(out.request_id)
            if job is None:                   # released while it ran: nobody waits for it
                continue
            if job.decode_rank is None:
                self.report_tokens([out])
            else:
                self._first_token(job, out, now)

    def _first_token(self, job: WorkerJob, out, now: float) -> None:
        c = out.outputs[0]
        finished = c.finish_reason == "stop" or job.params.max_tokens <= 1 or \
            len(job.prompt_ids) + 1 >= self.engine.model.cfg.max_seq_len
        msg = ("first", job.request_id, c.token_ids[0], c.finish_reason if finished else None,
               now)
        self.send(ROUTER, msg)
        if job.request_id not in self.seq_of:      # released meanwhile
            return
        self.kv_ready[job.request_id] = now
        if job.request_id in self.pulls:
            self._send_whole(job.request_id)

    def transfer_done(self, transfer: Transfer) -> None:
        self.sending.pop(transfer.request_id, None)
        self.send(ROUTER, ("sent", transfer.request_id, {
            "bytes": transfer.nbytes, "start": transfer.started, "end": transfer.finished,
            "kv_ready": transfer.ready, "error": transfer.error,
            "layerwise": self.spec.layerwise}))

    def stats(self) -> dict:
        return {**super().stats(), "holding": len(self.seq_of), "pulls": sorted(self.pulls),
                "kv_ready": sorted(self.kv_ready), "running": sorted(self.engine.requests)}


class DecodeWorker(Worker):
    """Pulls prompts' KV when it has room and decodes them in one continuous batch."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.expected: list[str] = []                 # waiting for room to pull, in order
        self.pulled: dict[str, tuple[int, Transfer]] = {}   # rid -> (seq id, transfer)
        self.arrived: dict[str, int] = {}             # KV in place, first token not yet known
        self.first: dict[str, tuple[int, str | None]] = {}

    def handle(self, msg: tuple) -> None:
        kind, rid = msg[0], msg[1]
        if kind == "expect":
            job = msg[1]
            self.jobs[job.request_id] = job
            self.expected.append(job.request_id)
            if job.output_ids:               # a resumed request: its tokens came with it
                self.first[job.request_id] = (None, None)
            self._settle(job.request_id)
        elif kind == "first":
            self.first[rid] = (msg[2], msg[3])
            self._settle(rid)
        elif kind == "cancel":
            if rid in self.expected or rid in self.pulled or rid in self.arrived:
                self.first[rid] = (None, "abort")     # not decoding yet: drop it on arrival
                self._settle(rid)
            if self.engine.abort(rid):                # decoding: no output will come
                self.jobs.pop(rid, None)
                self.sent_tokens.pop(rid, None)

    def _settle(self, rid: str) -> None:
        """Drop a request that ended before it was pulled; adopt one whose KV and first token
        are both here."""
        first = self.first.get(rid)
        if first is not None and first[1] is not None and rid in self.expected:
            self.expected.remove(rid)
            self.first.pop(rid)
            self.send(PREFILL_RANK, ("dropped", self.jobs.pop(rid).kv_key))
        self._adopt_ready(rid)

    def stats(self) -> dict:
        return {**super().stats(), "expected": list(self.expected), "pulled": sorted(self.pulled),
                "arrived": sorted(self.arrived), "first": sorted(self.first),
                "running": sorted(self.engine.requests)}

    def work(self) -> None:
        while self.expected and self._pull(self.expected[0]):
            self.expected.pop(0)
        if self.engine.has_unfinished():
            self.report_tokens(self.engine.step())
            self._maybe_fail("exit_after_tokens")

    def _pull(self, rid: str) -> bool:
        """Allocate blocks and post the receives for ``rid`` if there is room; then pull."""
        job = self.jobs[rid]
        n = len(job.prompt_ids)
        if not self.engine.can_adopt(n + len(job.output_ids)):
            return False
        seq_id = self.engine.allocate_kv(n)
        pool = self.kv.pool
        transfer = Transfer(rid)
        receive_all(transfer, staging_buffer(pool, blocks_for(n, pool.block_size)),
                    PREFILL_RANK, job.index)
        self.pulled[rid] = (seq_id, transfer)
        self.send(PREFILL_RANK, ("pull", job.kv_key, self.rank, job.index,
                                        blocks_for(n, pool.block_size)))
        self.waiter.watch(transfer)
        self._maybe_fail("exit_after_pull")
        return True

    def _maybe_fail(self, point: str) -> None:
        """Fault injection for the tests: exit for real at ``point`` (no cleanup)."""
        if self.fault is None or self.fault[0] != point:
            return
        if point == "exit_after_tokens" and sum(self.sent_tokens.values()) < self.fault[1]:
            return
        os._exit(17)

    def transfer_done(self, transfer: Transfer) -> None:
        rid = transfer.request_id
        seq_id, _ = self.pulled.pop(rid)
        if transfer.error is None:
            scatter(self.kv.pool, self.engine.kv_blocks(seq_id, len(self.jobs[rid].prompt_ids)),
                    transfer.buffers[0])
        self.send(PREFILL_RANK, ("ack", self.jobs[rid].kv_key))
        self.send(ROUTER, ("received", rid, {"bytes": transfer.nbytes, "start": transfer.started,
                                           "end": transfer.finished, "error": transfer.error}))
        if transfer.error is not None:
            self.engine.free_kv(seq_id)
            self.jobs.pop(rid, None)
            return
        self.arrived[rid] = seq_id
        self._adopt_ready(rid)

    def _adopt_ready(self, rid: str) -> None:
        """Start decoding ``rid`` once both its KV and its first token are here."""
        if rid not in self.arrived or rid not in self.first:
            return
        seq_id = self.arrived.pop(rid)
        token, finished = self.first.pop(rid)
        job = self.jobs.pop(rid) if finished is not None else self.jobs[rid]
        if finished is not None:
            self.engine.free_kv(seq_id)
            return
        outputs = job.output_ids + ([token] if token is not None else [])
        self.engine.add_prefilled(job.prompt_ids, job.params, outputs, seq_id, request_id=rid)
        self.sent_tokens[rid] = len(outputs)
