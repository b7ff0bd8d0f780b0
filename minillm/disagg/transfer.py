"""Moving a prompt's paged KV between processes: gather, one message per layer, scatter.

A prompt of n tokens sits in ``ceil(n / block_size)`` blocks scattered over the pool
[n_layers, num_blocks, block_size, Hkv, D]. The sender gathers layer l's blocks, K and V, into
one staging tensor [2, nb, block_size, Hkv, D] and sends it with ``torch.distributed.isend``
(gloo on CPU, NCCL on GPUs); the receiver posts one ``irecv`` per layer into a staging buffer
[n_layers, 2, nb, block_size, Hkv, D] and, once all have arrived, scatters it into the blocks it
allocated. Each message has its own tag (the request's transfer index and the layer), so the
layers of many requests can be in flight at once and in any order.

gloo's ``Work.is_completed`` does not move until someone waits, so every transfer gets a small
thread that waits on its works (with a timeout) and reports to a queue the worker's loop reads.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..cache.pool import PagedKVPool


def tag_of(index: int, layer: int, n_layers: int) -> int:
    """The message tag of ``layer`` in transfer number ``index`` (unique per pair of ranks)."""
    return index * (n_layers + 1) + layer


def gather_layer(pool: PagedKVPool, blocks: list[int], layer: int) -> torch.Tensor:
    """Layer ``layer``'s K and V of ``blocks`` as one contiguous tensor [2, nb, bs, Hkv, D]."""
    idx = torch.tensor(blocks, device=pool.k.device)
    return torch.stack([pool.k[layer, idx], pool.v[layer, idx]])


def staging_buffer(pool: PagedKVPool, num_blocks: int) -> torch.Tensor:
    """Where a receiver puts ``num_blocks`` blocks of every layer: [L, 2, nb, bs, Hkv, D]."""
    n_layers, _, bs, h, d = pool.k.shape
    return torch.empty((n_layers, 2, num_blocks, bs, h, d), dtype=pool.k.dtype,
                       device=pool.k.device)


def scatter(pool: PagedKVPool, blocks: list[int], staged: torch.Tensor) -> None:
    """Write a received staging buffer [L, 2, nb, bs, Hkv, D] into ``blocks`` of the pool."""
    idx = torch.tensor(blocks, device=pool.k.device)
    pool.k[:, idx] = staged[:, 0]
    pool.v[:, idx] = staged[:, 1]


@dataclass
class Transfer:
    """The works of one request's KV transfer and their timing (time.perf_counter seconds)."""

    request_id: str
    works: list = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)   # kept alive until done
    nbytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    ready: float | None = None       # sender: when the prompt's KV was complete
    finished: float | None = None
    error: str | None = None


class Waiter:
    """Waits for transfers in background threads and reports each one, finished or failed,
    on ``done`` (a queue.Queue of :class:`Transfer`)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout = timedelta(seconds=timeout_s)
        self.done: queue.Queue[Transfer] = queue.Queue()

    def watch(self, transfer: Transfer) -> None:
        threading.Thread(target=self._wait, args=(transfer,), daemon=True).start()

    def _wait(self, transfer: Transfer) -> None:
        try:
            for work in transfer.works:
                work.wait(self.timeout)
        except Exception as e:  # noqa: BLE001 - a dead peer or a timeout: reported, not raised
            transfer.error = f"{type(e).__name__}: {str(e)[:200]}"
        transfer.finished = time.perf_counter()
        self.done.put(transfer)

    def finished(self) -> list[Transfer]:
        """The transfers that ended since the last call."""
        out = []
        while True:
            try:
                out.append(self.done.get_nowait())
            except queue.Empty:
                return out


def send_layer(transfer: Transfer, pool: PagedKVPool, blocks: list[int], layer: int, dst: int,
               index: int) -> None:
    """Gather and send one layer of ``blocks`` to rank ``dst`` (asynchronously)."""
    send_tensor(transfer, gather_layer(pool, blocks, layer), dst, index, layer,
                pool.k.shape[0])


def send_tensor(transfer: Transfer, staged: torch.Tensor, dst: int, index: int, layer: int,
                n_layers: int) -> None:
    """Send one layer's staging tensor [2, nb, bs, Hkv, D] to ``dst`` (asynchronously)."""
    if transfer.error is not None:        # the peer is gone: do not try the other layers
        return
    transfer.buffers.append(staged)
    transfer.nbytes += staged.numel() * staged.element_size()
    try:
        transfer.works.append(dist.isend(staged, dst, tag=tag_of(index, layer, n_layers)))
    except RuntimeError as e:             # gloo raises at once when the peer has died
        transfer.error = f"{type(e).__name__}: {str(e)[:200]}"


def receive_all(transfer: Transfer, staged: torch.Tensor, src: int, index: int) -> None:
    """Post one receive per layer of ``staged`` [L, ...] from rank ``src``."""
    n_layers = staged.shape[0]
    transfer.buffers.append(staged)
    transfer.nbytes = staged.numel() * staged.element_size()
    transfer.works += [dist.irecv(staged[layer], src, tag=tag_of(index, layer, n_layers))
                       for layer in range(n_layers)]
