"""Prometheus metrics of the API: request latency, submissions, and exports by status."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Histogram(
            "exportfarm_http_request_seconds", "API request latency", ["method", "route", "status"],
            registry=self.registry, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.submissions = Counter(
            "exportfarm_export_submissions_total", "POST /exports outcomes", ["outcome"], registry=self.registry
        )
        self.exports = Gauge("exportfarm_exports", "exports in the catalog by status", ["status"], registry=self.registry)

    def render(self, status_counts: dict[str, int]) -> bytes:
        for status, count in status_counts.items():
            self.exports.labels(status=status).set(count)
        return generate_latest(self.registry)
