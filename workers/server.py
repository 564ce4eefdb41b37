"""The worker's HTTP API: /generate (NDJSON stream), /health, /metrics, and OpenAI's
/v1/chat/completions and /v1/completions so that one worker is usable on its own.

A worker of an embed deployment serves /embed (JSON in, JSON out) instead of the
generation endpoints; each kind answers the other's endpoints with a 400 that says so.

Every endpoint requires the internal token, so nothing inside the network can reach a
model while bypassing the gateway's keys, limits and metering.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import msgspec
from litestar import Litestar, MediaType, Request, Response, delete, get, post
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath, JSONBody
from litestar.response import Stream
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

from tokenmill import logs
from tokenmill.errors import APIError, exception_handlers
from tokenmill.openai_shapes import (
    Prompt,
    chat_prompt,
    completion_prompt,
    model_not_found,
    new_request_id,
    respond,
)
from tokenmill.openai_types import ChatCompletionRequest, CompletionRequest
from tokenmill.protocol import EmbedRequest, EmbedResponse, GenerateDelta, GenerateRequest, KvOp, LoadAdapter
from tokenmill.request_limits import RequestLimits, check_chat, check_completion, check_sampling
from tokenmill.tokenization import Tokenizer
from workers.adapters import AdapterProblem

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
# While a /generate stream has nothing to send (the request waits in the engine's queue, or
# prefills a long prompt), an empty line this often tells the gateway the worker is alive:
# its idle timeout (TOKENMILL_UPSTREAM_IDLE_TIMEOUT_SECONDS) then only trips on a hung worker.
KEEPALIVE_SECONDS = 2.0
# Answers 200 without the internal token once the model is loaded (the server only starts
# then): Kubernetes' startup, readiness and liveness probes.
READY_PATH = "/ready"

# vLLM's bucket boundaries, so existing Grafana dashboards read these histograms unchanged.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class RecentTtft:
    """Times to first token of the last `window` seconds: heartbeats carry their p95, the
    autoscaler's signal that the fleet is too small for its TTFT target."""

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self._seen: deque[tuple[float, float]] = deque()  # (monotonic time, ttft)

    def observe(self, ttft: float) -> None:
        self._seen.append((time.monotonic(), ttft))

    def p95(self) -> float | None:
        cutoff = time.monotonic() - self.window
        while self._seen and self._seen[0][0] < cutoff:
            self._seen.popleft()
        if not self._seen:
            return None
        values = sorted(t for _, t in self._seen)
        return values[min(len(values) - 1, math.ceil(0.95 * len(values)) - 1)]


class Traffic:
    """Requests that reached this worker and that ended, since it started: heartbeats carry
    both counts (the autoscaler's arrival rate) and /metrics the arrivals."""

    __slots__ = ("arrived", "finished")

    def __init__(self) -> None:
        self.arrived = 0
        self.finished = 0


T = TypeVar("T")


