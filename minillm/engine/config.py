"""The engine's options: the scheduler's (:class:`SchedulerConfig`, see :mod:`.scheduler`), the
rest (:class:`EngineConfig`), and the sizing of the KV pool."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from ..attention.kv_quant import resolve_kv_dtype
from ..attention.paged import PagedAttentionBackend, get_paged_backend
from ..cache.block_pool import BlockAllocator
from ..cache.offload import OffloadConfig, physical_memory
from ..cache.pool import block_bytes
from ..cache.prefix import PrefixCache, PrefixCacheFactory, check_prefix_cache
from ..model.transformer import Transformer
from .connector import KVConnector
from .sampler import Sampler

BATCHING = ("continuous", "static")
POLICIES = ("fcfs", "priority")
ADMISSION = ("paged", "reserve")
PREEMPTION = ("recompute", "swap")
STEP_POLICIES = ("chunked", "prefill_first", "decode_first")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    batching: str = "continuous"
    policy: str = "fcfs"
    admission: str = "paged"
    preemption: str = "recompute"
    mixed: bool = True
    enable_chunked_prefill: bool = True
    step_policy: str | None = None

    def __post_init__(self) -> None:
        for name, allowed in (("batching", BATCHING), ("policy", POLICIES),
                              ("admission", ADMISSION), ("preemption", PREEMPTION)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.step_policy is not None:
            if self.step_policy not in STEP_POLICIES:
                raise ValueError(f"step_policy must be one of {STEP_POLICIES} or None, got "
                                 f"{self.step_policy!r}")
            chunked = self.step_policy == "chunked"
            object.__setattr__(self, "mixed", chunked)
            object.__setattr__(self, "enable_chunked_prefill", chunked)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens must be >= max_num_seqs "
                             f"({self.max_num_seqs}: one decode token per sequence), "
                             f"got {self.max_num_batched_tokens}")


GiB = 1 << 30
PREFIX_CACHES = ("hash", "radix")


def make_prefix_cache(kind: str | PrefixCacheFactory, block_size: int) -> PrefixCache:
    """A new prefix cache for ``block_size``-token blocks: the one called ``kind``, or what the
    factory ``kind`` builds, once checked (see ``EngineConfig.prefix_cache``)."""
    if kind == "radix":
        from ..cache.radix import RadixPrefixCache
        return RadixPrefixCache(block_size)
    if kind == "hash":
        from ..cache.prefix import HashPrefixCache
        return HashPrefixCache(block_size)
    return check_prefix_cache(kind(block_size), block_size)


@dataclass(frozen=True)
class EngineConfig(SchedulerConfig):
    """Engine options: the scheduler's (max_num_seqs, max_num_batched_tokens, batching, policy,
    admission, preemption, mixed, enable_chunked_prefill, step_policy) plus the KV pool's and the
    attention backend.

    num_kv_blocks None sizes the pool from ``kv_cache_memory`` bytes (None: 90% of free GPU
    memory on CUDA, 2 GiB on the CPU). ``swap_space`` GiB of CPU memory hold swapped blocks.
    ``attention_backend``: "sdpa", "triton", "cpu" or any object implementing
    :class:`~minillm.attention.paged.PagedAttentionBackend` (a student's, a recorder); None is
    "triton" on CUDA, on the CPU "cpu" (the C++ paged kernel) where it builds, else "sdpa"
    (:func:`~minillm.attention.paged.default_paged_backend`).
    ``pack_linears`` None
    swaps the model's linears for oneDNN-packed ones (:class:`minillm.model.PackedLinear`, same
    parameters, in place) where that applies: float32 on the CPU, and bfloat16
    where oneDNN has bf16 kernels for it. ``trace_steps``: how many
    recent :class:`StepRecord` s ``LLMEngine.trace`` keeps. ``static_buffers`` (None: on CUDA)
    keeps each step's inputs in tensors allocated once, ready for CUDA graph capture.
    ``cuda_graphs``: capture decode steps as CUDA graphs on CUDA (with the triton backend;
    a batch is padded to the next captured size, :mod:`~.graphs`) and replay them; ignored
    on the CPU. Prefill, mixed and drafted steps, and steps with a KV connector, stay eager.
    ``enable_prefix_caching`` (chapter 08) keeps computed full blocks and reuses them for any
    request whose prompt starts with the same tokens, found by ``prefix_cache``: "hash" (vLLM's
    hash chain over blocks), "radix" (SGLang's radix tree), or a factory ``block_size -> cache``
    of any :class:`~minillm.cache.prefix.PrefixCache` (a class taking the block size will do;
    each engine builds its own cache); unreferenced cached blocks are evicted least recently
    used first when the pool runs out. ``kv_offload`` (an
    :class:`minillm.cache.offload.OffloadConfig` or a dict of its fields: cpu_bytes, disk_dir,
    disk_bytes, chunk_tokens, layerwise) puts a tiered store (CPU memory, then disk files)
    behind the prefix cache: computed chunks are saved there and loaded back for any request
    whose prompt starts with them, also in another process sharing ``disk_dir``.
    ``kv_connector``: any other :class:`~.connector.KVConnector` (disaggregation's prefill
    workers pass theirs). ``scheduler_cls``: a step policy of your own, a subclass of
    :class:`~.scheduler.Scheduler` (vLLM's option of that name); the engine checks each of its
    plans (:func:`~.plan.check_plan`) and fails the requests of a plan that breaks a rule.
    ``block_allocator``: which free block the device pool hands out next: "fifo" (the least
    recently freed first) or a :class:`~minillm.cache.block_pool.BlockAllocator` class;
    a block it hands out that is in use fails the request that asked for it.
    ``sampler``: draws the next token of each row (:class:`~.sampler.Sampler`; None: the
    package's :func:`~.sampler.sample_rows`); a row whose token it gets wrong fails its request.
    ``fuse_ops``: the runner's CPU fast path (:mod:`~.cpu_forward`) where it applies; it runs
    no ``nn.Module`` hooks, so turn it off to hook the model's layers.
    ``kv_cache_dtype``: how the pool stores keys and values (vLLM's option of that name):
    "auto" (the model's dtype), "bfloat16" below a float32 model (half the bytes), or "int8"
    (symmetric, one float32 scale per token and KV head; :mod:`minillm.attention.kv_quant`).
    Needs an attention backend that reads such caches (cpu, sdpa).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    swap_space: float = 0.5
    watermark: float = 0.01
    attention_backend: str | PagedAttentionBackend | None = None
    pack_linears: bool | None = None
    trace_steps: int = 10_000
    static_buffers: bool | None = None
    cuda_graphs: bool = False
    enable_prefix_caching: bool = False
    prefix_cache: str | PrefixCacheFactory = "hash"
    kv_offload: OffloadConfig | dict | None = None
    kv_connector: KVConnector | None = None
    scheduler_cls: type | None = None
    block_allocator: str | Callable[[int], BlockAllocator] = "fifo"
    fuse_ops: bool = True
    sampler: Sampler | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        resolve_kv_dtype(self.kv_cache_dtype, torch.float32)     # a known name
        if self.kv_connector is not None and not isinstance(self.kv_connector, KVConnector):
            raise ValueError(f"kv_connector must be a minillm.engine.connector.KVConnector, got "
                             f"{type(self.kv_connector).__name__}")
        if self.kv_offload is not None:
            if self.kv_connector is not None:
                raise ValueError("kv_offload is a KV connector of its own: pass kv_offload or "
                                 "kv_connector, not both")
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
        if self.attention_backend is not None:
            get_paged_backend(self.attention_backend)     # a known name or a whole backend
        check_prefix_cache_option(self.prefix_cache)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(**{f.name: getattr(self, f.name) for f in fields(SchedulerConfig)})


def check_prefix_cache_option(kind: object) -> None:
    """ValueError naming ``prefix_cache`` unless ``kind`` is one of :data:`PREFIX_CACHES` or a
    factory (a cache built once, passed in place of its factory, would be shared by every
    engine made from the config)."""
    if isinstance(kind, str):
        if kind not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache must be one of {PREFIX_CACHES} or a factory "
                             f"block_size -> PrefixCache, got {kind!r}")
    elif not callable(kind) or (not isinstance(kind, type) and hasattr(kind, "match")):
        raise ValueError(f"prefix_cache must be one of {PREFIX_CACHES} or a factory "
                         f"block_size -> PrefixCache (such as the cache's class), got a "
                         f"{type(kind).__name__}: each engine builds its own cache for its "
                         f"block size")


def kv_storage_dtype(config: EngineConfig, model: Transformer) -> torch.dtype:
    """The dtype the KV pool stores for ``model`` under ``config.kv_cache_dtype``: the model's,
    a narrower float, or int8; ValueError naming the option for one wider than the model's."""
    kv = resolve_kv_dtype(config.kv_cache_dtype, model.dtype)
    if kv.is_floating_point and kv.itemsize > model.dtype.itemsize:
        raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype!r} is wider than the model's "
                         f"{str(model.dtype).removeprefix('torch.')}: use 'auto' or a narrower "
                         f"one")
    return kv


def kv_blocks_for_memory(model: Transformer, block_size: int, memory: int | None,
                         kv_dtype: torch.dtype | None = None) -> int:
    """How many blocks fit in ``memory`` bytes (default: 90% of free GPU memory, or 2 GiB),
    stored as ``kv_dtype`` (default the model's)."""
    if memory is None:
        if model.device.type == "cuda":
            memory = int(torch.cuda.mem_get_info(model.device)[0] * 0.9)
        else:
            memory = 2 * GiB
    return max(1, memory // block_bytes(model.cfg, block_size, kv_dtype or model.dtype))


def check_pool_fits(model: Transformer, num_blocks: int, num_cpu_blocks: int,
                    block_size: int, kv_dtype: torch.dtype | None = None) -> None:
    """ValueError naming the option when the KV pools would not fit this machine's memory
    (the device's, and RAM for the CPU swap pool and for a pool on the CPU)."""
    size = block_bytes(model.cfg, block_size, kv_dtype or model.dtype)
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


def pool_sizes(model: Transformer, config: EngineConfig) -> tuple[int, int]:
    """(device blocks, CPU swap blocks) of an engine with ``config``, checked to fit."""
    kv = kv_storage_dtype(config, model)
    num_blocks = config.num_kv_blocks or kv_blocks_for_memory(model, config.block_size,
                                                              config.kv_cache_memory, kv)
    num_cpu = 0 if config.preemption == "recompute" else \
        int(config.swap_space * GiB) // block_bytes(model.cfg, config.block_size, kv)
    check_pool_fits(model, num_blocks, num_cpu, config.block_size, kv)
    return num_blocks, num_cpu
