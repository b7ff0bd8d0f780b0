"""Every plan the package's schedulers make in the tests keeps the rules of
:func:`minillm.engine.plan.check_plan` (token budget, sequence limit, blocks for every token).

The engine itself checks each plan and fails the requests of a broken one (for a step policy of
the user's own); conftest wraps :meth:`minillm.engine.scheduler.Scheduler.schedule` with
:func:`checked` for the whole session, so a broken plan from the package's own scheduler (a
policy defined in ``minillm``) raises AssertionError in the test that made it, also where the
scheduler runs without an engine.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from minillm.engine.plan import PlanError, check_plan

if TYPE_CHECKING:
    from minillm.engine.scheduler import Scheduler, SchedulerOutput


def checked(schedule: Callable[[Scheduler], SchedulerOutput]
            ) -> Callable[[Scheduler], SchedulerOutput]:
    """``schedule`` followed by :func:`check_plan` on the plan the package's policies return."""
    @functools.wraps(schedule)
    def schedule_and_check(self: Scheduler) -> SchedulerOutput:
        plan = schedule(self)
        if type(self).__module__.startswith("minillm."):
            try:
                check_plan(plan, self.config, self.blocks.tables, self.blocks.block_size,
                           type(self).__name__)
            except PlanError as e:
                raise AssertionError(str(e)) from None
        return plan

    return schedule_and_check
