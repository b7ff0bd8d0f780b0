"""The engine loop: ``step()`` = schedule -> run the model -> sample and update (nano-vllm's shape).

``add_request`` checks a request and queues it; ``step`` runs the scheduler's plan (so many
tokens per sequence: a decode token, a prompt chunk, a whole prompt), advances every sequence
by what ran and samples where a sequence reached its end; ``abort`` drops a request and frees its
blocks. Sampling is one batched call per step (:mod:`.sampler`); the text of each sequence
grows by the new characters only (:mod:`.detokenizer`). Parallel sampling (``n``: the prompt's
blocks are forked, not copied) and beam search happen here, between the runner's logits and the
next schedule. Every step leaves a :class:`~.outputs.StepRecord` in a bounded ring
(``trace``) and calls the ``step_hooks``.
"""
from __future__ import annotations

import copy
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from ..attention.paged import default_paged_backend
from ..cache.block_manager import BlockManager, blocks_for
from ..cache.offload import OffloadConfig, TieredKVStore, model_fingerprint, physical_memory
from ..cache.pool import block_bytes
from ..checkpoint.tokenizer import Tokenizer
from ..config import SamplingParams
from ..model.transformer import Transformer
from ..sampling import make_generator
from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, EngineStats, RequestOutput, StepRecord
from .runner import ModelRunner, StepResult
from .sampler import SamplingBatch, prompt_logprobs, sample_rows
from .scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import Request, Sequence, Status
from .speculation import SpecInput, Speculator, tree_inputs

GiB = 1 << 30
PREFIX_CACHES = ("hash", "radix")


def make_prefix_cache(name: str, block_size: int):
    """The prefix cache called ``name`` (see ``EngineConfig.prefix_cache``)."""
    if name == "radix":
        from ..cache.radix import RadixPrefixCache
        return RadixPrefixCache(block_size)
    from ..cache.prefix import HashPrefixCache
    return HashPrefixCache(block_size)


