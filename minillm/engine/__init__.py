"""The serving engine (chapter 04): sequences, block manager, scheduler, model runner, LLM API.

Scheduler and block manager are pure Python; the model runner is the only part that touches the
device. ``LLM`` is the offline API (vLLM's), ``LLMEngine`` the add_request / step / abort loop.
"""
from .engine import EngineConfig, LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, EngineStats, RequestOutput
from .scheduler import SchedulerConfig

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine",
           "RequestOutput", "SchedulerConfig"]
