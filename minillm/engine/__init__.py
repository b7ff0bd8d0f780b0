"""The serving engine (core, chapter 04): sequences, scheduler, model runner, LLMEngine, LLM.

Scheduler and block manager (``minillm.cache.block_manager``) are pure Python; the model runner
is the only part that touches the device. ``LLM`` is the offline API (vLLM's), ``LLMEngine`` the
add_request / step / abort loop. Workloads and recorders for chapter 04 live in
:mod:`minillm.course.ch04_workload`, the throughput benchmark in :mod:`minillm.bench.throughput`.
"""
from .engine import EngineConfig, LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, EngineStats, RequestOutput
from .scheduler import SchedulerConfig

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine",
           "RequestOutput", "SchedulerConfig"]
