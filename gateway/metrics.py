"""The gateway's Prometheus metrics: what an operator graphs and alerts on.

Labelled by base model, deployment id and status class only: never by key, organisation,
adapter or prompt, which would leak tenants to whoever reads the metrics and grow the
series without bound. Per-tenant figures live in the ledger and the refusal counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.protocol import GenerateDelta

# Seconds. TTFT and durations of LLM requests span milliseconds (cached, short) to minutes.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_ADMISSION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

# What a refused request's `reason` label may be (`refusals`): one word per kind of refusal
# an operator acts on differently.
REASONS = (
    "auth",  # no key, an unknown, revoked or expired key, too many failed attempts (401/429)
    "permission",  # a key without the scope, a suspended organisation (403)
    "not_found",  # a model (or adapter) the organisation cannot see (404)
    "rate_limit_requests",  # requests per minute (429)
    "rate_limit_tokens",  # tokens per minute (429)
    "concurrency",  # requests in flight (429)
    "budget",  # the organisation's budget (429 insufficient_quota)
    "context_length",  # prompt + max_tokens beyond the model's context (400)
    "too_large",  # body, prompt or batch over the size caps (400/413)
    "validation",  # any other bad request (400/405/415/422)
)


@dataclass(slots=True)
class GatewayMetrics:
    """One set per app (tests build many apps in one process): `registry` is served by
    `/metrics` beside the process's default one."""

    registry: CollectorRegistry
    requests: Counter  # endpoint, model, deployment, status_class
    duration: Histogram  # endpoint, model, deployment
    ttft: Histogram  # model, deployment
    tpot: Histogram  # model, deployment
    tokens: Counter  # model, deployment, kind (prompt, cached, completion)
    refusals: Counter  # reason
    upstream_retries: Counter  # model, deployment
    upstream_errors: Counter  # model, deployment, kind (failed, timeout)
    routing: Counter  # policy, outcome (prefix_hit, no_hit, no_worker)
    prefix_hit_tokens: Counter  # model, deployment: prompt tokens the chosen worker held
    routed_prompt_tokens: Counter  # model, deployment: prompt tokens of routed requests
    admission: Histogram  # seconds spent in admission (limits and budget hold)
    spool_depth: Gauge  # usage events waiting on disk
    bus_lag: Gauge  # seconds between a fleet event's time and its arrival here
    key_cache: Counter  # outcome (hit, miss)
    _series: dict[tuple[str, str, str], Series] = field(default_factory=dict)

    def series(self, endpoint: str, model: str, deployment: str) -> Series:
        """The children of one (endpoint, model, deployment), looked up once: `labels()` on
        every request would cost more than the rest of the recording."""
        key = (endpoint, model, deployment)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = Series.of(self, endpoint, model, deployment)
        return found

    @classmethod
    def create(cls) -> GatewayMetrics:
        r = CollectorRegistry()
        where = ["model", "deployment"]
        return cls(
            registry=r,
            requests=Counter(
                "tokenmill_gateway_requests",
                "Inference requests ended, answered or refused, by status class (2xx, 4xx, 5xx, "
                "or cancelled: the client left).",
                ["endpoint", *where, "status_class"],
                registry=r,
            ),
            duration=Histogram(
                "tokenmill_gateway_request_duration_seconds",
                "Time from admission to the last byte of answered requests.",
                ["endpoint", *where],
                buckets=_DURATION_BUCKETS,
                registry=r,
            ),
            ttft=Histogram(
                "tokenmill_gateway_time_to_first_token_seconds",
                "Time from admission to the first token of answered generations.",
                where,
                buckets=_TTFT_BUCKETS,
                registry=r,
            ),
            tpot=Histogram(
                "tokenmill_gateway_time_per_output_token_seconds",
                "Mean time per output token after the first, per answered generation.",
                where,
                buckets=_TPOT_BUCKETS,
                registry=r,
            ),
            tokens=Counter(
                "tokenmill_gateway_tokens",
                "Tokens of ended requests: prompt (cached included), cached, completion.",
                [*where, "kind"],
                registry=r,
            ),
            refusals=Counter(
                "tokenmill_gateway_refusals",
                "Requests refused before a worker ran them, by reason.",
                ["reason"],
                registry=r,
            ),
            upstream_retries=Counter(
                "tokenmill_gateway_upstream_retries",
                "Requests sent to another worker after one failed before the first token.",
                where,
                registry=r,
            ),
            upstream_errors=Counter(
                "tokenmill_gateway_upstream_errors",
                "Worker calls that failed (kind: failed, timeout).",
                [*where, "kind"],
                registry=r,
            ),
            routing=Counter(
                "tokenmill_gateway_routing_decisions",
                "Routing decisions by policy and outcome (prefix_hit, no_hit, no_worker).",
                ["policy", "outcome"],
                registry=r,
            ),
            prefix_hit_tokens=Counter(
                "tokenmill_gateway_prefix_hit_tokens",
                "Prompt tokens already cached on the worker a request was routed to.",
                where,
                registry=r,
            ),
            routed_prompt_tokens=Counter(
                "tokenmill_gateway_routed_prompt_tokens",
                "Prompt tokens of routed requests (the denominator of the prefix hit rate).",
                where,
                registry=r,
            ),
            admission=Histogram(
                "tokenmill_gateway_admission_seconds",
                "Time spent admitting a request: rate limits, concurrency and the budget hold.",
                buckets=_ADMISSION_BUCKETS,
                registry=r,
            ),
            spool_depth=Gauge(
                "tokenmill_gateway_spool_depth",
                "Usage events waiting on disk for the bus to come back.",
                registry=r,
            ),
            bus_lag=Gauge(
                "tokenmill_gateway_bus_lag_seconds",
                "Age of the last fleet event (heartbeat, KV event) when this gateway read it.",
                registry=r,
            ),
            key_cache=Counter(
                "tokenmill_gateway_key_cache_lookups",
                "API key lookups by outcome (hit: no database read; miss).",
                ["outcome"],
                registry=r,
            ),
        )


