"""The client address of a request (X-Forwarded-For only from trusted proxies) and the
failed-authentication throttle (bounded, GCRA per address)."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill.clients import FailureThrottle, client_address, throttle_key, trusted_networks
from tokenmill.settings import Settings


def scope(peer: str | None, *forwarded: str) -> dict[str, Any]:
    return {
        "client": (peer, 50000) if peer else None,
        "headers": [(b"x-forwarded-for", f.encode()) for f in forwarded],
    }


def test_the_header_is_ignored_unless_the_peer_is_a_trusted_proxy() -> None:
    none = trusted_networks("")
    assert client_address(scope("198.51.100.7", "203.0.113.9"), none) == "198.51.100.7"
    proxies = trusted_networks("10.0.0.0/8, 192.0.2.1")
    # an untrusted peer cannot name anyone
    assert client_address(scope("198.51.100.7", "203.0.113.9"), proxies) == "198.51.100.7"
    # a trusted one names the client it received the request from
    assert client_address(scope("192.0.2.1", "203.0.113.9"), proxies) == "203.0.113.9"
    assert client_address(scope("10.1.2.3", "203.0.113.9"), proxies) == "203.0.113.9"


def test_the_rightmost_untrusted_hop_is_the_client() -> None:
    proxies = trusted_networks("10.0.0.0/8")
    # The client wrote "1.1.1.1" itself; our proxies appended what they saw.
    s = scope("10.0.0.5", "1.1.1.1, 203.0.113.9", "10.0.0.4")
    assert client_address(s, proxies) == "203.0.113.9"
    # every hop one of ours: the leftmost
    assert client_address(scope("10.0.0.5", "10.9.9.9, 10.0.0.4"), proxies) == "10.9.9.9"
    # no header, or garbage where an address should be: the peer itself
    assert client_address(scope("10.0.0.5"), proxies) == "10.0.0.5"
    assert client_address(scope("10.0.0.5", "1.1.1.1, not-an-ip"), proxies) == "10.0.0.5"
    # ports and brackets as some proxies write them
    assert client_address(scope("10.0.0.5", "[2001:db8::1]:443"), proxies) == "2001:db8::1"
    assert client_address(scope("10.0.0.5", "203.0.113.9:1234"), proxies) == "203.0.113.9"
    # a dual-stack socket's IPv4-mapped peer is still the trusted proxy
    assert client_address(scope("::ffff:10.0.0.5", "203.0.113.9"), proxies) == "203.0.113.9"
    assert client_address(scope(None, "203.0.113.9"), proxies) == "unknown"


def test_trusted_proxies_are_checked_when_settings_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_TRUSTED_PROXIES", "10.0.0.0/8,proxy.internal")
    with pytest.raises(ValueError, match=r"'proxy\.internal' is not an IP address or CIDR block"):
        Settings()
    monkeypatch.setenv("TOKENMILL_TRUSTED_PROXIES", "10.0.0.0/8 fd00::/8")
    assert len(trusted_networks(Settings().trusted_proxies)) == 2


def test_failures_are_a_burst_then_one_per_interval() -> None:
    now = [1000.0]
    throttle = FailureThrottle(6, clock=lambda: now[0])  # a burst of 6, then one per 10 s
    for _ in range(6):
        assert throttle.retry_after("198.51.100.7") == 0
        throttle.failed("198.51.100.7")
    assert throttle.retry_after("198.51.100.7") == pytest.approx(10.0)
    assert throttle.retry_after("198.51.100.8") == 0  # others are not affected
    now[0] += 10.0
    assert throttle.retry_after("198.51.100.7") == 0
    throttle.failed("198.51.100.7")
    assert throttle.retry_after("198.51.100.7") == pytest.approx(10.0)
    # a quiet minute later the address is forgotten altogether
    now[0] += 61.0
    throttle.failed("198.51.100.9")
    assert len(throttle) == 1


def test_the_throttle_is_bounded_and_counts_ipv6_by_slash_64() -> None:
    throttle = FailureThrottle(1, max_addresses=100)
    for i in range(1000):
        throttle.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(throttle) == 100
    assert throttle.retry_after("10.0.3.231") > 0  # the most recent are the ones kept
    assert throttle_key("2001:db8:1:2:aaaa::1") == throttle_key("2001:db8:1:2:bbbb::2") == "2001:db8:1:2::/64"
    throttle.failed("2001:db8:1:2:aaaa::1")
    assert throttle.retry_after("2001:db8:1:2:ffff::9") > 0
    assert throttle.retry_after("2001:db8:1:3::1") == 0
    assert throttle_key("::ffff:192.0.2.1") == "192.0.2.1"
    assert FailureThrottle(0).retry_after("10.0.0.1") == 0  # 0 turns it off
