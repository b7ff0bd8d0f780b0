"""Collectives that keep a log: every call records its op, its payload and the bytes this rank sent.

The sharded modules call these wrappers instead of ``torch.distributed`` directly, so a chapter
can count all-reduces per forward pass and compare bytes moved with the formulas. ``sent`` is
what this rank puts on the wire under the usual algorithm: a ring all-reduce of n bytes sends
2 (P-1)/P n, a ring all-gather (P-1)/P of the gathered result, an all-to-all the parts addressed
to other ranks, a send its whole tensor. The log is per process: read it with :func:`events`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CommEvent:
    op: str          # "all_reduce", "all_gather", "all_to_all", "send", "recv"
    payload: int     # bytes of the tensor handed to the collective (the result for all_gather)
    sent: int        # bytes this rank transmits
    tag: str = ""    # what it was for, e.g. "layer 3 attn"


_LOG: list[CommEvent] = []


def reset() -> None:
    """Forget the events logged so far in this process."""
    _LOG.clear()


def events() -> list[CommEvent]:
    """The events logged in this process since the last :func:`reset`."""
    return list(_LOG)


def summary(evts: list[CommEvent] | None = None) -> dict[str, dict[str, int]]:
    """{op: {"calls": n, "payload": bytes, "sent": bytes}} over ``evts`` (default: the log)."""
    out: dict[str, dict[str, int]] = {}
    for e in _LOG if evts is None else evts:
        row = out.setdefault(e.op, {"calls": 0, "payload": 0, "sent": 0})
        row["calls"] += 1
        row["payload"] += e.payload
        row["sent"] += e.sent
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def world(group=None) -> tuple[int, int]:
    """(rank, size) of this process in ``group`` (the default group when None)."""
    return dist.get_rank(group), dist.get_world_size(group)


def all_reduce(t: torch.Tensor, group=None, tag: str = "") -> torch.Tensor:
    """Sum ``t`` over the ranks of ``group``, in place; returns ``t``."""
    p = dist.get_world_size(group)
    if p > 1:
        dist.all_reduce(t, group=group)
    _LOG.append(CommEvent("all_reduce", _nbytes(t), 2 * (p - 1) * _nbytes(t) // p, tag))
    return t


def all_gather(t: torch.Tensor, dim: int = -1, group=None, tag: str = "") -> torch.Tensor:
    """Concatenate every rank's ``t`` (same shape everywhere) along ``dim``."""
    p = dist.get_world_size(group)
    parts = [torch.empty_like(t) for _ in range(p)]
    dist.all_gather(parts, t.contiguous(), group=group)
    out = torch.cat(parts, dim=dim)
    _LOG.append(CommEvent("all_gather", _nbytes(out), (p - 1) * _nbytes(t), tag))
    return out


def all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group=None,
               tag: str = "") -> torch.Tensor:
    """Rows of x [sum(send_counts), ...] go to rank i in blocks of send_counts[i]; returns the
    [sum(recv_counts), ...] rows received, rank 0's block first."""
    rank, p = world(group)
    out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    row = _nbytes(x[:1]) if x.shape[0] else 0
    sent = row * (sum(send_counts) - send_counts[rank])
    _LOG.append(CommEvent("all_to_all", _nbytes(x), sent, tag))
    return out


def exchange_counts(send_counts: list[int], group=None, device=None) -> list[int]:
    """All-to-all of one integer per pair of ranks: how many rows each rank will send me."""
    p = dist.get_world_size(group)
    send = torch.tensor(send_counts, dtype=torch.long, device=device)
    recv = torch.empty(p, dtype=torch.long, device=device)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def log_p2p(op: str, t: torch.Tensor, tag: str = "") -> None:
    """Record a point-to-point message of ``t`` (op "send" or "recv")."""
    _LOG.append(CommEvent(op, _nbytes(t), _nbytes(t) if op == "send" else 0, tag))
