"""The serving engine (core, chapter 04). A request's route:

    LLM.generate / stream      the front end: OutputProcessor keeps one inbox per request
      LLMEngine.add_request    intake: validate, a Request with one Sequence, queued
      LLMEngine.step           three calls that pass values (plan.py says what crosses):
        scheduler.schedule()                 -> SchedulerOutput: tokens per sequence, block
                                                moves, stored KV to load (pure Python)
        runner.execute(plan)                 -> RunnerOutput: forward over the paged pool,
                                                sampled tokens, drafts verified (the device)
        scheduler.update_from_output(..)     -> StepUpdate: advance, roll back, append, fork
                                                (policies.py: n > 1, beams), finish, free
      request_output(req)      text deltas per completion, back to the inboxes
Parallel workers and stored KV: ``minillm.disagg`` drives engines through this API; the tiered
store (``minillm.cache.offload``) loads at admission and saves after each forward.
Chapter 04's workloads and recorders: :mod:`minillm.course.ch04_workload`.
"""
from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, EngineStats, RequestOutput
from .scheduler import SchedulerConfig

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine",
           "RequestOutput", "SchedulerConfig"]
