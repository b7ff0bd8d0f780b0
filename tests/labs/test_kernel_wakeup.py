"""The sliced wait for a kernel's messages (minillm.labs.kernel_wakeup) against a simulated
missed wake-up: a socket whose poll sees its waiting message only when the poll times out."""
from __future__ import annotations

import asyncio
import time
from queue import Empty

import pytest

from minillm.labs import kernel_wakeup


class MissedWakeup:
    """A channel whose message arrived at ``ready_at`` but whose poll was never woken: a poll
    returns it only when its own timeout ends (pyzmq's last check of the socket)."""

    def __init__(self, ready_at: float | None) -> None:
        self.ready_at, self.polls = ready_at, []

    async def one_poll(self, timeout: float | None = None) -> dict:
        self.polls.append(timeout)
        await asyncio.sleep(timeout)
        if self.ready_at is not None and time.monotonic() >= self.ready_at:
            return {"msg_type": "execute_reply"}
        raise Empty


@pytest.fixture
def short_slices(monkeypatch):
    monkeypatch.setattr(kernel_wakeup, "SLICE_S", 0.05)


def wait(channel: MissedWakeup, timeout: float | None) -> tuple[dict | None, float]:
    get_msg = kernel_wakeup.sliced(MissedWakeup.one_poll)
    start = time.monotonic()
    try:
        msg = asyncio.run(get_msg(channel, timeout=timeout))
    except Empty:
        msg = None
    return msg, time.monotonic() - start


def test_a_missed_wakeup_costs_one_slice_not_the_timeout(short_slices):
    channel = MissedWakeup(ready_at=time.monotonic())
    msg, took = wait(channel, timeout=30.0)
    assert msg == {"msg_type": "execute_reply"}
    assert took < 1.0, f"waited {took:.2f} s for a message that was there"
    # One poll of the whole timeout (jupyter_client's own wait) would have taken 30 s.
    assert all(t <= kernel_wakeup.SLICE_S for t in channel.polls)


def test_no_message_is_empty_after_the_timeout_not_before(short_slices):
    msg, took = wait(MissedWakeup(ready_at=None), timeout=0.3)
    assert msg is None
    assert 0.3 <= took < 1.0


def test_no_timeout_waits_until_the_message(short_slices):
    channel = MissedWakeup(ready_at=time.monotonic() + 0.3)
    msg, took = wait(channel, timeout=None)
    assert msg is not None and 0.3 <= took < 1.0
    assert len(channel.polls) >= 5


def test_install_is_idempotent_and_wraps_jupyter_client():
    from jupyter_client.channels import AsyncZMQSocketChannel

    kernel_wakeup.install()
    once = AsyncZMQSocketChannel.get_msg
    kernel_wakeup.install()
    assert AsyncZMQSocketChannel.get_msg is once
    assert once.__qualname__.startswith("sliced")