@dataclass(frozen=True)
class EngineConfig(SchedulerConfig):
    """Engine options: the scheduler's (max_num_seqs, max_num_batched_tokens, batching, policy,
    admission, preemption, mixed, enable_chunked_prefill, step_policy) plus the KV pool's and the
    attention backend.

    num_kv_blocks None sizes the pool from ``kv_cache_memory`` bytes (None: 90% of free GPU
    memory on CUDA, 2 GiB on the CPU). ``swap_space`` GiB of CPU memory hold swapped blocks.
    ``attention_backend`` None is "triton" on CUDA, on the CPU "cpu" (the C++ paged kernel)
    where it builds, else "sdpa" (:func:`~minillm.attention.paged.default_paged_backend`).
    ``pack_linears`` None
    swaps the model's linears for oneDNN-packed ones (:class:`minillm.model.PackedLinear`, same
    parameters, in place) where that applies: float32 on the CPU, and bfloat16
    where oneDNN has bf16 kernels for it. ``trace_steps``: how many
    recent :class:`StepRecord` s ``LLMEngine.trace`` keeps. ``static_buffers`` (None: on CUDA)
    keeps each step's inputs in tensors allocated once, ready for CUDA graph capture.
    ``enable_prefix_caching`` (chapter 08) keeps computed full blocks and reuses them for any
    request whose prompt starts with the same tokens, found by ``prefix_cache``: "hash" (vLLM's
    hash chain over blocks) or "radix" (SGLang's radix tree); unreferenced cached blocks are
    evicted least recently used first when the pool runs out. ``kv_offload`` (an
    :class:`minillm.cache.offload.OffloadConfig` or a dict of its fields: cpu_bytes, disk_dir,
    disk_bytes, chunk_tokens, layerwise) puts a tiered store (CPU memory, then disk files)
    behind the prefix cache: computed chunks are saved there and loaded back for any request
    whose prompt starts with them, also in another process sharing ``disk_dir``.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    swap_space: float = 0.5
    watermark: float = 0.01
    attention_backend: str | None = None
    pack_linears: bool | None = None
    trace_steps: int = 10_000
    static_buffers: bool | None = None
    enable_prefix_caching: bool = False
    prefix_cache: str = "hash"
    kv_offload: OffloadConfig | dict | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_offload is not None:
            object.__setattr__(self, "kv_offload", OffloadConfig.from_options(self.kv_offload))
            if not self.enable_prefix_caching:
                raise ValueError("kv_offload needs enable_prefix_caching=True (stored chunks "
                                 "are found by their prefix)")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"max_num_batched_tokens must be >= block_size ({self.block_size}), "
                             f"got {self.max_num_batched_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.trace_steps < 1:
            raise ValueError(f"trace_steps must be >= 1, got {self.trace_steps}")
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache must be one of {PREFIX_CACHES}, got "
                             f"{self.prefix_cache!r}")

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(**{f.name: getattr(self, f.name) for f in fields(SchedulerConfig)})


def kv_blocks_for_memory(model: Transformer, block_size: int, memory: int | None) -> int:
    """How many blocks fit in ``memory`` bytes (default: 90% of free GPU memory, or 2 GiB)."""
    if memory is None:
        if model.device.type == "cuda":
            memory = int(torch.cuda.mem_get_info(model.device)[0] * 0.9)
        else:
            memory = 2 * GiB
    return max(1, memory // block_bytes(model.cfg, block_size, model.dtype))


def check_pool_fits(model: Transformer, num_blocks: int, num_cpu_blocks: int,
                    block_size: int) -> None:
    """ValueError naming the option when the KV pools would not fit this machine's memory
    (the device's, and RAM for the CPU swap pool and for a pool on the CPU)."""
    size = block_bytes(model.cfg, block_size, model.dtype)
    ram = physical_memory()
    if model.device.type == "cuda":
        total = torch.cuda.get_device_properties(model.device).total_memory
        if num_blocks * size > total:
            raise ValueError(f"num_kv_blocks / kv_cache_memory: {num_blocks} blocks need "
                             f"{num_blocks * size} bytes, more than the GPU's {total}")
    elif num_blocks * size > ram:
        raise ValueError(f"num_kv_blocks / kv_cache_memory: {num_blocks} blocks need "
                         f"{num_blocks * size} bytes, more than this machine's {ram}")
    if num_cpu_blocks * size > ram:
        raise ValueError(f"swap_space: {num_cpu_blocks} CPU blocks need {num_cpu_blocks * size} "
                         f"bytes, more than this machine's {ram}")


StepHook = Callable[["LLMEngine", StepRecord], None]
PlanHook = Callable[["LLMEngine", SchedulerOutput], None]


class LLMEngine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer | None,
                 config: EngineConfig | None = None,
                 speculator: Speculator | None = None) -> None:
        """``speculator`` (chapter 06; ``minillm.spec.build_speculator``) drafts tokens that
        each decode step verifies."""
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        num_blocks = config.num_kv_blocks or kv_blocks_for_memory(model, config.block_size,
                                                                  config.kv_cache_memory)
        num_cpu = 0 if config.preemption == "recompute" else \
            int(config.swap_space * GiB) // block_bytes(model.cfg, config.block_size, model.dtype)
        check_pool_fits(model, num_blocks, num_cpu, config.block_size)
        backend = config.attention_backend or default_paged_backend(model.device, model.dtype)
        cache = make_prefix_cache(config.prefix_cache, config.block_size) \
            if config.enable_prefix_caching else None
        self.blocks = BlockManager(num_blocks, config.block_size, num_cpu, config.watermark,
                                   cache)
        self.offload = TieredKVStore(
            config.kv_offload, model_fingerprint(model), config.block_size,
            block_bytes(model.cfg, 1, model.dtype)) if config.kv_offload else None
        self.scheduler = Scheduler(config.scheduler_config(), self.blocks, model.cfg.max_seq_len,
                                   self.offload)
        self.runner = ModelRunner(model, num_blocks, config.block_size, num_cpu, backend,
                                  config.pack_linears, config.max_num_batched_tokens,
                                  config.max_num_seqs, config.static_buffers)
        if self.offload is not None:
            self.runner.layerwise_loads = config.kv_offload.layerwise
            self.runner.load_timing = self.offload.timing
        self.requests: dict[str, Request] = {}
        self.trace: deque[StepRecord] = deque(maxlen=config.trace_steps)
        self.step_hooks: list[StepHook] = []
        self.plan_hooks: list[PlanHook] = []   # called with each plan, before the forward
        self.num_steps = 0
        self._ids = itertools.count()
        self._generators: dict[str, torch.Generator | None] = {}
        self._forked: dict[int, int] = {}       # child seq id -> parent, this step
        self._committed: dict[int, list[int]] = {}   # verified seq id -> its kept rows
        self.speculator: Speculator | None = None
        if speculator is not None:
            self.use_speculator(speculator)

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
        self.speculator = speculator

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
        self._register(req, arrival_time)
        self.scheduler.add(req)
        return req.request_id

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
        self.requests[req.request_id] = req
        self._generators[req.request_id] = make_generator(req.params.seed, self.model.device)

    def can_adopt(self, prompt_len: int) -> bool:
        """Room now for one more running sequence whose ``prompt_len`` tokens come computed
        (blocks above the watermark, one more decode slot, a free sequence slot)?"""
        live = sum(len(r.seqs) for r in self.scheduler.running)
        return live < self.config.max_num_seqs and self.blocks.can_allocate(prompt_len + 1)

    def add_prefilled(self, prompt_ids: list[int], params: SamplingParams,
                      output_ids: list[int], seq_id: int, request_id: str | None = None,
                      arrival_time: float | None = None) -> str:
        """Adopt a request whose prompt was computed elsewhere (a disaggregated prefill worker):
        the prompt's K/V is already in the blocks of ``seq_id`` (allocated by the caller), and
        ``output_ids`` (>= 1) were sampled so far. The request joins the running batch: the
        next step decodes after its last token (tokens between are computed first)."""
        ids, _ = self.validate(list(prompt_ids), params)
        if params.n > 1 or params.use_beam_search:
            raise ValueError("add_prefilled takes one sequence: n and beam_width must be 1")
        table = self.blocks.tables.get(seq_id)
        if table is None or len(table) < blocks_for(len(ids), self.blocks.block_size):
            raise ValueError(f"seq_id {seq_id} must own blocks for the {len(ids)} prompt tokens")
        if not output_ids:
            raise ValueError("output_ids must hold at least the first sampled token")
        seq = Sequence(ids + [int(t) for t in output_ids], len(ids), seq_id=seq_id,
                       num_computed=len(ids))
        req = Request(self._new_id(request_id), ids, params, seqs=[seq])
        self._register(req, arrival_time)
        req.metrics.first_scheduled = req.metrics.first_token = time.perf_counter()
        req.status = Status.RUNNING
        self.scheduler.running.append(req)
        return req.request_id

    def validate(self, prompt: str | list[int], params: SamplingParams
                 ) -> tuple[list[int], str | None]:
        """Prompt token ids (and text) if the request is acceptable, else ValueError. A request
        that could not run even alone in the pool is refused now rather than stuck later."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            ids = self.tokenizer.encode(text)
        else:
            ids = [int(i) for i in prompt]
        self.model.cfg.check_prompt(ids)
        if self.speculator is not None and params.use_beam_search:
            raise ValueError("beam search (beam_width > 1) cannot be combined with "
                             "speculative decoding: drafts are verified per sequence")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        width = max(params.n, params.beam_width)
        longest = min(len(ids) + params.max_tokens, self.model.cfg.max_seq_len)
        shared = len(ids) // self.blocks.block_size      # full prompt blocks, shared by forks
        need = shared + width * (blocks_for(longest, self.blocks.block_size) - shared)
        if need > self.blocks.num_blocks:
            raise ValueError(f"request needs up to {need} KV blocks ({width} x {longest} tokens) "
                             f"but the pool has {self.blocks.num_blocks}: lower max_tokens, n or "
                             f"beam_width, or raise num_kv_blocks")
        if not self.config.enable_chunked_prefill:
            # a recomputed request is prefilled again whole, outputs included
            whole = width * longest if self.config.preemption == "recompute" else len(ids)
            if whole > self.config.max_num_batched_tokens:
                raise ValueError(f"without chunked prefill a request must fit one step: up to "
                                 f"{whole} tokens, max_num_batched_tokens="
                                 f"{self.config.max_num_batched_tokens}; raise it or set "
                                 f"enable_chunked_prefill=True")
        return ids, text

    def abort(self, request_id: str) -> bool:
        """Stop an unfinished request now and free its blocks. A finished or unknown id is a
        no-op (a client may cancel after the last token); returns whether it aborted one."""
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return False
        for s in req.seqs:
            s.finish_reason = "abort"
        self._finish(req)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """Queue lengths and KV pool use, now (O(1))."""
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), len(s.swapped), self.blocks.num_used,
                           self.blocks.num_free, self.blocks.slots_in_use(),
                           self.blocks.block_size)

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns the outputs of the requests that
        produced tokens or finished in this step."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        for req in plan.requests:
            if req.metrics.first_scheduled is None:
                req.metrics.first_scheduled = start
        want_all = {s.seq_id for r in plan.requests if self._collects_prompt_logprobs(r)
                    for s in r.seqs}
        scheduled = {r.request_id: plan.tokens_of(r) for r in plan.requests}
        for plan_hook in self.plan_hooks:
            plan_hook(self, plan)
        drafted = {w.seq.seq_id: w.seq.num_draft for w in plan.seqs if w.seq.draft}
        masks, positions = self._tree_inputs(plan)
        result = self.runner.execute(plan, self.blocks.tables, all_logits=want_all | drafted.keys(),
                                     hidden_layers=self.speculator.hidden_layers
                                     if self.speculator else (),
                                     masks=masks, positions=positions)
        starts = {w.seq.seq_id: w.seq.num_computed for w in result.scheduled}
        changed = self._postprocess(plan, result)
        if self.speculator is not None:
            self._propose(plan, result, starts)
        record = self._record(plan, result, start, scheduled, drafted)
        for hook in self.step_hooks:
            hook(self, record)
        outputs = [self.output(r) for r in changed]
        for r in changed:
            if r.finished:
                del self.requests[r.request_id]
        return outputs

    def _postprocess(self, plan: SchedulerOutput, result: StepResult) -> list[Request]:
        """Advance every sequence by what ran, collect prompt logprobs, sample the requests whose
        sequences reached their ends; returns the requests that changed."""
        owner = {s.seq_id: r for r in plan.requests for s in r.seqs}
        for w in result.scheduled:
            if self._collects_prompt_logprobs(owner[w.seq.seq_id]):
                self._prompt_logprobs(owner[w.seq.seq_id], w, result)
        done = {w.seq.seq_id for w in result.scheduled if w.completes}
        for w in result.scheduled:
            w.seq.num_computed += w.num_tokens
            self.blocks.cache_computed(w.seq.seq_id, w.seq.token_ids, w.seq.num_computed)
            if self.offload is not None:
                self.offload.save(w.seq.seq_id, w.seq.token_ids, w.seq.num_computed,
                                  self.blocks.tables[w.seq.seq_id], self.runner.pool.gather)
        ready = [r for r in plan.requests if r.seqs and all(s.seq_id in done for s in r.seqs)]
        last = {sid: rows.stop - 1 for sid, rows in result.logit_rows.items()
                if sid in done}
        self._sample(ready, result.logits, last, result.logit_rows)
        now = time.perf_counter()
        for req in ready:
            if req.metrics.first_token is None:
                req.metrics.first_token = now
            if not req.seqs or (req.params.use_beam_search
                                and len(req.done) >= req.params.beam_width):
                self._finish(req)
        return ready

    def _record(self, plan: SchedulerOutput, result: StepResult, start: float,
                scheduled: dict[str, int], drafted: dict[int, int]) -> StepRecord:
        spec = {w.seq.seq_id for w in result.scheduled if w.seq.seq_id in drafted}
        prefill = sum(w.num_tokens for w in result.scheduled
                      if w.num_tokens > 1 and w.seq.seq_id not in spec)
        decode = sum(w.num_tokens == 1 or w.seq.seq_id in spec for w in result.scheduled)
        record = StepRecord(self.num_steps, start, time.perf_counter(),
                            [r.request_id for r in plan.requests], prefill, decode,
                            self.blocks.num_used, self.blocks.slots_in_use(),
                            [r.request_id for r in plan.preempted],
                            scheduled,
                            len(plan.swap_out), len(plan.swap_in), len(plan.copies),
                            result.move_seconds, sum(drafted.values()))
        self.num_steps += 1
        self.trace.append(record)
        return record

    # ---- sampling ------------------------------------------------------------------------------
    def _sample(self, reqs: list[Request], logits: torch.Tensor, last: dict[int, int],
                spans: dict[int, slice]) -> None:
        """One batched draw for every sampled sequence (an n > 1 request's first step forks its
        sequence first), verification for each drafted one (its rows ``spans[seq_id]``), then
        beam search per request on its rows."""
        rows, owners, params, gens = [], [], [], []
        for req in reqs:
            if req.params.use_beam_search:
                continue
            p = req.params
            if p.n > 1 and not req.done and len(req.seqs) == 1 and not req.seqs[0].output_ids:
                self._fork(req, req.seqs[0], p.n - 1)
            for s in list(req.seqs):
                if s.draft is not None:
                    self._verify(req, s, logits[spans[s.seq_id]])
                    continue
                rows.append(last[s.seq_id] if s.seq_id in last else last[req.seqs[0].seq_id])
                owners.append((req, s))
                params.append(p)
                gens.append(self._generators[req.request_id])
        if rows:
            batch = SamplingBatch.from_params(params, gens, logits.device)
            picked = logits if rows == list(range(len(logits))) else \
                logits[torch.tensor(rows, device=logits.device)]     # (a copy: only if needed)
            out = sample_rows(picked, batch)
            for i, (req, s) in enumerate(owners):
                top = out.top[i][:req.params.logprobs] if req.params.logprobs else None
                self._append(req, s, out.token_ids[i], out.logprobs[i], top)
        for req in reqs:
            if not req.params.use_beam_search:
                self._retire_finished(req)
        for req in reqs:
            if req.params.use_beam_search:
                self._beam_step(req, logits[[last[s.seq_id] for s in req.seqs]])

    def _fork(self, req: Request, parent: Sequence, count: int) -> list[Sequence]:
        children = [self._fork_one(req, parent) for _ in range(count)]
        req.seqs += children
        return children

    def _fork_one(self, req: Request, parent: Sequence) -> Sequence:
        """A new live sequence sharing the parent's blocks (reference counts, no copy)."""
        child = self._copy_seq(parent)
        self.blocks.fork(parent.seq_id, child.seq_id)
        if self.speculator is not None:
            self.speculator.fork(parent.seq_id, child.seq_id)
            self._forked[child.seq_id] = parent.seq_id
        return child

    def _copy_seq(self, parent: Sequence) -> Sequence:
        """The parent's tokens and text state under a new id (no blocks)."""
        child = parent.fork()
        if parent.detok is not None:   # its state, sharing the tokenizer
            child.detok = copy.deepcopy(parent.detok, {id(self.tokenizer): self.tokenizer})
        return child

    def _append(self, req: Request, seq: Sequence, token: int, logprob: float = 0.0,
                top: list[tuple[int, float]] | None = None) -> None:
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if top is not None:
            seq.logprobs.append({token: logprob, **dict(top)})
        params, cfg = req.params, self.model.cfg
        if token == cfg.eos_token_id and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= cfg.max_seq_len:
            seq.finish_reason = "length"
        if seq.detok is not None:
            seq.delta += seq.detok.push([token])
            if seq.detok.stopped:
                seq.finish_reason = "stop"
            if seq.finished:
                seq.delta += seq.detok.finish()

    def _retire_finished(self, req: Request) -> None:
        for seq in [s for s in req.seqs if s.finished]:
            req.seqs.remove(seq)
            req.done.append(seq)
            self.blocks.free(seq.seq_id)
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        seq.draft = None
        if self.offload is not None:
            self.offload.forget(seq.seq_id)
        if self.speculator is not None:
            self.speculator.release(seq.seq_id)

    def _beam_step(self, req: Request, logits: torch.Tensor) -> None:
        """Keep the beam_width best continuations of all live beams (forking shared blocks);
        a continuation ending in EOS among the top beam_width becomes a finished hypothesis."""
        width, vocab = req.params.beam_width, logits.shape[-1]
        logprobs = torch.log_softmax(logits, dim=-1)
        base = torch.tensor([s.cumulative_logprob for s in req.seqs], device=logits.device)
        scores, flat = (base[:, None] + logprobs).view(-1).topk(min(2 * width, logprobs.numel()))
        chosen = []    # (parent index, token, logprob of the token)
        for rank, (score, f) in enumerate(zip(scores.tolist(), flat.tolist())):
            parent, tok = divmod(f, vocab)
            step_lp = score - req.seqs[parent].cumulative_logprob
            if tok == self.model.cfg.eos_token_id and not req.params.ignore_eos:
                if rank < width:
                    done = self._copy_seq(req.seqs[parent])
                    self._append(req, done, tok, step_lp)
                    req.done.append(done)
                continue
            chosen.append((parent, tok, step_lp))
            if len(chosen) == width:
                break
        beams, used = [], set()
        for parent, tok, lp in chosen:
            p = req.seqs[parent]
            beams.append((p if parent not in used else self._fork_one(req, p), tok, lp))
            used.add(parent)
        for i, s in enumerate(req.seqs):
            if i not in used:
                self.blocks.free(s.seq_id)
        req.seqs = [b for b, _, _ in beams]
        for seq, tok, lp in beams:
            self._append(req, seq, tok, lp)
        self._retire_finished(req)

    # ---- prompt logprobs -------------------------------------------------------------------------
    @staticmethod
    def _collects_prompt_logprobs(req: Request) -> bool:
        return req.params.prompt_logprobs is not None and \
            len(req.prompt_logprobs) < len(req.prompt_ids)

    @staticmethod
    def _prompt_logprobs(req: Request, w: ScheduledSeq, result: StepResult) -> None:
        """Add the entries of this chunk's prompt tokens (logits of every row were asked for;
        the last row of the previous chunk predicts this chunk's first token). Entries go by
        position, so a prompt recomputed after preemption rewrites, not repeats, them."""
        start, n = w.seq.num_computed, w.num_tokens
        rows = result.logits[result.logit_rows[w.seq.seq_id]]
        if start:
            rows = torch.cat([req.last_prompt_logits, rows])
        ids = req.prompt_ids[max(start - 1, 0):start + n]
        entries = prompt_logprobs(rows[:len(ids)], ids, req.params.prompt_logprobs)
        req.prompt_logprobs[start:] = entries[1:] if start else entries
        req.last_prompt_logits = rows[-1:]

    # ---- speculative decoding -----------------------------------------------------------------
    def _tree_inputs(self, plan: SchedulerOutput
                     ) -> tuple[dict[int, torch.Tensor], dict[int, list[int]]]:
        """Masks and positions of the tree drafts this step verifies (chains need neither)."""
        masks, positions = {}, {}
        for w in plan.seqs:
            d = w.seq.draft
            if d is not None and not d.is_chain:
                root = w.seq.num_tokens - w.seq.num_draft - 1
                masks[w.seq.seq_id], positions[w.seq.seq_id] = tree_inputs(d, root)
        return masks, positions

    def _verify(self, req: Request, seq: Sequence, logits: torch.Tensor) -> None:
        """Keep the accepted path of ``seq``'s draft and the target's next token (logits
        [N + 1, V], row n after node n)."""
        draft = seq.draft
        path, bonus = self.speculator.verify(seq, draft, logits, req.params,
                                             self._generators[req.request_id])
        root = seq.num_tokens - seq.num_draft - 1
        if path != list(range(1, len(path) + 1)):     # tree nodes -> a contiguous run
            self.move_kv(seq, [root + n for n in path],
                         [root + 1 + j for j in range(len(path))])
        seq.draft = None
        self.truncate(seq, root + 1 + len(path))
        del seq.token_ids[root + 1:]
        self._committed[seq.seq_id] = [0] + path
        want = req.params.logprobs is not None
        logp = logits.float().log_softmax(-1) if want else None
        for node, tok in zip([0] + path, [draft.tokens[n - 1] for n in path] + [bonus]):
            lp, top = 0.0, None
            if want:
                lp = float(logp[node, tok])
                best = logp[node].topk(req.params.logprobs) if req.params.logprobs else None
                top = list(zip(best.indices.tolist(), best.values.tolist())) if best else []
            self._append(req, seq, tok, lp, top)
            if seq.finished:
                break
        seq.num_computed = min(seq.num_computed, seq.num_tokens - 1)

    def _propose(self, plan: SchedulerOutput, result: StepResult,
                 starts: dict[int, int]) -> None:
        """Give the speculator what every live scheduled sequence committed, and attach the
        drafts it returns."""
        inputs = []
        for req in plan.requests:
            if req.finished or req.params.use_beam_search:
                continue
            for s in req.seqs:
                src = self._forked.get(s.seq_id, s.seq_id)
                if src not in result.rows:
                    continue
                r = result.rows[src]
                kept = self._committed.get(src)
                rows = [r.start + n for n in kept] if kept else list(range(r.start, r.stop))
                inputs.append(SpecInput(s, starts[src], rows, self._draft_room(req, s),
                                        req.params, self._generators.get(req.request_id)))
        self._forked.clear()
        self._committed.clear()
        drafts = self.speculator.propose(inputs, result.hidden) if inputs else []
        for inp, draft in zip(inputs, drafts):
            if draft is not None and inp.max_depth > 0:
                draft = draft.pruned(inp.max_depth)
                if draft is not None:
                    inp.seq.attach_draft(draft)

    def _draft_room(self, req: Request, seq: Sequence) -> int:
        """How deep a draft for ``seq`` may go now: 0 while its prompt is unfinished, else what
        max_tokens and the context window leave after the next token."""
        if seq.num_uncomputed != 1 or seq.finished:
            return 0
        left = min(req.params.max_tokens - len(seq.output_ids),
                   self.model.cfg.max_seq_len - seq.num_tokens)
        return max(0, left - 1)

    # ---- editing the KV cache (speculative decoding) ---------------------------------------------
    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of ``seq`` (rejected drafts go): their K/V slots
        are forgotten and whole blocks past them freed."""
        if not 0 < num_tokens <= seq.num_tokens:
            raise ValueError(f"num_tokens must be in [1, {seq.num_tokens}], got {num_tokens}")
        self.runner.pool.copy_blocks(self.blocks.truncate(seq.seq_id, num_tokens))
        del seq.token_ids[num_tokens:]
        seq.num_computed = min(seq.num_computed, num_tokens)

    def move_kv(self, seq: Sequence, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of ``seq``'s positions ``src`` to positions ``dst`` (accepted tree nodes
        into a contiguous run), every layer."""
        table, bs = self.blocks.tables[seq.seq_id], self.blocks.block_size
        bad = [p for p in src + dst if not 0 <= p < len(table) * bs]
        if bad:
            raise ValueError(f"positions must be in [0, {len(table) * bs}), got {bad[:5]}")
        slot = [table[p // bs] * bs + p % bs for p in range(len(table) * bs)]
        self.runner.pool.copy_slots([slot[p] for p in src], [slot[p] for p in dst])

    # ---- finishing -----------------------------------------------------------------------------
    def _finish(self, req: Request) -> None:
        for s in req.seqs:
            self._release(s)
            s.finish_reason = s.finish_reason or "length"
            if s.detok is not None:
                s.delta += s.detok.finish()
        req.done += req.seqs
        self.scheduler.finish(req)
        req.seqs = []
        req.metrics.finished = time.perf_counter()
        req.last_prompt_logits = None
        self._generators.pop(req.request_id, None)

    # ---- outputs -------------------------------------------------------------------------------
    def output(self, req: Request) -> RequestOutput:
        """The request's completions: samples in the order they were forked (so ``index`` i is
        the same sample in every output of a stream), or the n best beams. Each carries the
        text that is new since the last output (``text_delta``)."""
        seqs = req.done + req.seqs
        if req.params.use_beam_search:
            seqs = sorted(seqs, key=lambda s: self._beam_score(req, s), reverse=True)
        else:
            seqs = sorted(seqs, key=lambda s: s.seq_id)
        outs = []
        for i, s in enumerate(seqs[:max(1, req.params.n)]):
            text = s.detok.text if s.detok is not None else ""
            outs.append(CompletionOutput(
                i, text, s.output_ids,
                s.cumulative_logprob if req.params.use_beam_search else None, s.finish_reason,
                s.delta, list(s.logprobs) if req.params.logprobs else None))
        for s in seqs:
            s.delta = ""
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, outs, req.finished,
                             req.metrics, list(req.prompt_logprobs)
                             if req.params.prompt_logprobs is not None else None)

    @staticmethod
    def _beam_score(req: Request, seq: Sequence) -> float:
        """Summed log-probability / length ** length_penalty (HF's length normalisation)."""
        return seq.cumulative_logprob / max(1, len(seq.output_ids)) ** req.params.length_penalty


__all__ = ["EngineConfig", "LLMEngine", "Status"]
