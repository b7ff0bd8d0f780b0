"""Where prefill and decode run: a DistServe-style placement simulator on a measured cost model.

- :func:`measure_costs` times real steps of our engine (one prompt of n tokens; a decode step of
  b sequences) and fits a :class:`CostModel`: ``prefill_time(n) = p0 + p1 n + p2 n^2``,
  ``decode_time(b, ctx) = d0 + d1 b + d2 ctx`` (ctx: the tokens all b sequences attend to),
  by non-negative least squares on the relative error. The measurements stay in the model.
- :func:`simulate`: a seeded, deterministic discrete-event run of a cluster (:class:`Placement`):
  ``colocated`` instances that each prefill and decode (``prefill_first``: a step is either
  whole prompts up to the token budget or one decode step of all running; ``chunked``: the
  engine's own rule, decodes first, the rest of the budget to prompt chunks in arrival order),
  or ``disaggregated`` P:D (prefill instances batch whole prompts FCFS up to the budget, the KV
  of ``prompt_len * kv_bytes_per_token`` bytes crosses a link of ``link_bandwidth`` bytes/s,
  decode instances batch continuously up to ``max_batch``).
- goodput as DistServe defines it (Zhong et al., OSDI 2024): the highest request rate (Poisson
  arrivals) at which at least ``attainment`` of the requests meet both the TTFT and the TPOT
  SLO; per device: divided by the devices. :func:`sweep_rates` (a grid), :func:`find_goodput`
  (doubling, then bisection). :func:`search_placement` tries colocated and every P:D split of
  N devices, also over :class:`DeviceClass` es with prices (Splitwise, Patel et al., ISCA 2024).
- :func:`validate`: the simulator against our real engine (colocated, on ch04's virtual clock).

Assumptions (the simulator's, not measured): no KV capacity limit (no preemption) beyond
``max_batch`` sequences per instance; each KV transfer has the link to itself (no contention),
and the first token counts as delivered when its KV has reached the decode instance, so a
disaggregated TTFT includes the transfer (a request of one output token never leaves its
prefill instance); a mixed step costs its prefill part plus its decode part less a measured
shared overhead (``mixed_overlap``); a step's extra prompts cost no fixed overhead of their
own, and decodes of unequal lengths cost what equal ones of the same total do (the CPU backend
pads groups of decodes to their longest); the cost model is of warm steps (PyTorch on the CPU
runs a token count it has not met yet slower, once). A second device class made with
:meth:`CostModel.scaled` is an assumption about hardware we do not have, never a measurement.

Modules: :mod:`.costs` (the cost model and its measurement), :mod:`.simulator` (what is
simulated and the event loop), :mod:`.search` (goodput, the placement search, validation).
"""
from ...serving_metrics import SLO, tpot
from .costs import TOLERANCE, CostModel, fit_nonnegative, measure_costs
from .search import (
                     OBJECTIVES,
                     Candidate,
                     GoodputResult,
                     RatePoint,
                     SearchResult,
                     ValidationPoint,
                     candidate_placements,
                     disaggregated_splits,
                     evaluate_rate,
                     find_goodput,
                     search_placement,
                     sweep_rates,
                     validate,
)
from .simulator import (
                     LINK_BANDWIDTH,
                     MODES,
                     POLICIES,
                     ROUTING,
                     DeviceClass,
                     Placement,
                     RequestMix,
                     RequestTiming,
                     SimConfig,
                     SimResult,
                     colocated,
                     config_for,
                     disaggregated,
                     simulate,
)

__all__ = ["LINK_BANDWIDTH", "MODES", "OBJECTIVES", "POLICIES", "ROUTING", "SLO", "TOLERANCE",
           "Candidate", "CostModel", "DeviceClass", "GoodputResult", "Placement", "RatePoint",
           "RequestMix", "RequestTiming", "SearchResult", "SimConfig", "SimResult",
           "ValidationPoint", "candidate_placements", "colocated", "config_for", "disaggregated",
           "disaggregated_splits", "evaluate_rate", "find_goodput", "fit_nonnegative",
           "measure_costs", "search_placement", "simulate", "sweep_rates", "tpot", "validate"]
