"""The autoscaler's Prometheus metrics: is each deployment as large as the policy wants, how
fast do replicas come up, and what load does the policy see.

Labelled by deployment id (and the provider's name): never by organisation or model name,
which the control plane maps ids to.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds from a replica asked for to its announcement: a fake or warm process in a second,
# a model loaded from a local cache in tens of seconds, a GPU node provisioned in minutes.
_COLD_START_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0)

DIRECTIONS = ("up", "down")


@dataclass(slots=True)
class AutoscalerMetrics:
    """One set per reconciler (tests build many in one process): `registry` is served by
    the `/metrics` of the app that runs the reconciler, beside the process's default one."""

    registry: CollectorRegistry
    desired: Gauge  # deployment: the policy's latest replica count (set by the lease holder)
    actual: Gauge  # deployment: workers heartbeating and taking requests
    decisions: Counter  # deployment, direction
    cold_starts: Counter  # deployment: replicas asked for
    cold_start_seconds: Histogram  # deployment: asked for -> announced
    provider_errors: Counter  # provider
    arrival_rate: Gauge  # deployment

    @classmethod
    def create(cls) -> AutoscalerMetrics:
        r = CollectorRegistry()
        return cls(
            registry=r,
            desired=Gauge(
                "tokenmill_autoscaler_desired_replicas",
                "Replicas the scaling policy wants for the deployment (from the reconciler holding "
                "the lease).",
                ["deployment"],
                registry=r,
            ),
            actual=Gauge(
                "tokenmill_autoscaler_actual_replicas",
                "The deployment's workers that heartbeat and take requests (not draining).",
                ["deployment"],
                registry=r,
            ),
            decisions=Counter(
                "tokenmill_autoscaler_scaling_decisions",
                "Changes of the deployment's replica count asked of the provider, by direction.",
                ["deployment", "direction"],
                registry=r,
            ),
            cold_starts=Counter(
                "tokenmill_autoscaler_cold_starts",
                "Replicas asked of the provider (scale-ups and replacements of lost workers).",
                ["deployment"],
                registry=r,
            ),
            cold_start_seconds=Histogram(
                "tokenmill_autoscaler_cold_start_seconds",
                "Time from a replica asked of the provider to the new worker's announcement on the bus.",
                ["deployment"],
                buckets=_COLD_START_BUCKETS,
                registry=r,
            ),
            provider_errors=Counter(
                "tokenmill_autoscaler_provider_errors",
                "Calls to the provider (local processes, Kubernetes) that failed.",
                ["provider"],
                registry=r,
            ),
            arrival_rate=Gauge(
                "tokenmill_autoscaler_arrival_rate",
                "Requests per second arriving at the deployment's workers, from the counters in "
                "their heartbeats.",
                ["deployment"],
                registry=r,
            ),
        )

    def forget(self, deployment: str) -> None:
        """Drop a stopped or deleted deployment's series (a scrape would show them for ever)."""
        per_deployment = (self.desired, self.actual, self.cold_starts, self.cold_start_seconds)
        for metric in (*per_deployment, self.arrival_rate):
            with contextlib.suppress(KeyError):
                metric.remove(deployment)
        for direction in DIRECTIONS:
            with contextlib.suppress(KeyError):
                self.decisions.remove(deployment, direction)
