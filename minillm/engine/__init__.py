"""The serving engine (core, chapter 04). A request's route:

    LLM.generate / stream      the front end: OutputProcessor keeps one inbox per request
      LLMEngine.add_request    intake: validate, a Request with one Sequence, queued
      LLMEngine.step           three calls that pass values (plan.py says what crosses):
        scheduler.schedule()                 -> SchedulerOutput: tokens per sequence, block
                                                moves, the KV connector's loads (no I/O)
        runner.execute(plan)                 -> RunnerOutput: the connector's loads, forward
                                                over the paged pool (it waits and saves per
                                                layer), sampled tokens, drafts verified
        scheduler.update_from_output(..)     -> StepUpdate: advance, roll back, append, fork
                                                (policies.py: n > 1, beams), finish, free
      request_output(req)      text deltas per completion, back to the inboxes
The seams (each named in ``EngineConfig``): step policy, block allocator, prefix cache, KV
connector (connector.py: the tiered store, disaggregation), attention backend, speculator.
"""
from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, EngineStats, RequestOutput
from .scheduler import SchedulerConfig

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine",
           "RequestOutput", "SchedulerConfig"]
