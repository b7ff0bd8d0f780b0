"""The KV connector: the one seam between the engine and KV kept outside its device pool (vLLM
v1's ``KVConnectorBase_V1``, written small). Two implementations: the tiered KV store of
chapter 08 (:class:`StoreConnector`: loads stored prompt KV, saves computed chunks) and the
prefill side of chapter 07's disaggregation (``minillm.disagg.worker.LayerSender``: sends a
prompt's KV layer by layer while the forward pass computes it).

The scheduler half runs inside ``schedule()`` and does no I/O::

    n = connector.num_external_tokens(seq, device_tokens)   # leading tokens it can supply
    connector.on_allocated(seq, device_tokens)              # admitted: load the rest later
    plan.connector_meta = connector.build_meta(plan)        # the engine, after schedule()

The worker half is called by the runner, explicitly, around and inside the forward pass (the
eager ``Transformer.forward_layers`` and the CPU fast path alike)::

    short = connector.start_load(plan)      # loads begin; {seq id: valid tokens} of short ones
    for layer i: connector.wait_for_layer(i); <layer i>; connector.save_layer(i)
    connector.wait_for_save()               # after a forward pass that succeeded

A sequence whose load came short (a stored entry corrupt or gone) sits the step out; the
scheduler then counts only its valid tokens as computed and computes the rest in later steps.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from ..cache.offload import KVLoad, LayerwiseLoad, TieredKVStore

if TYPE_CHECKING:
    from ..cache.pool import PagedKVPool
    from .plan import SchedulerOutput
    from .sequence import Sequence


class ConnectorError(ValueError):
    """A KV connector broke its contract (the message names it and the rule)."""


def check_external_tokens(connector: KVConnector, seq: Sequence, n: object) -> int:
    """``n`` from ``connector.num_external_tokens(seq, ...)``, or ConnectorError: an int in
    [0, len(seq.token_ids) - 1] (the last token is always computed: its logits pick the next)."""
    last = len(seq.token_ids) - 1
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= last:
        raise ConnectorError(f"kv_connector: {type(connector).__name__}.num_external_tokens "
                             f"returned {n!r} for a {last + 1}-token sequence: it must be an int "
                             f"in [0, {last}] (never the last token)")
    return n


class KVConnector:
    """The contract, with do-nothing defaults: override the calls a connector needs. Block ids
    are the device pool's; ``tables`` maps a sequence id to its block table (read only)."""

    # ---- scheduler half (inside schedule(): no I/O, no tensors) ----------------------------
    def num_external_tokens(self, seq: Sequence, device_tokens: int) -> int:
        """Leading tokens of ``seq.token_ids`` whose KV this connector can supply (an index
        lookup), never the last token. Only what exceeds ``device_tokens`` (the device
        prefix cache's hit) will be asked for."""
        return 0

    def on_allocated(self, seq: Sequence, device_tokens: int) -> None:
        """``seq`` was admitted with ``seq.num_computed`` tokens counted as computed, the first
        ``device_tokens`` of them on the device: the rest are this connector's to load before
        the step's forward pass."""

    def build_meta(self, plan: SchedulerOutput) -> Any:
        """What the worker half needs for ``plan`` (it lands in ``plan.connector_meta``)."""
        return None

    def request_finished(self, seq_id: int) -> None:
        """``seq_id`` left the engine (finished, aborted, failed): forget it."""

    # ---- worker half (the runner) ----------------------------------------------------------
    def register_kv_pool(self, pool: PagedKVPool, tables: dict[int, list[int]]) -> None:
        """The runner's KV pool and block tables, once, before any step."""

    def start_load(self, plan: SchedulerOutput) -> dict[int, int]:
        """Begin the plan's loads (done now, or layer by layer during the forward pass).
        Returns {seq id: tokens whose KV is valid} for sequences whose load came short."""
        return {}

    def wait_for_layer(self, layer: int) -> None:
        """Return once layer ``layer``'s loaded KV is in the pool (before the layer runs)."""

    def save_layer(self, layer: int) -> None:
        """Layer ``layer`` has written this step's KV into the pool (after the layer runs)."""

    def wait_for_save(self) -> None:
        """The forward pass succeeded: finish this step's loads and saves."""


