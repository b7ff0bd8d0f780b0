"""Prometheus metrics of the server (``GET /metrics``, in the text format of prometheus-client).

Gauges are read from the engine loop's latest :class:`~minillm.engine.outputs.EngineStats` at
scrape time; the histograms are observed by the loop thread as requests finish; the request
counter is bumped by the HTTP handlers, labelled with the HTTP status each request got (499,
nginx's "client closed request", for a client that went away mid-request). Every server has its
own registry, so several servers can live in one process (the tests start more than one).
"""
from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ..engine.outputs import EngineStats, RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
CLIENT_CLOSED = 499
# seconds; TTFT spans queueing and prefill, TPOT one decode step of a batch
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """The server's metrics, all named ``minillm_*``, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.waiting = Gauge("minillm_num_requests_waiting",
                             "requests queued in the engine, not yet running", registry=r)
        self.running = Gauge("minillm_num_requests_running", "requests in the running batch",
                             registry=r)
        self.swapped = Gauge("minillm_num_requests_swapped", "requests swapped out to the CPU",
                             registry=r)
        self.queued = Gauge("minillm_server_queue_length",
                            "engine requests the server holds (any state), of at most "
                            "max_num_seqs + max_queue", registry=r)
        self.blocks_used = Gauge("minillm_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.blocks_free = Gauge("minillm_kv_blocks_free", "KV cache blocks free", registry=r)
        self.ttft = Histogram("minillm_time_to_first_token_seconds",
                              "arrival to first output token", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("minillm_time_per_output_token_seconds",
                              "mean time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("minillm_e2e_request_latency_seconds", "arrival to last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter("minillm_requests", "HTTP requests answered, by status code",
                                ["status"], registry=r)

    def observe_finished(self, out: RequestOutput) -> None:
        """Latencies of one finished engine request (called by the engine loop thread)."""
        for hist, value in ((self.ttft, out.ttft), (self.tpot, out.tpot),
                            (self.e2e, out.metrics.e2e)):
            if value is not None:
                hist.observe(value)

    def count(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def render(self, stats: EngineStats, queued: int) -> bytes:
        """The text exposition, gauges set from ``stats`` first."""
        self.waiting.set(stats.num_waiting)
        self.running.set(stats.num_running)
        self.swapped.set(stats.num_swapped)
        self.queued.set(queued)
        self.blocks_used.set(stats.blocks_used)
        self.blocks_free.set(stats.blocks_free)
        return generate_latest(self.registry)
