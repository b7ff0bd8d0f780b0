"""The engine loop: a step in three calls that pass values (vLLM v1's shape, written small).

    plan = scheduler.schedule()                      # who computes how many tokens; KV moves
    out  = runner.execute(plan)                      # forward, sampling, draft verification
    done = scheduler.update_from_output(plan, out)   # advance, roll back, append, finish, free

``add_request`` checks a request and queues it; ``abort`` drops one and frees its blocks. With a
speculator (chapter 06) the sequences that may draft get their next draft after the update, and
the next plan schedules it as tokens to verify. Every step leaves a
:class:`~.outputs.StepRecord` in a bounded ring (``trace``) and calls the ``step_hooks``.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable

from ..attention.paged import default_paged_backend
from ..cache.block_manager import BlockManager, blocks_for
from ..cache.offload import TieredKVStore, model_fingerprint
from ..cache.pool import block_bytes
from ..checkpoint.tokenizer import Tokenizer
from ..config import SamplingParams
from ..model.transformer import Transformer
from ..sampling import make_generator
from .config import EngineConfig, kv_storage_dtype, make_prefix_cache, pool_sizes
from .connector import StoreConnector
from .constraints import ConstraintCompiler
from .detokenizer import IncrementalDetokenizer
from .handoff import KVHandoff
from .intake import validate_request
from .outputs import EngineStats, RequestOutput, StepRecord, request_output, step_record
from .plan import PlanError, SchedulerOutput, check_plan
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Request, Status
from .speculation import Speculator, attach_drafts

StepHook = Callable[["LLMEngine", StepRecord], None]
PlanHook = Callable[["LLMEngine", SchedulerOutput], None]


class LLMEngine(KVHandoff):
    def __init__(self, model: Transformer, tokenizer: Tokenizer | None,
                 config: EngineConfig | None = None,
                 speculator: Speculator | None = None) -> None:
        """``speculator`` (chapter 06; ``minillm.spec_decode.speculator_for``) drafts tokens
        that each decode step verifies."""
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        num_blocks, num_cpu = pool_sizes(model, config)
        kv_dtype = kv_storage_dtype(config, model)
        backend = default_paged_backend(model.device, model.dtype, kv_dtype) \
            if config.attention_backend is None else config.attention_backend
        cache = make_prefix_cache(config.prefix_cache, config.block_size) \
            if config.enable_prefix_caching else None
        self.blocks = BlockManager(num_blocks, config.block_size, num_cpu, config.watermark,
                                   cache, config.block_allocator)
        self.offload = TieredKVStore(
            config.kv_offload, model_fingerprint(model), config.block_size,
            block_bytes(model.cfg, 1, model.dtype)) if config.kv_offload else None
        self.connector = StoreConnector(self.offload, config.kv_offload.layerwise) \
            if self.offload is not None else config.kv_connector
        policy = config.scheduler_cls or Scheduler
        if not (isinstance(policy, type) and issubclass(policy, Scheduler)):
            raise ValueError(f"scheduler_cls must be a subclass of minillm.engine.scheduler."
                             f"Scheduler, got {policy!r}")
        self.scheduler = policy(
            config.scheduler_config(), self.blocks, model.cfg.max_seq_len, self.connector,
            model.cfg.eos_token_id)
        self.runner = ModelRunner(model, num_blocks, config.block_size, num_cpu, backend,
                                  config.pack_linears, config.max_num_batched_tokens,
                                  config.max_num_seqs, config.static_buffers, self.blocks.tables,
                                  self.connector, cuda_graphs=config.cuda_graphs,
                                  kv_dtype=kv_dtype)
        self.runner.fuse_ops = config.fuse_ops
        if config.sampler is not None:
            self.runner.sampler.sampler = config.sampler
        self.requests: dict[str, Request] = {}
        self.trace: deque[StepRecord] = deque(maxlen=config.trace_steps)
        self.step_hooks: list[StepHook] = []
        self.plan_hooks: list[PlanHook] = []   # called with each plan, before the forward
        self.num_steps = 0
        self._ids = itertools.count()
        self.speculator: Speculator | None = None
        if speculator is not None:
            self.use_speculator(speculator)
        self.constraint_compiler: ConstraintCompiler | None = None

    def warmup(self, num_tokens: int = 256) -> float:
        """One throwaway forward pass before serving (see :meth:`ModelRunner.warmup`); returns
        its seconds. Touches no request, block or statistic."""
        cfg = self.config
        return self.runner.warmup(min(num_tokens, cfg.max_num_batched_tokens,
                                      self.model.cfg.max_seq_len))

    def use_speculator(self, speculator: Speculator) -> None:
        """Speculate from now on (before any request is added)."""
        config = self.config
        need = config.max_num_seqs * (1 + speculator.max_draft_tokens)
        if config.enable_prefix_caching:
            raise ValueError("enable_prefix_caching cannot be combined with speculative decoding "
                             "yet: rejected draft tokens would be cached")
        if config.max_num_batched_tokens < need:
            raise ValueError(f"speculative decoding needs max_num_batched_tokens >= "
                             f"max_num_seqs x (1 + draft tokens) = {config.max_num_seqs} x "
                             f"{1 + speculator.max_draft_tokens} = {need}, got "
                             f"{config.max_num_batched_tokens}")
        if self.requests:
            raise ValueError("use_speculator must be called before requests are added")
        self.speculator = self.runner.speculator = speculator

    def use_constraint_compiler(self, compiler: ConstraintCompiler) -> None:
        """Accept requests with ``structured_outputs`` from now on: ``compiler`` turns each
        one's grammar into a matcher (:mod:`.constraints`; ``minillm.LLM`` and the server
        install ``minillm.structured``'s)."""
        if not callable(getattr(compiler, "compile", None)):
            raise ValueError(f"the constraint compiler must have a compile(spec) method "
                             f"(minillm.engine.constraints.ConstraintCompiler), got "
                             f"{type(compiler).__name__}")
        self.constraint_compiler = compiler

    def drafter_blocks(self, max_draft_tokens: int) -> int:
        """Blocks a drafter's own cache needs to follow every sequence this engine can hold
        (on the device or swapped out) plus a draft of ``max_draft_tokens`` each."""
        extra = blocks_for(max_draft_tokens + 1, self.blocks.block_size) + 1
        return self.blocks.num_blocks + self.blocks.cpu.num_blocks + \
            self.config.max_num_seqs * extra

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> str:
        """Check and queue a request; returns its id. Bad input raises ValueError and leaves the
        engine as it was. ``arrival_time`` (time.perf_counter seconds, default now) is when the
        request reached the server, for TTFT and latency."""
        params = params or SamplingParams()
        ids, text = self.validate(prompt, params)
        req = Request(self._new_id(request_id), ids, params, priority, text)
        if params.structured_outputs is not None:      # validate compiled it: a cache hit
            req.seqs[0].constraint = self.constraint_compiler.compile(params.structured_outputs)
        self._register(req, arrival_time)
        self.scheduler.add(req)
        return req.request_id

    def validate(self, prompt: str | list[int], params: SamplingParams
                 ) -> tuple[list[int], str | None]:
        """Prompt token ids (and text), or ValueError (:func:`~.intake.validate_request`)."""
        return validate_request(self, prompt, params)

    def _new_id(self, request_id: str | None) -> str:
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return request_id

    def _register(self, req: Request, arrival_time: float | None) -> None:
        """Track a new request: its arrival, its text state, its random generator."""
        if arrival_time is not None:
            req.metrics.arrival = arrival_time
        if self.tokenizer is not None:
            seq = req.seqs[0]
            seq.detok = IncrementalDetokenizer(self.tokenizer, req.params.stop)
            seq.detok.push(seq.output_ids)
        req.generator = make_generator(req.params.seed, self.model.device)
        self.requests[req.request_id] = req

    def abort(self, request_id: str) -> bool:
        """Stop an unfinished request now and free its blocks. A finished or unknown id is a
        no-op (a client may cancel after the last token); returns whether it aborted one."""
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return False
        self._release(self.scheduler.finish_request(req, "abort"))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """Queue lengths and KV pool use, now (O(1))."""
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), len(s.swapped), self.blocks.num_used,
                           self.blocks.num_free, self.blocks.slots_in_use(),
                           self.blocks.block_size, len(self.blocks.holds))

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run, update; returns the outputs of the requests that produced tokens or
        finished in this step."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if self.connector is not None:
            plan.connector_meta = self.connector.build_meta(plan)
        failed = [self._drop(r) for r in plan.failed]
        if plan.is_empty:
            return failed
        try:
            check_plan(plan, self.config, self.blocks.tables, self.blocks.block_size,
                       type(self.scheduler).__name__)
        except PlanError as e:              # a custom policy's plan: its requests fail
            self.runner.move_blocks(plan)   # (the block manager moved them already)
            self._fail({r.request_id: str(e) for r in plan.requests}, plan.requests)
            return failed + [self._drop(r) for r in plan.requests]
        for req in plan.requests:
            if req.metrics.first_scheduled is None:
                req.metrics.first_scheduled = start
        scheduled = {r.request_id: plan.tokens_of(r) for r in plan.requests}
        drafted = sum(w.seq.num_draft for w in plan.seqs)
        for plan_hook in self.plan_hooks:
            plan_hook(self, plan)
        out = self.runner.execute(plan)
        done = self.scheduler.update_from_output(plan, out)
        self._release(done.released)
        self._fail(out.errors, done.changed)
        if self.speculator is not None:
            drafts = self.speculator.propose(plan, out, done)
            self._fail(attach_drafts(self.speculator, drafts, plan, self.model.cfg.max_seq_len,
                                     self.model.cfg.vocab_size), done.changed)
        record = step_record(self.num_steps, plan, out, start, scheduled, drafted, self.blocks)
        self.num_steps += 1
        self.trace.append(record)
        for hook in self.step_hooks:
            hook(self, record)
        return failed + [self._drop(r) if r.finished else request_output(r) for r in done.changed]

    def _drop(self, req: Request) -> RequestOutput:
        """A finished request's last output; the engine forgets it."""
        del self.requests[req.request_id]
        return request_output(req)

    def _fail(self, errors: dict[str, str], changed: list[Request]) -> None:
        """End each request of ``errors`` (id -> message) with finish_reason "error" (its last
        output, in ``changed``, carries the message); the others go on."""
        for rid, message in errors.items():
            req = self.requests[rid]
            req.error = message
            self._release(self.scheduler.finish_request(req, "error"))
            if req not in changed:
                changed.append(req)

    def _release(self, seq_ids: list[int]) -> None:
        """Sequences that left: the KV connector and the drafter forget them."""
        for seq_id in seq_ids:
            if self.connector is not None:
                self.connector.request_finished(seq_id)
            if self.speculator is not None:
                self.speculator.release(seq_id)


__all__ = ["EngineConfig", "LLMEngine", "Status"]