class StoreConnector(KVConnector):
    """Chapter 08's tiered KV store (:class:`~minillm.cache.offload.TieredKVStore`) behind the
    device prefix cache: admission counts stored chunks as computed, the runner loads them
    (whole before the forward, or layer by layer during it: ``layerwise``) and, after the
    forward, saves the chunks each scheduled sequence completed."""

    def __init__(self, store: TieredKVStore, layerwise: bool = False) -> None:
        self.store, self.layerwise = store, layerwise
        self.pending: dict[int, tuple[Sequence, int]] = {}   # seq id -> (seq, device tokens)
        self.pool: PagedKVPool | None = None
        self.tables: dict[int, list[int]] = {}
        self.plan: SchedulerOutput | None = None
        self.loading: LayerwiseLoad | None = None
        self.short: dict[int, int] = {}     # this step's short loads (they sit the step out)

    def num_external_tokens(self, seq: Sequence, device_tokens: int) -> int:
        bs = self.store.block_size
        usable = (len(seq.token_ids) - 1) // bs                # never the last token
        return self.store.stored_blocks(seq.token_ids, usable) * bs

    def on_allocated(self, seq: Sequence, device_tokens: int) -> None:
        if seq.num_computed > device_tokens:
            self.pending[seq.seq_id] = (seq, device_tokens)

    def build_meta(self, plan: SchedulerOutput) -> list[tuple[Sequence, int, int]]:
        """(seq, first block, end block) of each load: the blocks past the device hit."""
        bs = self.store.block_size
        meta = [(self.pending[w.seq.seq_id][0], self.pending[w.seq.seq_id][1] // bs,
                 w.seq.num_computed // bs) for w in plan.seqs if w.seq.seq_id in self.pending]
        self.pending.clear()
        return meta

    def request_finished(self, seq_id: int) -> None:
        self.pending.pop(seq_id, None)
        self.store.forget(seq_id)

    def register_kv_pool(self, pool: PagedKVPool, tables: dict[int, list[int]]) -> None:
        self.pool, self.tables = pool, tables

    def start_load(self, plan: SchedulerOutput) -> dict[int, int]:
        """Read every load's chunks from the tiers (CPU, else disk); those that come short
        keep what they got and report it."""
        self.plan, self.loading, self.short = plan, None, {}
        bs, short, loads = self.store.block_size, self.short, []
        for seq, first, end in plan.connector_meta or ():
            load = self.store.fetch(seq.seq_id, seq.token_ids, first, end)
            got = 0 if load is None else load.kv.shape[2] // bs
            if got < end - first:
                short[seq.seq_id] = (first + got) * bs
            if load is not None:
                table = self.tables[seq.seq_id][first:first + got]
                loads.append((torch.tensor(table, device=self.pool.k.device), load))
        if loads and self.layerwise:
            self.loading = LayerwiseLoad(self.pool, loads, self.pool.k.shape[0],
                                         self.store.timing)
        elif loads:
            self._load_now(loads)
        return short

    def _load_now(self, loads: list[tuple[Any, KVLoad]]) -> None:
        start = time.perf_counter()
        for blocks, x in loads:
            self.pool.write_blocks(blocks, x.kv)
        spent = time.perf_counter() - start
        timing = self.store.timing
        timing.loads += 1
        timing.load_seconds += spent
        timing.exposed_seconds += spent

    def wait_for_layer(self, layer: int) -> None:
        if self.loading is not None:
            self.loading.wait(layer)

    def wait_for_save(self) -> None:
        """Finish the layer-wise load, then store the new full chunks of each sequence that ran."""
        if self.loading is not None:
            self.loading.finish()
            self.loading = None
        for w in self.plan.seqs if self.plan is not None else ():
            s = w.seq
            if s.seq_id in self.short:
                continue
            self.store.save(s.seq_id, s.token_ids, s.num_computed + w.num_tokens,
                            self.tables[s.seq_id], self.pool.gather)
        self.plan = None


__all__ = ["KVConnector", "StoreConnector", "ConnectorError", "check_external_tokens"]