class KeepAlive(Generic[T]):
    """The items of `source`, and None whenever `every` seconds pass without one.

    `source` is read by a task of its own, so a wait for its next item is never cancelled
    (cancelling an engine stream aborts the request). `aclose()` cancels that task and waits
    for it, so `source` is closed (generation stopped) once it returns.
    """

    def __init__(self, source: AsyncIterator[T], every: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._every = every
        self._items: deque[T] = deque()
        self._end: BaseException | None = None  # StopAsyncIteration, or what `source` raised
        self._waiter: asyncio.Future[None] | None = None
        self._last = self._loop.time()  # when we last returned something
        self._task = self._loop.create_task(self._pump(source))

    async def _pump(self, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                self._items.append(item)
                self._wake()
            self._end = StopAsyncIteration()
        except asyncio.CancelledError:
            self._end = StopAsyncIteration()
            raise
        except Exception as exc:
            self._end = exc
        finally:
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> KeepAlive[T]:
        return self

    async def __anext__(self) -> T | None:
        if not self._items and self._end is None:
            self._waiter = self._loop.create_future()
            timer = self._loop.call_at(self._last + self._every, self._wake)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None
        self._last = self._loop.time()
        if self._items:
            return self._items.popleft()
        if self._end is not None:
            raise self._end
        return None  # `every` seconds without an item

    async def aclose(self) -> None:
        if not self._task.done():
            self._task.cancel()
            await asyncio.wait((self._task,))


class Load(Protocol):
    """What heartbeats and the load gauges read, from either kind of worker."""

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...


class Generator(Load, Protocol):
    """What the server needs from a generator (the engine's, or a test's fake)."""

    @property
    def prefix_cache_queries(self) -> int: ...

    @property
    def prefix_cache_hits(self) -> int: ...

    @property
    def spec_draft_tokens(self) -> int: ...

    @property
    def spec_accepted_tokens(self) -> int: ...

    # For the OpenAI endpoints, which tokenize here instead of in the gateway.
    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def context_length(self) -> int: ...

    def validate(self, req: GenerateRequest) -> None: ...

    def drain_kv_events(self) -> list[KvOp]: ...

    def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateDelta]: ...

    # LoRA adapters: loaded ones (heartbeats list them), load (unless loaded) and unload;
    # failures raise workers.adapters.AdapterProblem.
    @property
    def adapters(self) -> list[str]: ...

    async def load_adapter(self, adapter_id: str, key: str | None = None) -> list[str]: ...

    async def unload_adapter(self, adapter_id: str) -> None: ...


class Embedder(Load, Protocol):
    """What the server needs from an embedding model (workers.encoder.EmbedBatcher)."""

    def validate(self, req: EmbedRequest) -> None: ...

    async def embed(self, req: EmbedRequest) -> EmbedResponse: ...


@dataclass(slots=True)
class WorkerInfo:
    worker_id: str
    model: str  # the public name; OpenAI requests must name it
    deployment_id: str | None = None
    # Sampling parameters an OpenAI request leaves out (as a deployment's config gives the gateway).
    sampling: dict[str, float] = field(default_factory=dict)


def error_response(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    type_: str = "invalid_request_error",
) -> Response[dict[str, Any]]:
    """An OpenAI-style error body."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return Response(body, status_code=status, media_type=MediaType.JSON)


class _EngineCounter:
    """A counter whose value lives in the engine (prometheus_client counters only count up
    by themselves, so this collector reads the engine's figure at scrape time)."""

    def __init__(
        self, name: str, doc: str, model: str, read: Callable[[], int], registry: CollectorRegistry
    ) -> None:
        self.name, self.doc, self.model, self.read = name, doc, model, read
        registry.register(self)

    def collect(self) -> list[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.doc, labels=["model_name"])
        family.add_metric([self.model], self.read())
        return [family]


@dataclass(slots=True)
class _Metrics:
    registry: CollectorRegistry
    prompt_tokens: Counter
    generation_tokens: Counter
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    success: Counter

    @classmethod
    def create(cls, load: Load, model: str, generator: Generator | None, traffic: Traffic) -> _Metrics:
        # A registry per app: several apps (tests, or future multi-model workers) in one
        # process must not collide in prometheus_client's global registry.
        registry = CollectorRegistry()
        labels = ["model_name"]
        # Completions are vLLM's request_success; vLLM has no arrivals counter, so ours is named ours.
        _EngineCounter(
            "tokenmill_worker_requests_arrived",
            "Requests that reached this worker (generation or embedding), since it started.",
            model,
            lambda: traffic.arrived,
            registry,
        )
        running = Gauge("vllm:num_requests_running", "Requests being run.", labels, registry=registry)
        running.labels(model).set_function(lambda: load.running)
        waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to start.", labels, registry=registry)
        waiting.labels(model).set_function(lambda: load.waiting)
        if generator is not None:  # an encoder has no KV cache to report
            kv = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", labels, registry=registry)
            kv.labels(model).set_function(lambda: generator.kv_usage)
            # Counters that the engine owns; exported as they are (vLLM's names, `_total` added).
            for name, attr, doc in (
                (
                    "vllm:prefix_cache_queries",
                    "prefix_cache_queries",
                    "Prompt tokens looked up in the prefix cache.",
                ),
                ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
                (
                    "vllm:spec_decode_num_draft_tokens",
                    "spec_draft_tokens",
                    "Draft tokens proposed and verified (speculative decoding).",
                ),
                (
                    "vllm:spec_decode_num_accepted_tokens",
                    "spec_accepted_tokens",
                    "Draft tokens the model accepted (speculative decoding).",
                ),
            ):
                _EngineCounter(name, doc, model, lambda a=attr: getattr(generator, a), registry)
        return cls(
            registry=registry,
            prompt_tokens=Counter(
                "vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=registry
            ).labels(model),
            generation_tokens=Counter(
                "vllm:generation_tokens", "Generation tokens produced.", labels, registry=registry
            ).labels(model),
            ttft=Histogram(
                "vllm:time_to_first_token_seconds",
                "Time to first token.",
                labels,
                buckets=_TTFT_BUCKETS,
                registry=registry,
            ).labels(model),
            itl=Histogram(
                "vllm:inter_token_latency_seconds",
                "Time between successive output tokens of a request.",
                labels,
                buckets=_ITL_BUCKETS,
                registry=registry,
            ).labels(model),
            e2e=Histogram(
                "vllm:e2e_request_latency_seconds",
                "End-to-end request latency.",
                labels,
                buckets=_E2E_BUCKETS,
                registry=registry,
            ).labels(model),
            success=Counter(
                "vllm:request_success",
                "Finished requests by finish reason.",
                [*labels, "finished_reason"],
                registry=registry,
            ),
        )


def create_app(
    generator: Generator | None = None,
    *,
    token: str,
    info: WorkerInfo,
    embedder: Embedder | None = None,
    ttft: RecentTtft | None = None,
    keepalive: float = KEEPALIVE_SECONDS,
    limits: RequestLimits | None = None,
    traffic: Traffic | None = None,
) -> Litestar:
    """The app of a generate worker (`generator`) or of an embed worker (`embedder`);
    `keepalive`: seconds without a delta after which a /generate stream sends an empty line;
    `limits`: what one request may ask for (the gateway's, checked again for direct callers);
    `traffic`: where requests are counted (the heartbeats read it)."""
    if not token:
        raise ValueError("the worker needs an internal token")
    expected = token.encode()

    async def check_token(request: Request[Any, Any, Any]) -> Response[dict[str, Any]] | None:
        if request.url.path == READY_PATH:
            return None  # the orchestrator's probe, which carries no token and learns nothing
        header = request.headers.get("authorization", "")
        scheme, _, supplied = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(supplied.strip().encode(), expected):
            return error_response(401, "invalid or missing internal token", code="invalid_internal_token")
        return None

    load: Load
    traffic = traffic or Traffic()
    if generator is not None and embedder is None:
        load, kind = generator, "generate"
        metrics = _Metrics.create(load, info.model, generator, traffic)
        handlers = _generation_routes(
            generator, info, metrics, ttft or RecentTtft(), keepalive, limits or RequestLimits(), traffic
        )
        handlers.append(
            _refusal("/embed", f"this worker serves the generative model '{info.model}', not embeddings")
        )
    elif embedder is not None and generator is None:
        load, kind = embedder, "embed"
        metrics = _Metrics.create(load, info.model, None, traffic)
        handlers = [_embed_route(embedder, info, metrics, traffic)]
        message = f"this worker serves the embedding model '{info.model}': it only answers /embed"
        handlers += [_refusal(path, message) for path in GENERATION_PATHS]
    else:
        raise ValueError("a worker serves either a generator or an embedder")

    @get(READY_PATH)
    async def ready() -> dict[str, str]:
        return {"status": "ok"}

    @get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": info.model,
            "kind": kind,
            "worker_id": info.worker_id,
            "deployment_id": info.deployment_id,
            "running": load.running,
            "waiting": load.waiting,
        }

    @get("/metrics")
    async def prometheus() -> Response[bytes]:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return Litestar(
        route_handlers=[*handlers, ready, health, prometheus],
        # Before the body is parsed: a wrong token is a 401 whatever the body.
        before_request=check_token,
        exception_handlers=exception_handlers(),  # OpenAI-style errors, as the gateway answers
        openapi_config=None,
        logging_config=None,  # the process (CLI, run_worker) owns the logging setup
    )


GENERATION_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions")


def _refusal(path: str, message: str) -> HTTPRouteHandler:
    """A POST endpoint of the other kind of worker: a clear 400 instead of a bare 404, so a
    misrouted request (a deployment pointing at the wrong model) says what went wrong."""

    async def refuse() -> Response[dict[str, Any]]:
        return error_response(400, message, code="wrong_model_kind")

    return post(path, status_code=400, name=f"refuse{path}")(refuse)


def _embed_route(
    embedder: Embedder, info: WorkerInfo, metrics: _Metrics, traffic: Traffic
) -> HTTPRouteHandler:
    encoder = msgspec.json.Encoder()
    decoder = msgspec.json.Decoder(EmbedRequest)

    @post("/embed", status_code=200)
    async def embed(request: Request[Any, Any, Any]) -> Response[Any]:
        try:
            req = decoder.decode(await request.body())
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError) as exc:
            return error_response(400, f"invalid embed request: {exc}")
        logs.bind(request_id=req.request_id, model=info.model)
        try:
            embedder.validate(req)
        except ValueError as exc:
            return error_response(400, str(exc), param=getattr(exc, "param", None))
        start = time.perf_counter()
        traffic.arrived += 1
        try:
            result = await embedder.embed(req)
        except Exception:
            log.exception("embedding failed for %s", req.request_id)
            return error_response(
                500, "The model failed while embedding.", code="engine_error", type_="server_error"
            )
        finally:
            traffic.finished += 1
        metrics.prompt_tokens.inc(result.prompt_tokens)
        metrics.e2e.observe(time.perf_counter() - start)
        metrics.success.labels(info.model, "stop").inc()
        return Response(encoder.encode(result), media_type=MediaType.JSON)

    return embed


