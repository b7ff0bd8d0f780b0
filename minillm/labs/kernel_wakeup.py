"""Notebook runs that survive a missed socket wake-up (the grader, nbmake in CI, the full runs).

jupyter_client's asyncio channels wait for a kernel's message with one zmq poll lasting the
whole timeout. The poll learns of a message from the socket's edge-triggered file descriptor;
when that edge is consumed elsewhere, the message sits in the socket unseen until the poll
times out and checks the socket once more. The cell then "takes" the whole per-cell timeout and
passes (in CI: a 13 s chapter took 313 s, the kernel idle, the client waiting; the same stall is
nbclient#312, seen with widgets' comm traffic). Waiting in slices of at most ``SLICE_S`` makes
every slice re-read the socket's state, so a missed wake-up costs at most one slice.

    python -m pytest -p minillm.labs.kernel_wakeup --nbmake chapters    # as `make test` does
    install()                                                           # before nbclient runs
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from queue import Empty

SLICE_S = 1.0
_installed = False


def sliced(one_poll: Callable[..., Awaitable[dict]]) -> Callable[..., Awaitable[dict]]:
    """``get_msg(self, timeout=None)`` made of calls to ``one_poll(self, timeout=t)`` with
    ``t <= SLICE_S``; same contract: the next message, or ``queue.Empty`` once ``timeout``
    seconds have passed (``None``: wait for ever)."""
    async def get_msg(self, timeout: float | None = None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = SLICE_S if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await one_poll(self, timeout=min(SLICE_S, left))
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    get_msg.__doc__ = one_poll.__doc__
    return get_msg


def install() -> None:
    """Make jupyter_client's ``AsyncZMQSocketChannel.get_msg`` wait in slices (:func:`sliced`).
    Idempotent."""
    global _installed
    if _installed:
        return
    from jupyter_client.channels import AsyncZMQSocketChannel

    AsyncZMQSocketChannel.get_msg = sliced(AsyncZMQSocketChannel.get_msg)
    _installed = True


def pytest_configure(config) -> None:
    """As a pytest plugin (``-p minillm.labs.kernel_wakeup``): install before nbmake runs."""
    install()
