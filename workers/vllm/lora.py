"""LoRA adapters of a vLLM worker: fetched from our storage (workers.adapters, as the builtin
worker does), then registered with vLLM through its runtime adapter endpoints
(`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`); a request names a loaded adapter as
its model.

vLLM reads the files from the path it is given, so it must see this worker's adapter cache
(the same host, or a volume both containers mount). It keeps every registered adapter until
unloaded and swaps their weights into its `max_loras` slots itself; the worker registers at
most `capacity` of them, least recently used out, so heartbeats list a bounded set as the
builtin worker's do. Errors are `AdapterProblem`s with the builtin worker's statuses and
codes, carrying vLLM's own message where vLLM refused.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import httpx

from workers.adapters import AdapterProblem, FetchAdapter, check_adapter_key, fetch_files

log = logging.getLogger(__name__)

# (adapter id, storage key or None) -> local directory of its PEFT files (workers.adapters).
LOAD_TIMEOUT = 300.0  # vLLM reads and checks the weights before answering


def _message(resp: httpx.Response) -> str:
    """vLLM's error message (`{"error": {"message"}}`, FastAPI's `{"detail"}`), else the body."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:500] or f"HTTP {resp.status_code}"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if body.get("detail"):
            return str(body["detail"])
    return str(body)[:500]


class VllmAdapters:
    def __init__(
        self,
        client: httpx.AsyncClient,
        fetch: FetchAdapter | None,
        *,
        enabled: bool | None,
        capacity: int,
    ) -> None:
        """`enabled`: whether the server was started with adapters (None: unknown, so try);
        `capacity`: most adapters registered at once."""
        self._client = client
        self._fetch = fetch
        self.enabled = enabled
        self.capacity = max(1, capacity)
        self._loaded: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._loading: dict[str, asyncio.Future[list[str]]] = {}

    @property
    def ids(self) -> list[str]:
        return list(self._loaded)

    def touch(self, adapter_id: str) -> None:
        """A request uses it: the most recently used now."""
        if adapter_id in self._loaded:
            self._loaded.move_to_end(adapter_id)

    def forget(self, adapter_id: str) -> None:
        """vLLM does not know it (it said so): load it again next time."""
        self._loaded.pop(adapter_id, None)

    async def load(self, adapter_id: str, key: str | None = None) -> list[str]:
        """Register an adapter with vLLM unless it is; returns the ids unregistered to make
        room. Concurrent loads of one adapter share one."""
        if self.enabled is False:
            raise AdapterProblem(400, "this worker does not serve adapters", "adapters_disabled")
        if key:
            key = check_adapter_key(adapter_id, key)
        if adapter_id in self._loaded:
            self.touch(adapter_id)
            return []
        pending = self._loading.get(adapter_id)
        if pending is None:
            pending = asyncio.ensure_future(self._load(adapter_id, key))
            self._loading[adapter_id] = pending
            pending.add_done_callback(lambda _: self._loading.pop(adapter_id, None))
        # Shielded: one caller giving up (client gone) must not cancel the others' load.
        return await asyncio.shield(pending)

    async def _load(self, adapter_id: str, key: str | None) -> list[str]:
        path = await fetch_files(self._fetch, adapter_id, key)
        body = {"lora_name": adapter_id, "lora_path": str(path)}
        try:
            resp = await self._client.post("/v1/load_lora_adapter", json=body, timeout=LOAD_TIMEOUT)
        except httpx.HTTPError as exc:
            raise AdapterProblem(
                503, f"the vLLM server did not load adapter {adapter_id!r}: {exc}", "adapter_unavailable"
            ) from exc
        if resp.status_code == 404 and "detail" in resp.text:
            # FastAPI's own 404: the route is missing, i.e. runtime loading is off on that server.
            raise AdapterProblem(
                400,
                "the vLLM server does not load adapters at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
                "adapters_disabled",
            )
        if resp.status_code != 200:
            # Refusals (a rank above --max-lora-rank, adapters off, a CPU build without LoRA)
            # are the adapter's or the deployment's, the same on every worker: a 400 with
            # vLLM's own words, so the gateway does not try the next worker for nothing.
            message = _message(resp)
            log.warning("vLLM refused adapter %s (HTTP %d): %s", adapter_id, resp.status_code, message)
            raise AdapterProblem(400, message, "invalid_adapter")
        self._loaded[adapter_id] = None
        evicted = await self._evict()
        log.info(
            "loaded adapter %s from %s%s",
            adapter_id,
            path,
            f"; unloaded {', '.join(evicted)}" if evicted else "",
        )
        return evicted

    async def _evict(self) -> list[str]:
        evicted = []
        while len(self._loaded) > self.capacity:
            victim = next(iter(self._loaded))
            # Requests running on it keep it (vLLM holds their adapter); new ones load it again.
            problem = await self._unregister(victim)
            self._loaded.pop(victim, None)
            if problem is None or problem.status == 404:
                evicted.append(victim)
            else:
                log.warning("unloading adapter %s failed: %s", victim, problem)
        return evicted

    async def unload(self, adapter_id: str) -> None:
        if adapter_id not in self._loaded:
            raise AdapterProblem(404, f"adapter {adapter_id!r} is not loaded", "adapter_not_loaded")
        problem = await self._unregister(adapter_id)
        if problem is not None and problem.status != 404:
            raise problem
        self._loaded.pop(adapter_id, None)

    async def _unregister(self, adapter_id: str) -> AdapterProblem | None:
        try:
            resp = await self._client.post("/v1/unload_lora_adapter", json={"lora_name": adapter_id})
        except httpx.HTTPError as exc:
            return AdapterProblem(
                503, f"the vLLM server did not unload adapter {adapter_id!r}: {exc}", "adapter_unavailable"
            )
        if resp.status_code == 200:
            return None
        if resp.status_code == 404:
            return AdapterProblem(404, _message(resp), "adapter_not_loaded")
        return AdapterProblem(400, _message(resp), "invalid_adapter")
