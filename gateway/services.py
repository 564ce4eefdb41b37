"""The request path: who is calling, what serves the model, tokens in, deltas out, usage.

A request is first admitted (`admit`: its request count, the model, the prompt prepared
off the event loop when large, then its tokens, concurrency and budget hold), then served
(`stream` / `embed`: routed, retried before the first token, settled and metered once
however it ends). Nothing expensive happens before the request is counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admission import Admitted, Admitter, Ticket
from gateway.batch_lines import BatchLines
from gateway.catalog import Catalog, Target
from gateway.embeddings import check_dimensions
from gateway.fanout import merge
from gateway.fleet import FleetView, Route, WorkerState
from gateway.keys import Caller, KeyCache
from gateway.metrics import GatewayMetrics
from gateway.prep import Prep
from gateway.upstream import Upstream, UpstreamError
from tokenmill.bus import Publisher
from tokenmill.errors import APIError
from tokenmill.hashing import extra_keys, hash_blocks
from tokenmill.openai_shapes import (
    ChoiceDelta,
    Choices,
    chat_prompt,
    completion_prompts,
    embedding_inputs,
    total,
)
from tokenmill.openai_types import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from tokenmill.protocol import USAGE, EmbedRequest, EmbedResponse, GenerateDelta, GenerateRequest, UsageRecord
from tokenmill.request_limits import (
    RequestLimits,
    check_chat,
    check_completion,
    check_embedding,
    service_tier,
)
from tokenmill.settings import Settings

log = logging.getLogger("tokenmill.gateway")

MAX_ATTEMPTS = 3
# The `endpoint` label of a request's metrics, by its body (/v1/responses says its own).
ENDPOINTS: dict[type, str] = {
    ChatCompletionRequest: "chat",
    CompletionRequest: "completions",
    EmbeddingRequest: "embeddings",
}


class Gateway:
    def __init__(
        self,
        settings: Settings,
        *,
        sessionmaker: async_sessionmaker[AsyncSession],
        fleet: FleetView,
        keys: KeyCache,
        admitter: Admitter,
        publisher: Publisher,
        upstream: Upstream,
        prep: Prep,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or GatewayMetrics.create()
        self.sessionmaker = sessionmaker
        self.fleet = fleet
        self.keys = keys
        self.admitter = admitter
        self.publisher = publisher
        self.upstream = upstream
        self.prep = prep
        self.limits = RequestLimits.from_settings(settings)
        self._settling: set[asyncio.Future[None]] = set()  # held so they are not collected mid-way
        self._internal = {
            "authorization": f"Bearer {settings.worker_credential}",
            "content-type": "application/json",
        }
        self.catalog = Catalog(settings, sessionmaker)
        self.batch_lines = BatchLines(settings, sessionmaker, keys)
        self._delta = msgspec.json.Decoder(GenerateDelta)
        self._embedded = msgspec.json.Decoder(EmbedResponse)

    # --- who and what ------------------------------------------------------------------

    async def authenticate(self, authorization: str | None) -> Caller:
        return await self.keys.caller(authorization)

    # --- admission -----------------------------------------------------------------------

    async def admit(
        self,
        caller: Caller,
        request_id: str,
        body: ChatCompletionRequest | CompletionRequest | EmbeddingRequest,
        *,
        client_request_id: str | None = None,
        batch_id: str | None = None,
        endpoint: str | None = None,
    ) -> Admitted:
        """Count the request, then resolve its model, prepare its prompt and admit its tokens;
        raises APIError (with the `x-ratelimit-*` headers known so far) when it may not run.
        What this returns holds limits and a budget hold: serve it with `stream` or `embed`,
        which give them back however the request ends. `client_request_id` (the caller's
        X-Client-Request-Id) and `batch_id` (`BatchLines.authenticate`) are only recorded;
        `endpoint` labels its metrics when the body's type does not say it."""
        started = time.perf_counter()
        headers = await self.admitter.count(caller, request_id)
        try:
            admitted = await self._prepare(caller, request_id, body, time.perf_counter() - started)
        except APIError as exc:
            exc.headers = {**headers, **exc.headers}
            raise
        admitted.ticket.headers = {**headers, **admitted.ticket.headers}
        admitted.client_request_id = client_request_id
        admitted.batch_id = batch_id
        target = admitted.target
        admitted.series = self.metrics.series(
            endpoint or ENDPOINTS[type(body)], target.base_model, target.deployment_id
        )
        return admitted

    async def _prepare(
        self,
        caller: Caller,
        request_id: str,
        body: ChatCompletionRequest | CompletionRequest | EmbeddingRequest,
        counted: float,
    ) -> Admitted:
        """`admit` once the request is counted (which took `counted` seconds): its model, its
        prompt (prepared off the event loop when large), then its tokens, concurrency and
        budget hold."""
        org, limits = caller.org_id, self.limits
        if isinstance(body, EmbeddingRequest):
            target = await self.catalog.resolve(caller, body.model, kind="embed")
            size = check_embedding(body, limits)
            tok = await self.catalog.tokenizer(target)
            if body.dimensions is not None:
                size_of = await self.catalog.embedding_dimensions(target)
                check_dimensions(body.dimensions, target.model, size_of)
            inputs = await self.prep.run(
                org, size, embedding_inputs, body, tok, context_length=target.context_length
            )
            tokens = sum(map(len, inputs))
            ticket = await self._admit(caller, target.priced_model, request_id, tokens, 0, counted)
            return Admitted(request_id, caller, target, ticket, inputs=inputs, user=body.user)
        target = await self.catalog.resolve(caller, body.model)
        chat = isinstance(body, ChatCompletionRequest)
        size = check_chat(body, limits) if chat else check_completion(body, limits)  # type: ignore[arg-type]
        tok = await self.catalog.tokenizer(target)
        context, defaults = target.context_length, target.defaults
        if isinstance(body, ChatCompletionRequest):
            prompt = await self.prep.run(
                org, size, chat_prompt, body, tok, context_length=context, defaults=defaults, single=False
            )
            prompts = [prompt]
        else:
            prompts = await self.prep.run(
                org, size, completion_prompts, body, tok, context_length=context, defaults=defaults
            )
        # The worst case is charged: each prompt once (as it is billed), `n` completions of each.
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        max_tokens = body.n * sum(p.sampling.max_tokens for p in prompts)
        model_id = target.priced_model
        ticket = await self._admit(caller, model_id, request_id, prompt_tokens, max_tokens, counted)
        tier = service_tier(body.service_tier) if isinstance(body, ChatCompletionRequest) else "default"
        return Admitted(
            request_id,
            caller,
            target,
            ticket,
            prompts=prompts,
            choices=Choices.of(body, prompts, tok),
            user=body.user,
            service_tier=tier,
        )

    async def _admit(
        self,
        caller: Caller,
        model_id: str | None,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        counted: float,
    ) -> Ticket:
        """`Admitter.admit`, given back if the caller is cancelled while it runs: a client
        leaving at that instant must not keep a concurrency slot and a budget hold until they
        expire on their own. Its time and the count's (`counted`) are the admission time."""
        started = time.perf_counter()
        task = asyncio.ensure_future(
            self.admitter.admit(caller, model_id, request_id, prompt_tokens, max_tokens)
        )
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._give_back)
            raise
        finally:
            self.metrics.admission.observe(counted + time.perf_counter() - started)

    def _give_back(self, task: asyncio.Future[Ticket]) -> None:
        if not task.cancelled() and task.exception() is None:
            settle = asyncio.ensure_future(self.admitter.settle(task.result(), 0, 0, 0))
            self._settling.add(settle)
            settle.add_done_callback(self._settling.discard)

    # --- generation ----------------------------------------------------------------------

    async def stream(self, admitted: Admitted) -> AsyncGenerator[ChoiceDelta, None]:
        """The deltas of every choice of the request as they come, each tagged with its
        choice: `n` sequences per prompt (choice i answers prompt i // n), each from a worker
        and retried on another until its first token arrives (`_sequence`). A sequence that
        fails after that fails the request.

        Exactly one usage event is published however this ends (finish, error, client
        gone; a batch's line only if answered: `_finish`), with the tokens of all its
        sequences, and the limits and budget hold are settled. Whoever admitted the request
        must start this generator at once (`respond` does): its `finally` is what settles.
        """
        caller, target, prompts, n = admitted.caller, admitted.target, admitted.prompts, admitted.choices.n
        series = admitted.series
        assert prompts and series
        started = time.monotonic()
        deadline = started + self.settings.max_stream_seconds
        ttft: float | None = None
        # Only what workers report is billed: a request no worker took costs nothing.
        lasts: dict[int, GenerateDelta] = {}
        status = "error"
        answered = False
        error_status: int | None = None  # the HTTP status of the error it ended with, if any
        try:
            # Each prompt's chained block hashes, salted per organisation (and adapter) exactly
            # as the engine salts them, so the router can find the worker that holds its prefix.
            extra = extra_keys(caller.cache_salt, target.adapter_id)
            sequences = []
            for p, prompt in enumerate(prompts):
                hashes = [h.hex() for h in hash_blocks(prompt.token_ids, self.settings.block_size, extra)]
                sequences += [self._sequence(admitted, p * n + k, hashes, deadline) for k in range(n)]
            merged = sequences[0] if len(sequences) == 1 else merge(sequences)
            async with aclosing(merged):
                async for item in merged:
                    if ttft is None:
                        ttft = time.monotonic() - started
                    lasts[item.index] = item.delta
                    yield item
            ends = (lasts[i].finish_reason for i in sorted(lasts))
            status = next((e for e in ends if e in ("error", "abort")), "ok")
            answered = True
        except (GeneratorExit, asyncio.CancelledError):
            status = "cancelled"
            raise
        except APIError as exc:
            error_status = exc.status
            exc.metered = True  # counted here, not as a refusal (gateway/accounting.py)
            raise
        finally:
            last, duration = total(lasts, n), time.monotonic() - started
            series.ended(last, status, ttft, duration, error_status, sequences=len(prompts) * n)
            await self._finish(admitted, last, status, ttft, duration, answered=answered)

    async def _sequence(
        self, admitted: Admitted, index: int, hashes: list[str], deadline: float
    ) -> AsyncGenerator[ChoiceDelta, None]:
        """Choice `index`'s deltas from a worker; retried on another worker until the first
        token arrives."""
        caller, target, prompts, n = admitted.caller, admitted.target, admitted.prompts, admitted.choices.n
        assert prompts
        prompt = prompts[index // n]
        sampling = prompt.sampling
        if index % n and sampling.seed is not None:
            # The `n` choices of a seeded request differ, and each is reproducible.
            sampling = msgspec.structs.replace(sampling, seed=sampling.seed + index % n)
        # A request of several sequences gives each its own id at the workers (`<id>.<choice>`);
        # the usage event keeps the request's.
        fanned = len(prompts) * n > 1
        request_id = f"{admitted.request_id}.{index}" if fanned else admitted.request_id
        body = msgspec.json.encode(
            GenerateRequest(
                request_id=request_id,
                prompt_token_ids=prompt.token_ids,
                sampling=sampling,
                adapter=target.adapter_id,
                cache_salt=caller.cache_salt,
                priority=admitted.priority,
                fairness_key=caller.org_id,
                adapter_key=target.adapter_key,
            )
        )
        logprobs = sampling.logprobs is not None
        tried: set[str] = set()
        first = True
        series = admitted.series
        assert series is not None
        while True:
            worker, cached_blocks = await self._worker(target, request_id, tried, hashes)
            if tried:  # sent again, to another worker
                series.retries.inc()
            series.routed_tokens.inc(len(prompt.token_ids))
            if cached_blocks:
                series.hit_tokens.inc(min(cached_blocks * self.settings.block_size, len(prompt.token_ids)))
            tried.add(worker.worker_id)
            worker.inflight += 1
            try:
                async with aclosing(self._stream(worker, body)) as deltas:
                    async for delta in deltas:
                        if logprobs and delta.token_ids and delta.logprobs is None:
                            # A worker of a version that does not compute them: another may.
                            raise _WorkerFailed("its deltas carry no logprobs")
                        if first:
                            first = False
                        elif time.monotonic() > deadline:
                            # A rollout waits this long for streams in flight: none may outlast it.
                            raise APIError(
                                504,
                                f"The response ran longer than the {self.settings.max_stream_seconds:g} "
                                "seconds a request may last; ask for fewer tokens.",
                                code="stream_too_long",
                            )
                        yield ChoiceDelta(index, delta)
                return
            except (UpstreamError, _WorkerFailed) as exc:
                self.fleet.forget(worker.worker_id)
                series.upstream_failed(isinstance(exc, UpstreamError) and exc.timeout)
                if not first or len(tried) >= MAX_ATTEMPTS:
                    log.warning("worker %s failed mid-request %s: %s", worker.worker_id, request_id, exc)
                    raise _worker_failure(exc, "The model worker") from exc
                log.info("worker %s failed before the first token; retrying elsewhere", worker.worker_id)
            finally:
                worker.inflight -= 1

    async def embed(self, admitted: Admitted) -> EmbedResponse:
        """Embeddings of the admitted inputs from a worker of the embed deployment, retried on
        another worker when one fails, metered once like a generation."""
        target, request_id, inputs = admitted.target, admitted.request_id, admitted.inputs
        assert inputs is not None
        series = admitted.series
        assert series is not None
        started = time.monotonic()
        done = GenerateDelta()
        status = "error"
        error_status: int | None = None
        try:
            body = msgspec.json.encode(EmbedRequest(request_id=request_id, inputs=inputs))
            tried: set[str] = set()
            while True:
                worker, _ = await self._worker(target, request_id, tried, [])
                if tried:  # sent again, to another worker
                    series.retries.inc()
                tried.add(worker.worker_id)
                worker.inflight += 1
                try:
                    async with self.upstream.post(worker.address, "/embed", body, self._internal) as r:
                        content = await r.read()
                    if r.status_code == 400:  # the worker's own validation: the caller's fault
                        err = msgspec.json.decode(content).get("error", {})
                        raise APIError(400, err.get("message", "Invalid input."), param="input")
                    if r.status_code != 200:
                        raise _WorkerFailed(f"status {r.status_code}: {content[:300]!r}")
                    result = self._embedded.decode(content)
                    done = GenerateDelta(prompt_tokens=result.prompt_tokens)
                    status = "ok"
                    return result
                except (UpstreamError, _WorkerFailed) as exc:
                    self.fleet.forget(worker.worker_id)
                    series.upstream_failed(isinstance(exc, UpstreamError) and exc.timeout)
                    if len(tried) >= MAX_ATTEMPTS:
                        raise _worker_failure(exc, "The embedding worker") from exc
                    log.info("worker %s failed on embeddings; retrying elsewhere", worker.worker_id)
                finally:
                    worker.inflight -= 1
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except APIError as exc:
            error_status = exc.status
            exc.metered = True  # counted here, not as a refusal (gateway/accounting.py)
            raise
        finally:
            duration = time.monotonic() - started
            series.ended(done, status, None, duration, error_status, sequences=1)
            await self._finish(admitted, done, status, None, duration, answered=status == "ok")

    async def _worker(self, target: Target, request_id: str, tried: set[str], hashes: list[str]) -> Route:
        wait = self.settings.worker_wait_seconds if not tried else 2 * self.settings.heartbeat_seconds
        route = await self.fleet.wait_for(
            target.deployment_id,
            wait,
            exclude=tried,
            hashes=hashes,
            request_id=request_id,
            adapter=target.adapter_id,
        )
        if route is None:
            raise APIError(
                503,
                f"No worker is serving '{target.model}' right now; please retry shortly.",
                code="no_worker_available",
            )
        return route

    async def _stream(self, worker: WorkerState, body: bytes) -> AsyncIterator[GenerateDelta]:
        async with self.upstream.post(worker.address, "/generate", body, self._internal) as r:
            if r.status_code == 400:  # the engine's own validation: the caller's fault, not the worker's
                err = msgspec.json.decode(await r.read()).get("error", {})
                raise APIError(400, err.get("message", "Invalid request."), param=err.get("param"))
            if r.status_code != 200:
                detail = (await r.read())[:500]
                raise _WorkerFailed(f"status {r.status_code}: {detail!r}")
            async for line in r.lines():
                yield self._delta.decode(line)

    async def _finish(
        self,
        admitted: Admitted,
        last: GenerateDelta,
        status: str,
        ttft: float | None,
        duration: float,
        *,
        answered: bool,
    ) -> None:
        """Settle the limits and budget hold, publish the usage event (`answered`: no error)."""
        ticket, caller, target = admitted.ticket, admitted.caller, admitted.target
        record = UsageRecord(
            request_id=ticket.request_id,
            org_id=caller.org_id,
            api_key_id=caller.key_id,
            model=target.model,
            adapter=target.adapter_id,
            deployment_id=target.deployment_id,
            prompt_tokens=last.prompt_tokens,
            cached_tokens=last.cached_tokens,
            completion_tokens=last.completion_tokens,
            ttft_ms=None if ttft is None else ttft * 1000,
            duration_ms=duration * 1000,
            status=status,
            ts=time.time(),
            user=admitted.user,
            client_request_id=admitted.client_request_id,
            service_tier=admitted.service_tier,
            batch_id=admitted.batch_id,
        )
        # Both at once (on Redis they go out in one write), shielded: a cancelled request
        # (client gone) must still settle and be metered.
        settle = self.admitter.settle(ticket, last.prompt_tokens, last.cached_tokens, last.completion_tokens)
        if admitted.batch_id is not None and not answered:
            # A batch's line is sent again, under the same request id, until it is answered: the
            # ledger keeps a request id's first event, which must be the answered run's.
            await asyncio.shield(settle)
            return
        await asyncio.shield(asyncio.gather(settle, self._publish(record)))

    async def _publish(self, record: UsageRecord) -> None:
        try:
            await self.publisher.publish(USAGE, record)
        except Exception:
            log.exception("could not publish usage event %s", record.request_id)


class _WorkerFailed(Exception):
    pass


def _worker_failure(exc: Exception, who: str) -> APIError:
    """503 for a worker that failed, 504 for one that stopped answering (its timeouts)."""
    if isinstance(exc, UpstreamError) and exc.timeout:
        return APIError(504, f"{who} did not answer in time; please retry.", code="worker_timeout")
    return APIError(503, f"{who} failed; please retry.", code="worker_error")
