"""Who is on the other end of a connection, and how often they failed to authenticate.

The client address of a request is the TCP peer, unless that peer is one of
`TOKENMILL_TRUSTED_PROXIES`: then it is the rightmost `X-Forwarded-For` entry that is not
itself a trusted proxy (each proxy appends the address it received the request from, so
everything left of that entry was written by the client and proves nothing). With no
trusted proxies (the default) the header is ignored: anyone can send it, and rotating it
must not buy a fresh rate-limit bucket.

The server must not rewrite the peer itself (uvicorn does, from 127.0.0.1, unless its
`proxy_headers` is off, as `tokenmill.cli` runs it), or this sees the forged address.
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

UNKNOWN = "unknown"  # a connection without a peer address (a Unix socket, a test transport)


@lru_cache(maxsize=16)
def trusted_networks(spec: str) -> tuple[Network, ...]:
    """`TOKENMILL_TRUSTED_PROXIES` parsed: comma- or space-separated addresses and CIDR
    blocks. ValueError naming the entry that is neither."""
    networks = []
    for item in spec.replace(",", " ").split():
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(
                f"TOKENMILL_TRUSTED_PROXIES: {item!r} is not an IP address or CIDR block"
            ) from None
    return tuple(networks)


def check_trusted_proxies(spec: str) -> str:
    """Settings validator: the value unchanged, or ValueError."""
    trusted_networks(spec)
    return spec


def _parse(text: str) -> IPAddress | None:
    text = text.strip()
    if text.startswith("["):  # "[2001:db8::1]:443", as some proxies write IPv6
        text = text[1 : text.find("]")] if "]" in text else text
    elif text.count(":") == 1:  # "192.0.2.1:443"
        text = text.split(":", 1)[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _trusted(address: IPAddress, networks: tuple[Network, ...]) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # "::ffff:10.0.0.1" from a dual-stack socket
    return any(address in n for n in networks)


def client_address(scope: Any, trusted: tuple[Network, ...]) -> str:
    """The client address of a request (an ASGI scope, or a Litestar Request/connection)."""
    scope = getattr(scope, "scope", scope)
    client = scope.get("client")
    peer = str(client[0]) if client else UNKNOWN
    if not trusted:
        return peer
    peer_ip = _parse(peer)
    if peer_ip is None or not _trusted(peer_ip, trusted):
        return peer
    forwarded = [
        value.decode("latin-1")
        for name, value in scope.get("headers", ())
        if name.lower() == b"x-forwarded-for"
    ]
    hops = [h for h in ",".join(forwarded).split(",") if h.strip()]
    for hop in reversed(hops):
        address = _parse(hop)
        if address is None:
            # A proxy we trust wrote something that is not an address: the peer is all we know.
            return peer
        if not _trusted(address, trusted):
            return str(address)
    # Every hop is one of our proxies: the leftmost is as close to the client as we get.
    first = _parse(hops[0]) if hops else None
    return str(first) if first is not None else peer


def throttle_key(address: str) -> str:
    """What failures are counted against: the address, or its /64 for IPv6 (one host
    commonly holds a whole /64, so single IPv6 addresses cost an attacker nothing)."""
    parsed = _parse(address)
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is None:
        return str(ipaddress.IPv6Network((parsed, 64), strict=False))
    return str(parsed.ipv4_mapped if isinstance(parsed, ipaddress.IPv6Address) else parsed or address)


class FailureThrottle:
    """Failed authentications per client address, in process and bounded.

    Each address may fail `per_minute` times in a burst, then once every `60/per_minute`
    seconds (GCRA: one "theoretical arrival time" per address). While an address is over,
    `retry_after` says so before anything else is looked at, so a flood of bad keys costs a
    dictionary lookup rather than a database read. At most `max_addresses` are remembered,
    least recently failed first out; an address whose budget is full again is forgotten.
    Per process: N replicas allow N times the budget, which is still a bound.
    """

    def __init__(
        self,
        per_minute: int,
        *,
        max_addresses: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_minute = per_minute
        self.max_addresses = max_addresses
        self._clock = clock
        self._interval = 60.0 / per_minute if per_minute > 0 else 0.0
        self._tats: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tats)

    def retry_after(self, address: str) -> float:
        """Seconds until `address` may try again; 0 when it may now."""
        if self.per_minute <= 0 or not self._tats:  # the usual case: nobody failed lately
            return 0.0
        tat = self._tats.get(throttle_key(address))
        if tat is None:
            return 0.0
        # One more failure would put it past a full minute of budget.
        return max(0.0, tat - self._clock() - (60.0 - self._interval))

    def failed(self, address: str) -> None:
        if self.per_minute <= 0:
            return
        key, now = throttle_key(address), self._clock()
        self._tats[key] = max(self._tats.get(key, now), now) + self._interval
        self._tats.move_to_end(key)
        while len(self._tats) > self.max_addresses:
            self._tats.popitem(last=False)
        # Forget what is idle again, oldest first, so the table shrinks when floods stop.
        while self._tats:
            oldest, tat = next(iter(self._tats.items()))
            if tat > now:
                break
            del self._tats[oldest]


@contextmanager
def auth_failures(request: Any) -> Iterator[None]:
    """Around an authentication: 429 (OpenAI-style, with Retry-After) at once if the client's
    address failed too often, and a 401 raised inside counted against it. One throttle
    per app (`app.state.auth_failures`), shared by the gateway and the admin API."""
    from tokenmill.errors import APIError  # Litestar loads with it; settings import this module

    state = request.app.state
    throttle: FailureThrottle | None = state.get("auth_failures")
    settings = state.settings
    if throttle is None:
        throttle = state.auth_failures = FailureThrottle(settings.auth_failures_per_minute)
    address = client_address(request.scope, trusted_networks(settings.trusted_proxies))
    wait = throttle.retry_after(address)
    if wait:
        seconds = str(int(wait) + 1)
        raise APIError(
            429,
            f"Too many requests with invalid API keys from your address; try again in {seconds} s.",
            code="too_many_authentication_failures",
            headers={"retry-after": seconds},
        )
    try:
        yield
    except APIError as exc:
        if exc.status == 401:
            throttle.failed(address)
        raise
