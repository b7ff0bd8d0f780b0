"""Chapter 05 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import torch
from lab_checks import checker_tests

from minillm.labs import ch05
from minillm.labs.solutions.ch05 import (
    fused_bytes,
    merge,
    online_softmax,
)

# --- wrong solutions -----------------------------------------------------------------------


def online_softmax_no_rescale(m, l, acc, s, v):
    m_new = torch.maximum(m, s.max(dim=1).values)
    ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - ref)
    p = torch.exp(s - ref[:, None])
    return m_new, l * alpha + p.sum(1), acc + p @ v  # forgot to rescale the old output


def online_softmax_nan_on_empty_rows(m, l, acc, s, v):
    m_new = torch.maximum(m, s.max(dim=1).values)  # -inf - (-inf) = NaN for empty rows
    alpha = torch.exp(m - m_new)
    p = torch.exp(s - m_new[:, None])
    return m_new, l * alpha + p.sum(1), acc * alpha[:, None] + p @ v


def online_softmax_no_max(m, l, acc, s, v):
    p = torch.exp(s)  # overflows for large scores
    return m, l + p.sum(1), acc + p @ v


def merge_plain_average(outs, lses):
    return sum(outs) / len(outs), torch.logsumexp(torch.stack(lses), dim=0)


def merge_nan_when_empty(outs, lses):
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(torch.exp(part_lse - lse)[..., None] * o for o, part_lse in zip(outs, lses))
    return out, lse


def merge_first_two_only(outs, lses):
    return merge(outs[:2], lses[:2])


def naive_bytes(n, d, heads=1, batch=1, dtype_bytes=2):
    return (4 * n * d + 4 * n * n) * heads * batch * dtype_bytes  # S still counted


def fused_bytes_no_v(n, d, heads=1, batch=1, dtype_bytes=2):
    return (3 * n * d + 2 * n * n) * heads * batch * dtype_bytes


CHECKS = [
    (ch05.check_online_softmax, online_softmax, online_softmax_no_rescale),
    (ch05.check_online_softmax, online_softmax, online_softmax_nan_on_empty_rows),
    (ch05.check_online_softmax, online_softmax, online_softmax_no_max),
    (ch05.check_merge, merge, merge_plain_average),
    (ch05.check_merge, merge, merge_nan_when_empty),
    (ch05.check_merge, merge, merge_first_two_only),
    (ch05.check_fused_softmax_bytes, fused_bytes, naive_bytes),
    (ch05.check_fused_softmax_bytes, fused_bytes, fused_bytes_no_v),
]
IDS = ["online_no_rescale", "online_nan", "online_no_max", "merge_average", "merge_nan",
       "merge_two", "bytes_naive", "bytes_no_v"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)