def _generation_routes(
    generator: Generator,
    info: WorkerInfo,
    metrics: _Metrics,
    recent: RecentTtft,
    keepalive: float,
    limits: RequestLimits,
    traffic: Traffic,
) -> list[HTTPRouteHandler]:
    """/generate and the OpenAI endpoints of a generate worker."""
    encoder = msgspec.json.Encoder()
    decoder = msgspec.json.Decoder(GenerateRequest)

    async def metered(req: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        """The generator's deltas, recorded in the metrics; every endpoint generates through here."""
        start = last = time.perf_counter()
        first = True
        metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        traffic.arrived += 1
        try:
            # aclosing: when the client disconnects this generator is cancelled or closed,
            # and the inner one must be closed too so that generation stops now.
            async with aclosing(generator.generate(req)) as deltas:
                async for delta in deltas:
                    if delta.token_ids:
                        now = time.perf_counter()
                        if first:
                            metrics.ttft.observe(now - start)
                            recent.observe(now - start)
                            first = False
                        else:
                            metrics.itl.observe(now - last)
                        last = now
                    metrics.generation_tokens.inc(len(delta.token_ids))
                    if delta.finish_reason is not None:
                        metrics.success.labels(info.model, delta.finish_reason).inc()
                        metrics.e2e.observe(time.perf_counter() - start)
                    yield delta
        finally:  # finished, failed or abandoned by its client: it no longer counts
            traffic.finished += 1

    async def stream(req: GenerateRequest) -> AsyncIterator[bytes]:
        try:
            async with aclosing(metered(req)) as deltas, aclosing(KeepAlive(deltas, keepalive)) as items:
                async for delta in items:
                    yield b"\n" if delta is None else encoder.encode(delta) + b"\n"
        except Exception as exc:  # the status line is long gone: report in-band
            log.exception("stream failed for %s", req.request_id)
            yield encoder.encode(GenerateDelta(finish_reason="error", error=str(exc))) + b"\n"

    def openai_deltas(
        prompt: Prompt, prompt_param: str
    ) -> Callable[[str], AsyncGenerator[GenerateDelta, None]]:
        """What `respond()` starts: the deltas of `prompt`, with failures as OpenAI errors."""

        async def deltas(request_id: str) -> AsyncGenerator[GenerateDelta, None]:
            req = GenerateRequest(
                request_id=request_id, prompt_token_ids=prompt.token_ids, sampling=prompt.sampling
            )
            try:
                generator.validate(req)  # the engine's own limits (vocabulary, sampling ranges)
            except ValueError as exc:
                param = getattr(exc, "param", None)
                # The client sent text, not token ids: name the field it did send.
                raise APIError(
                    400, str(exc), param=prompt_param if param == "prompt_token_ids" else param
                ) from exc
            try:
                async with aclosing(metered(req)) as stream:
                    async for delta in stream:
                        yield delta
            except Exception as exc:
                log.exception("generation failed for %s", request_id)
                raise APIError(
                    500, "The model failed while generating.", code="engine_error", type="server_error"
                ) from exc

        return deltas

    def check_model(name: str) -> None:
        if name != info.model:
            raise model_not_found(name)

    @post("/generate", status_code=200)
    async def generate(request: Request[Any, Any, Any]) -> Response[Any]:
        # The body is decoded here rather than by Litestar so that bad input gets the
        # OpenAI-style error shape.
        try:
            req = decoder.decode(await request.body())
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError) as exc:
            return error_response(400, f"invalid generate request: {exc}")
        logs.bind(request_id=req.request_id, model=info.model)  # the gateway's id: one id, both logs
        try:
            check_sampling(req.sampling, limits)  # e.g. 40,000 stop strings checked every token
            generator.validate(req)
        except APIError as exc:
            return error_response(400, exc.message, param=exc.param)
        except ValueError as exc:
            return error_response(400, str(exc), param=getattr(exc, "param", None))
        if req.adapter is not None:  # loaded on demand, before the stream starts: errors get a status
            try:
                await generator.load_adapter(req.adapter, req.adapter_key)
            except AdapterProblem as exc:
                # The gateway passes a 400 on to the caller and tries another worker otherwise:
                # busy slots or a storage hiccup may be fine elsewhere, missing files are not.
                status = 400 if exc.status in (400, 404) else 503
                return error_response(status, str(exc), code=exc.code, param="adapter")
        return Stream(stream(req), media_type=NDJSON)

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any], data: JSONBody[ChatCompletionRequest]) -> Response[Any]:
        check_model(data.model)
        check_chat(data, limits)
        prompt = chat_prompt(
            data, generator.tokenizer, context_length=generator.context_length, defaults=info.sampling
        )
        rid = new_request_id()
        return await respond(request, data, info.model, rid, openai_deltas(prompt, "messages")(rid))

    @post("/v1/completions", status_code=200)
    async def completions(
        request: Request[Any, Any, Any], data: JSONBody[CompletionRequest]
    ) -> Response[Any]:
        check_model(data.model)
        check_completion(data, limits)
        prompt = completion_prompt(
            data, generator.tokenizer, context_length=generator.context_length, defaults=info.sampling
        )
        rid = new_request_id()
        return await respond(request, data, info.model, rid, openai_deltas(prompt, "prompt")(rid))

    return [generate, chat, completions, *_adapter_routes(generator)]


