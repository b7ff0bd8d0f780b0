"""The limits every step's plan keeps, checked on every plan the tests' schedulers make.

conftest wraps :meth:`minillm.engine.scheduler.Scheduler.schedule` with :func:`checked` for the
whole session, so any engine test that runs a step also checks its plan: at most
``max_num_batched_tokens`` tokens and at most ``max_num_seqs`` sequences. The one plan allowed
past the token budget is the scheduler's documented exception: without chunked prefill, a prompt
longer than the budget runs whole, alone in its step.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minillm.engine import SchedulerConfig
    from minillm.engine.scheduler import Scheduler, SchedulerOutput


def check_plan(config: SchedulerConfig, plan: SchedulerOutput) -> None:
    """Raise AssertionError naming the limit when ``plan`` breaks one of ``config``'s."""
    tokens = plan.num_tokens
    alone = not config.enable_chunked_prefill and len(plan.requests) == 1
    if tokens > config.max_num_batched_tokens and not alone:
        per_request = {r.request_id: plan.tokens_of(r) for r in plan.requests}
        raise AssertionError(f"a step's plan holds {tokens} tokens, over max_num_batched_tokens="
                             f"{config.max_num_batched_tokens}: {per_request}")
    if len(plan.seqs) > config.max_num_seqs:
        raise AssertionError(f"a step's plan holds {len(plan.seqs)} sequences, over "
                             f"max_num_seqs={config.max_num_seqs}")


def checked(schedule: Callable[[Scheduler], SchedulerOutput]
            ) -> Callable[[Scheduler], SchedulerOutput]:
    """``schedule`` followed by :func:`check_plan` on the plan it returns."""
    @functools.wraps(schedule)
    def schedule_and_check(self: Scheduler) -> SchedulerOutput:
        plan = schedule(self)
        check_plan(self.config, plan)
        return plan

    return schedule_and_check
