"""Prometheus metrics of one service instance (its own registry, so apps never collide)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 8192)


class _IndexCollector(Collector):
    """Index figures read at scrape time (the scrape runs them on the executor)."""

    def __init__(self) -> None:
        self.stats: dict[str, int] = {}
        self.replica: dict[str, Any] | None = None  # a read-only store's ReplicaStats.to_dict()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.replica is not None:
            yield GaugeMetricFamily("mint_replica_following", "1 while this replica follows the log (else /healthz "
                                    "says degraded)", value=1 if self.replica["following"] else 0)
            yield GaugeMetricFamily("mint_log_foreign_objects", "Objects in log/ that are no log object (skipped)",
                                    value=self.replica["foreign_log_objects"])
        if not self.stats:
            return
        yield GaugeMetricFamily("mint_index_bytes", "Bytes of the LMDB index on disk", value=self.stats["index_bytes"])
        yield GaugeMetricFamily("mint_last_seq", "Sequence number of the last commit", value=self.stats["last_seq"])
        entries = GaugeMetricFamily("mint_index_entries", "Entries per index database", labels=["db"])
        for db in ("names", "versions", "tags", "blobs", "layouts", "shards", "events"):
            entries.add_metric([db], self.stats.get(db, 0))
        yield entries


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mint_http_requests", "HTTP requests by route, method and status", ["route", "method", "status"],
            registry=r,
        )
        self.latency = Histogram("mint_http_request_seconds", "HTTP request latency", ["route"], registry=r)
        self.in_flight = Gauge("mint_http_in_flight", "HTTP requests being handled", registry=r)
        self.bytes_served = Counter("mint_bytes_served", "Row bytes sent to clients", ["route"], registry=r)
        self.bytes_received = Counter("mint_upload_bytes", "Upload bytes received", registry=r)
        self.publish_seconds = Histogram(
            "mint_publish_seconds", "Upload received to version committed", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        self.batch_size = Histogram(
            "mint_group_commit_batch_size", "Publishes per group commit", registry=r, buckets=_BATCH_BUCKETS
        )
        self.event_waiters = Gauge("mint_event_waiters", "Long polls waiting on the change feed", registry=r)
        self.uploads_receiving = Gauge("mint_uploads_receiving", "Uploads holding a tenant's place", registry=r)
        self.upload_buffer_peak = Gauge(
            "mint_upload_buffer_peak_bytes", "Most bytes one upload held in memory before its temp file", registry=r
        )
        self.buffer_peak = 0
        self.index = _IndexCollector()
        r.register(self.index)
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count one request. Labelled children are cached: ``labels()`` is not free."""
        key = (route, method, str(status))
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = (self.requests.labels(*key), self.latency.labels(route))
        child[0].inc()
        child[1].observe(seconds)

    def note_upload_buffered(self, nbytes: int) -> None:
        """An upload held at most ``nbytes`` in memory (the rest went to its temp file)."""
        if nbytes > self.buffer_peak:
            self.buffer_peak = nbytes
            self.upload_buffer_peak.set(nbytes)

    def batch_listener(self) -> Callable[[int], None]:
        # runs on the store's writer thread; prometheus metrics are thread-safe
        return self.batch_size.observe

    def render(self, index_stats: dict[str, Any], replica: dict[str, Any] | None = None) -> bytes:
        self.index.stats, self.index.replica = index_stats, replica
        return generate_latest(self.registry)
