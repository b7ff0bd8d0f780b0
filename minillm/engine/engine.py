"""The engine loop: ``step()`` = schedule -> run the model -> sample and update (nano-vllm's shape).

``add_request`` checks a request and queues it, ``step`` advances every scheduled request by one
token (or its whole prompt), ``abort`` drops a request and frees its blocks. Sampling, stop
conditions, parallel sampling (``n``: the prompt's blocks are forked, not copied) and beam search
happen here, between the runner's logits and the next schedule.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, fields

import torch

from ..cache.block_manager import BlockManager, blocks_for
from ..cache.pool import block_bytes
from ..checkpoint.tokenizer import Tokenizer
from ..config import SamplingParams
from ..model.transformer import Transformer
from ..sampling import make_generator, sample
from .outputs import CompletionOutput, EngineStats, RequestOutput, StepRecord
from .runner import ModelRunner
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Request, Sequence, Status

GiB = 1 << 30


@dataclass(frozen=True)
class EngineConfig(SchedulerConfig):
    """Engine options: the scheduler's (max_num_seqs, max_num_batched_tokens, batching, policy,
    admission, preemption, mixed) plus the KV pool's and the attention backend.

    num_kv_blocks None sizes the pool from ``kv_cache_memory`` bytes (None: 90% of free GPU
    memory on CUDA, 2 GiB on the CPU). ``swap_space`` GiB of CPU memory hold swapped blocks.
    ``attention_backend`` None is "triton" on CUDA, "sdpa" elsewhere. ``pack_linears`` None
    swaps the model's linears for oneDNN-packed ones (:class:`minillm.model.PackedLinear`, same
    parameters, in place) where that applies: float32 on the CPU.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    swap_space: float = 0.5
    watermark: float = 0.01
    attention_backend: str | None = None
    pack_linears: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")

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


