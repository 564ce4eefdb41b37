"""The ledger consumer's Prometheus metrics: how much it writes, and how far behind it runs."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge


@dataclass(slots=True, frozen=True)
class LedgerMetrics:
    """One set per app, like the gateway's: `registry` is served by that app's `/metrics`."""

    registry: CollectorRegistry
    events: Counter
    batches: Counter
    lag: Gauge

    @classmethod
    def create(cls) -> LedgerMetrics:
        r = CollectorRegistry()
        return cls(
            registry=r,
            events=Counter(
                "tokenmill_ledger_events",
                "Usage events consumed into the ledger (a redelivered duplicate, which the ledger "
                "skips, included).",
                registry=r,
            ),
            batches=Counter(
                "tokenmill_ledger_batches",
                "Batches of usage events committed to the ledger (one transaction each).",
                registry=r,
            ),
            lag=Gauge(
                "tokenmill_ledger_lag_seconds",
                "Age of the newest usage event of the last batch, when that batch was committed.",
                registry=r,
            ),
        )
