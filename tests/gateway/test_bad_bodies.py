"""Bodies that cannot be decoded, sent everywhere a body is read (issue 14, acceptance 4): every
JSON operation of `/v1` and `/admin/v1` (taken from the served document, so a new one is
covered), `/internal/bus`, and every form of the dashboard. Invalid UTF-8 inside a JSON
string and 10,000-deep nesting used to be 500s with a traceback; now they are 400s that
say what is wrong, like truncated and malformed bodies. (The Stripe webhook's signed bodies:
tests/billing/test_stripe_webhook.py.)"""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx
import pytest

from dashboard.controllers import PAGES, login, logout
from tests.dashboard.conftest import PASSWORD, sign_in
from tests.gateway.conftest import INTERNAL, Env

DEEP = b"[" * 10_000 + b"]" * 10_000
JSON_BODIES: dict[str, tuple[bytes, str]] = {
    # body, and the message it gets
    "invalid UTF-8 in a string": (
        b'{"model": "m", "messages": [{"role": "user", "content": "caf\xe9 \xff"}]}',
        "JSON is malformed: a string is not valid UTF-8.",
    ),
    "invalid UTF-8 in a key": (b'{"\xc3\x28": 1}', "JSON is malformed: a string is not valid UTF-8."),
    "10,000 levels of arrays": (DEEP, "JSON is nested too deeply."),
    "10,000 levels of objects": (b'{"a":' * 10_000 + b"1" + b"}" * 10_000, "JSON is nested too deeply."),
    "truncated": (b'{"model": "m", "messages": [{"role": "us', "Input data was truncated"),
    "not JSON": (b"\x00\x01", "JSON is malformed: invalid character (byte 0)"),
}


def json_operations(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted(
        (method.upper(), path)
        for path, item in doc["paths"].items()
        if path.startswith(("/v1/", "/admin/v1/"))
        for method, op in item.items()
        if "application/json" in op.get("requestBody", {}).get("content", {})
    )


def filled(path: str) -> str:
    """A path template with every parameter naming nothing (the body is read first anyway)."""
    return re.sub(r"\{[^}]+\}", "nope", path)


async def test_every_json_operation_answers_undecodable_bodies_with_a_400(
    gateway_env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    doc = (await gateway_env.client.get("/openapi.json")).json()
    operations = json_operations(doc)
    assert len(operations) >= 19 and ("POST", "/v1/chat/completions") in operations
    headers = {"authorization": f"Bearer {gateway_env.admin_key}", "content-type": "application/json"}
    with caplog.at_level(logging.ERROR):
        for method, path in operations:
            for why, (body, message) in JSON_BODIES.items():
                r = await gateway_env.client.request(method, filled(path), content=body, headers=headers)
                assert r.status_code == 400, (method, path, why, r.status_code, r.text)
                assert r.json() == {
                    "error": {
                        "message": message,
                        "type": "invalid_request_error",
                        "param": None,
                        "code": None,
                    }
                }, (method, path, why)
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"


async def test_the_internal_bus_answers_undecodable_bodies_with_a_400(gateway_env: Env) -> None:
    headers = {"authorization": f"Bearer {INTERNAL}", "content-type": "application/json"}
    for why, (body, message) in JSON_BODIES.items():
        r = await gateway_env.client.post("/internal/bus/tm:workers", content=body, headers=headers)
        assert r.status_code == 400, (why, r.text)
        assert r.json()["error"] == {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_json",
        }, why


def multipart(fields: list[tuple[str, bytes, str]]) -> tuple[bytes, str]:
    """A multipart body of raw text fields (name, bytes, extra part headers)."""
    boundary = "b0undary"
    parts = [
        f'--{boundary}\r\ncontent-disposition: form-data; name="{name}"\r\n{extra}\r\n'.encode()
        + value
        + b"\r\n"
        for name, value, extra in fields
    ]
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


async def test_every_dashboard_form_answers_bad_bodies_without_a_server_error(
    gateway_env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    c = gateway_env.client
    root = {"authorization": f"Bearer {gateway_env.admin_key}"}
    org = (await c.get("/admin/v1/organizations", headers=root)).json()[0]["id"]
    r = await c.post(
        f"/admin/v1/organizations/{org}/users",
        headers=root,
        json={"email": "root@example.com", "password": PASSWORD, "role": "platform_admin"},
    )
    assert r.status_code == 201, r.text
    session = await sign_in(str(c.base_url), "root@example.com")
    assert (await session.get("/")).status_code == 200 and session.token
    token = session.token
    # Sign-out and sign-in last: the others need the session.
    handlers = [h for h in PAGES if "POST" in h.http_methods] + [login, logout]
    paths = [filled(next(iter(h.paths))) for h in handlers]
    assert len(paths) >= 15

    text = [("_csrf_token", token.encode(), ""), ("org", org.encode(), "")]
    bodies: dict[str, tuple[bytes, str]] = {
        "urlencoded, invalid UTF-8": (
            b"name=caf\xe9\xff&org=" + org.encode(),
            "application/x-www-form-urlencoded",
        ),
        "multipart, invalid UTF-8": multipart([*text, ("name", b"caf\xe9\xff", "")]),
        "multipart, unknown charset": multipart(
            [*text, ("name", b"x", "content-type: text/plain; charset=no-such-charset\r\n")]
        ),
        "multipart, truncated": (multipart([*text, ("name", b"x" * 100, "")])[0][:-30], multipart([])[1]),
        "multipart, not multipart": (b"\xff" * 64, multipart([])[1]),
        "JSON, 10,000 deep": (DEEP, "application/json"),
        "JSON, invalid UTF-8": (JSON_BODIES["invalid UTF-8 in a string"][0], "application/json"),
    }
    statuses: dict[int, int] = {}
    with caplog.at_level(logging.ERROR):
        for path in paths:
            for why, (body, content_type) in bodies.items():
                # The token as a header (what the page's script sends: the handler reads the
                # form) and in the form only (Litestar's CSRF middleware reads it first).
                for header in ({"x-csrftoken": token}, {}):
                    r = await session.client.post(
                        "/dashboard" + path, content=body, headers={"content-type": content_type, **header}
                    )
                    assert r.status_code < 500, (path, why, header, r.status_code, r.text[:500])
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
    # The undecodable multipart bodies were refused as such, not only redirected around.
    assert statuses.get(400, 0) >= 3 * len(paths), statuses
    await session.client.aclose()


async def test_multipart_text_fields_are_bounded_in_dashboard_forms(gateway_env: Env) -> None:
    """Any form, before any page logic: a text field past 64 KiB is a 413, within the 1 MiB a
    form body may have, even though the CSRF middleware reads the form before sign-in."""
    body, content_type = multipart([("_csrf_token", b"x", ""), ("email", b"a" * (200 << 10), "")])
    async with httpx.AsyncClient(base_url=str(gateway_env.client.base_url)) as c:
        r = await c.post("/dashboard/login", content=body, headers={"content-type": content_type})
    assert r.status_code == 413 and "Form field &#39;email&#39; is larger than 65536 bytes." in r.text
    # and a whole form body past 1 MiB is refused by its size alone
    body, content_type = multipart([("_csrf_token", b"x", ""), ("email", b"a" * (2 << 20), "")])
    async with httpx.AsyncClient(base_url=str(gateway_env.client.base_url)) as c:
        r = await c.post("/dashboard/login", content=body, headers={"content-type": content_type})
    assert r.status_code == 413