def _adapter_routes(generator: Generator) -> list[HTTPRouteHandler]:
    """Load, list and unload LoRA adapters on a running worker. Requests load what they name
    on demand; these let an operator (or a deployment's warm-up) place adapters ahead of time."""
    decoder = msgspec.json.Decoder(LoadAdapter)

    def problem(exc: AdapterProblem) -> Response[dict[str, Any]]:
        return error_response(exc.status, str(exc), code=exc.code, param="adapter")

    @get("/adapters")
    async def listing() -> dict[str, list[str]]:
        return {"adapters": generator.adapters}

    @post("/adapters", status_code=200)
    async def load(request: Request[Any, Any, Any]) -> Response[Any]:
        try:
            body = decoder.decode(await request.body())
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError) as exc:
            return error_response(400, f"invalid adapter request: {exc}")
        try:
            evicted = await generator.load_adapter(body.id, body.key)
        except AdapterProblem as exc:
            return problem(exc)
        return Response({"id": body.id, "loaded": True, "evicted": evicted, "adapters": generator.adapters})

    @delete("/adapters/{adapter_id:str}", status_code=200)
    async def unload(adapter_id: FromPath[str]) -> Response[Any]:
        try:
            await generator.unload_adapter(adapter_id)
        except AdapterProblem as exc:
            return problem(exc)
        return Response({"id": adapter_id, "deleted": True, "adapters": generator.adapters})

    return [listing, load, unload]