@dataclass(slots=True)
class Series:
    """What a request of one endpoint, base model and deployment records into: the labelled
    children of `GatewayMetrics`. Few: endpoints times the catalogue's deployments."""

    ok: Counter  # requests, by status class
    client_error: Counter
    server_error: Counter
    cancelled: Counter
    duration: Histogram
    ttft: Histogram
    tpot: Histogram
    prompt_tokens: Counter
    cached_tokens: Counter
    completion_tokens: Counter
    retries: Counter
    failed: Counter  # upstream errors, by kind
    timeout: Counter
    hit_tokens: Counter
    routed_tokens: Counter

    @classmethod
    def of(cls, m: GatewayMetrics, endpoint: str, model: str, deployment: str) -> Series:
        status = lambda s: m.requests.labels(endpoint, model, deployment, s)  # noqa: E731
        return cls(
            ok=status("2xx"),
            client_error=status("4xx"),
            server_error=status("5xx"),
            cancelled=status("cancelled"),
            duration=m.duration.labels(endpoint, model, deployment),
            ttft=m.ttft.labels(model, deployment),
            tpot=m.tpot.labels(model, deployment),
            prompt_tokens=m.tokens.labels(model, deployment, "prompt"),
            cached_tokens=m.tokens.labels(model, deployment, "cached"),
            completion_tokens=m.tokens.labels(model, deployment, "completion"),
            retries=m.upstream_retries.labels(model, deployment),
            failed=m.upstream_errors.labels(model, deployment, "failed"),
            timeout=m.upstream_errors.labels(model, deployment, "timeout"),
            hit_tokens=m.prefix_hit_tokens.labels(model, deployment),
            routed_tokens=m.routed_prompt_tokens.labels(model, deployment),
        )

    def ended(
        self,
        last: GenerateDelta,
        status: str,
        ttft: float | None,
        duration: float,
        error_status: int | None,
        *,
        sequences: int,
    ) -> None:
        """Record an ended request (`last`: its summed usage; `error_status`: the HTTP status of
        the error it ended with): its status class and tokens; answered (`ok`), its duration,
        TTFT and time per output token after the first, per sequence (the `sequences` choices
        of a request decode side by side)."""
        if status == "ok":
            self.ok.inc()
            self.duration.observe(duration)
            if ttft is not None:
                self.ttft.observe(ttft)
                each = last.completion_tokens / (sequences or 1)
                if each > 1:
                    self.tpot.observe((duration - ttft) / (each - 1))
        elif status == "cancelled":
            self.cancelled.inc()
        elif error_status is not None and error_status < 500:  # the worker found the request invalid
            self.client_error.inc()
        else:
            self.server_error.inc()
        if last.prompt_tokens:
            self.prompt_tokens.inc(last.prompt_tokens)
        if last.cached_tokens:
            self.cached_tokens.inc(last.cached_tokens)
        if last.completion_tokens:
            self.completion_tokens.inc(last.completion_tokens)

    def upstream_failed(self, timeout: bool) -> None:
        (self.timeout if timeout else self.failed).inc()
