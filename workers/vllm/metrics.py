"""A vLLM server's load, from its own Prometheus /metrics: what heartbeats and the worker's
/metrics report for a vLLM worker (running, waiting, KV usage, prefix cache counters).

Polled at the heartbeat interval: a heartbeat carries figures at most that old, as the
builtin worker's carry the engine's last step.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)


@dataclass(slots=True)
class VllmFigures:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 1 = full
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


# vLLM's metric (family name, without a counter's `_total`) -> our figure. With several
# engines (data parallel) each has its own series: counts add up, KV usage is their mean.
_SUMMED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:spec_decode_num_draft_tokens": "spec_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "spec_accepted_tokens",
}
_KV_USAGE = "vllm:kv_cache_usage_perc"


def parse_figures(text: str) -> VllmFigures:
    """The figures in a Prometheus text exposition of vLLM's (absent metrics count 0)."""
    figures = VllmFigures()
    sums: dict[str, float] = {}
    usage: list[float] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # By sample name: how the parser names a counter's family depends on its TYPE line.
            # A counter's samples are `<name>_total` and `<name>_created`: only the first counts.
            if sample.name.endswith("_created"):
                continue
            name = sample.name.removesuffix("_total")
            attr = _SUMMED.get(name)
            if attr is not None:
                sums[attr] = sums.get(attr, 0.0) + sample.value
            elif name == _KV_USAGE:
                usage.append(sample.value)
    for attr, value in sums.items():
        setattr(figures, attr, int(value))
    if usage:
        figures.kv_usage = sum(usage) / len(usage)
    return figures


class MetricsPoller:
    """Keeps `figures` fresh: one GET /metrics every `every` seconds while `run()` runs.

    A failed poll keeps the previous figures (the worker's heartbeats go on; a vLLM that is
    gone for good ends the worker through its child watch instead) and is logged once per outage.
    """

    def __init__(self, client: httpx.AsyncClient, every: float) -> None:
        self._client = client
        self.every = every
        self.figures = VllmFigures()
        self._healthy = True

    async def poll(self) -> VllmFigures:
        """Read /metrics now; raises httpx.HTTPError when vLLM does not answer."""
        resp = await self._client.get("/metrics", timeout=max(self.every, 5.0))
        resp.raise_for_status()
        # Parsing a few hundred lines: quick, but not nothing; off the event loop.
        self.figures = await asyncio.to_thread(parse_figures, resp.text)
        return self.figures

    async def run(self) -> None:
        while True:
            try:
                await self.poll()
                if not self._healthy:
                    log.info("vLLM's /metrics answers again")
                self._healthy = True
            except (httpx.HTTPError, ValueError) as exc:
                if self._healthy:
                    log.warning("reading vLLM's /metrics failed: %s", exc or type(exc).__name__)
                self._healthy = False
            await asyncio.sleep(self.every)