class LLMEngine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer | None,
                 config: EngineConfig | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        num_blocks = config.num_kv_blocks or kv_blocks_for_memory(model, config.block_size,
                                                                  config.kv_cache_memory)
        num_cpu = 0 if config.preemption == "recompute" else \
            int(config.swap_space * GiB) // block_bytes(model.cfg, config.block_size, model.dtype)
        backend = config.attention_backend or ("triton" if model.device.type == "cuda"
                                               else "sdpa")
        self.blocks = BlockManager(num_blocks, config.block_size, num_cpu, config.watermark)
        self.scheduler = Scheduler(config.scheduler_config(), self.blocks, model.cfg.max_seq_len)
        self.runner = ModelRunner(model, num_blocks, config.block_size, num_cpu, backend,
                                  config.pack_linears)
        self.requests: dict[str, Request] = {}
        self.trace: list[StepRecord] = []
        self._ids = itertools.count()
        self._generators: dict[str, torch.Generator | None] = {}

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> str:
        """Check and queue a request; returns its id. Bad input raises ValueError and leaves the
        engine as it was. ``arrival_time`` (time.perf_counter seconds, default now) is when the
        request reached the server, for TTFT and latency."""
        params = params or SamplingParams()
        ids, text = self.validate(prompt, params)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        req = Request(request_id, ids, params, priority, text)
        if arrival_time is not None:
            req.metrics.arrival = arrival_time
        self.requests[request_id] = req
        self._generators[request_id] = make_generator(params.seed, self.model.device)
        self.scheduler.add(req)
        return request_id

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
        width = max(params.n, params.beam_width)
        longest = min(len(ids) + params.max_tokens, self.model.cfg.max_seq_len)
        shared = len(ids) // self.blocks.block_size      # full prompt blocks, shared by forks
        need = shared + width * (blocks_for(longest, self.blocks.block_size) - shared)
        if need > self.blocks.num_blocks:
            raise ValueError(f"request needs up to {need} KV blocks ({width} x {longest} tokens) "
                             f"but the pool has {self.blocks.num_blocks}: lower max_tokens, n or "
                             f"beam_width, or raise num_kv_blocks")
        return ids, text

    def abort(self, request_id: str) -> None:
        """Stop an unfinished request now and free its blocks."""
        req = self.requests.pop(str(request_id), None)
        if req is None:
            raise ValueError(f"unknown request_id {request_id!r}: no unfinished request has it")
        for s in req.seqs:
            s.finish_reason = "abort"
        self._finish(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), len(s.swapped), self.blocks.num_used,
                           self.blocks.num_free, self.blocks.slots_in_use(),
                           self.blocks.block_size)

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns outputs of the requests that ran."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        for req in plan.requests:
            if req.metrics.first_scheduled is None:
                req.metrics.first_scheduled = start
        seqs, logits = self.runner.execute(plan, self.blocks.tables)
        row = {s.seq_id: i for i, s in enumerate(seqs)}
        prefill = sum(s.num_uncomputed for s in seqs if s.num_uncomputed > 1)
        decode = sum(s.num_uncomputed == 1 for s in seqs)
        for s in seqs:
            s.num_computed = s.num_tokens
        now = time.perf_counter()
        for req in plan.requests:
            rows = logits[[row[s.seq_id] for s in req.seqs]]
            if req.params.use_beam_search:
                self._beam_step(req, rows)
            else:
                self._sample_step(req, rows)
            if req.metrics.first_token is None:
                req.metrics.first_token = now
            if not req.seqs or (req.params.use_beam_search
                                and len(req.done) >= req.params.beam_width):
                self._finish(req)
        self.trace.append(StepRecord(len(self.trace), start, time.perf_counter(),
                                     [r.request_id for r in plan.requests], prefill, decode,
                                     self.blocks.num_used, self.blocks.slots_in_use(),
                                     [r.request_id for r in plan.preempted]))
        outputs = [self.output(r) for r in plan.requests]
        for r in plan.requests:
            if r.finished:
                del self.requests[r.request_id]
        return outputs

    def _sample_step(self, req: Request, logits: torch.Tensor) -> None:
        """Sample one token per live sequence; the first step of an n > 1 request forks."""
        params = req.params
        if params.n > 1 and not req.done and len(req.seqs) == 1 and not req.seqs[0].output_ids:
            self._fork(req, req.seqs[0], params.n - 1)
            logits = logits.expand(params.n, -1)
        gen = self._generators[req.request_id]
        if params.greedy:
            tokens = logits.argmax(dim=-1).tolist()
        else:
            tokens = [int(sample(row[None], params, gen)) for row in logits]
        for seq, tok in zip(req.seqs, tokens):
            self._append(req, seq, tok)
        self._retire_finished(req)

    def _fork(self, req: Request, parent: Sequence, count: int) -> list[Sequence]:
        children = [parent.fork() for _ in range(count)]
        for c in children:
            self.blocks.fork(parent.seq_id, c.seq_id)
        req.seqs += children
        return children

    def _append(self, req: Request, seq: Sequence, token: int, logprob: float = 0.0) -> None:
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        params, cfg = req.params, self.model.cfg
        if token == cfg.eos_token_id and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= cfg.max_seq_len:
            seq.finish_reason = "length"
        if params.stop and self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            hits = [seq.text.find(s) for s in params.stop if s in seq.text]
            if hits:
                seq.text = seq.text[:min(hits)]
                seq.finish_reason = "stop"

    def _retire_finished(self, req: Request) -> None:
        for seq in [s for s in req.seqs if s.finished]:
            req.seqs.remove(seq)
            req.done.append(seq)
            self.blocks.free(seq.seq_id)

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
                    done = req.seqs[parent].fork()
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

    def _fork_one(self, req: Request, parent: Sequence) -> Sequence:
        child = parent.fork()
        self.blocks.fork(parent.seq_id, child.seq_id)
        return child

    def _finish(self, req: Request) -> None:
        for s in req.seqs:
            s.finish_reason = s.finish_reason or "length"
        req.done += req.seqs
        self.scheduler.finish(req)
        req.seqs = []
        req.metrics.finished = time.perf_counter()
        self._generators.pop(req.request_id, None)

    # ---- outputs -------------------------------------------------------------------------------
    def output(self, req: Request) -> RequestOutput:
        """The request's completions: finished samples in order, or the n best beams."""
        seqs = req.done + req.seqs
        if req.params.use_beam_search:
            seqs = sorted(seqs, key=lambda s: self._beam_score(req, s), reverse=True)
        seqs = seqs[:max(1, req.params.n)]
        outs = [CompletionOutput(i, self._text(req, s), s.output_ids,
                                 s.cumulative_logprob if req.params.use_beam_search else None,
                                 s.finish_reason) for i, s in enumerate(seqs)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, outs, req.finished,
                             req.metrics)

    @staticmethod
    def _beam_score(req: Request, seq: Sequence) -> float:
        """Summed log-probability / length ** length_penalty (HF's length normalisation)."""
        return seq.cumulative_logprob / max(1, len(seq.output_ids)) ** req.params.length_penalty

    def _text(self, req: Request, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        if req.params.stop:
            return seq.text
        return self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)


__all__ = ["EngineConfig", "LLMEngine", "Status"]
