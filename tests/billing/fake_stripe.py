"""A local stand-in for the parts of the Stripe API that `billing/stripe/` uses.

It speaks Stripe's wire format so the official SDK talks to it unmodified (only `base_addresses`
points here): form-encoded request bodies with bracketed nesting (`metadata[org_id]=...`,
`lines[0][amount]=...`), JSON objects shaped like Stripe's (`id`, `object`, ...), Stripe's list
and search envelopes, the error body `{"error": {"type", "message", "code", "param"}}`, bearer
or basic authentication with the secret key, and `Idempotency-Key` semantics: a key seen again
with the same method, path and parameters replays the first response (header
`Idempotent-Replayed: true`); with anything different it is a 400 `idempotency_error`. As in
Stripe, only responses of requests that executed are saved (2xx here), not validation errors.

Meter events are deduplicated by `identifier` the way Stripe promises (the second one is
accepted and ignored). Every request is recorded in `calls`, so tests can count what Stripe saw.

Endpoints:
  POST /v1/customers, GET /v1/customers/{id}, GET /v1/customers/search
  POST /v1/invoices, GET /v1/invoices, GET /v1/invoices/{id}, POST /v1/invoices/{id}/finalize
  POST /v1/invoiceitems, GET /v1/invoiceitems
  POST /v1/billing/meter_events

`fail(method, path, times)` makes the next requests to an endpoint answer 500 (crash tests);
`pay(invoice_id)` / `fail_payment(invoice_id)` change an invoice and return the webhook event
Stripe would send, and `sign(payload, secret)` signs one as Stripe does.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

import uvicorn
from litestar import Litestar, Request, Response, get, post
from litestar.params import FromPath

API_KEY = "sk_test_fake_tokenmill"

_TOKEN = re.compile(r"\[([^\]]*)\]")


def parse_form(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Stripe's bracket notation into nested dicts and lists: `a[b][0][c]=v` → {"a": {"b": [{"c": "v"}]}}."""
    root: dict[str, Any] = {}
    for raw_key, value in pairs:
        head, _, rest = raw_key.partition("[")
        path = [head, *_TOKEN.findall("[" + rest)] if rest else [head]
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return _listify(root)


def _listify(node: Any) -> Any:
    # Dicts whose keys are all indices were arrays (`lines[0]`, `lines[1]`, ...).
    if not isinstance(node, dict):
        return node
    out = {k: _listify(v) for k, v in node.items()}
    if out and all(k.isdigit() for k in out):
        return [out[k] for k in sorted(out, key=int)]
    return out


class StripeError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", **extra: Any):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"type": type, "message": message, **extra}}


@dataclass
class Call:
    method: str
    path: str
    params: dict[str, Any]
    idempotency_key: str | None
    status: int
    replayed: bool = False
    response: dict[str, Any] = field(default_factory=dict)


def _public(obj: Any) -> Any:
    """A copy of a stored object without the fake's own bookkeeping (keys starting with `_`)."""
    if isinstance(obj, dict):
        return {k: _public(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [_public(v) for v in obj]
    return obj


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def _int(params: dict[str, Any], name: str, *, required: bool = False) -> int | None:
    value = params.get(name)
    if value is None:
        if required:
            raise StripeError(400, f"Missing required param: {name}.", param=name, code="parameter_missing")
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise StripeError(
            400, f"Invalid integer: {value}", param=name, code="parameter_invalid_integer"
        ) from None


def _missing(params: dict[str, Any], *names: str) -> None:
    for name in names:
        if not params.get(name):
            raise StripeError(400, f"Missing required param: {name}.", param=name, code="parameter_missing")


class FakeStripe:
    """State and HTTP app of the fake; `with FakeStripe() as fake:` serves it on a free port."""

    def __init__(self, api_key: str = API_KEY) -> None:
        self.api_key = api_key
        self.calls: list[Call] = []
        self.customers: dict[str, dict[str, Any]] = {}
        self.invoices: dict[str, dict[str, Any]] = {}
        self.invoice_items: dict[str, dict[str, Any]] = {}
        self.meter_events: dict[str, dict[str, Any]] = {}  # by identifier: what Stripe counts
        self._idempotency: dict[str, tuple[str, int, dict[str, Any]]] = {}
        self._failures: dict[tuple[str, str], tuple[int, int]] = {}  # (let through first, then fail)
        # Stripe's clock, for the 35-day window of meter event timestamps; tests move it.
        self.clock: Callable[[], float] = time.time
        self._seq = 0  # creation order, for Stripe's newest-first lists
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    # --- for tests --------------------------------------------------------------------------

    def created(self, method: str, path: str) -> list[Call]:
        """Requests that executed (not replays, not errors): what Stripe really did."""
        return [
            c
            for c in self.calls
            if c.method == method and c.path == path and c.status == 200 and not c.replayed
        ]

    def fail(self, method: str, path: str, times: int = 1, *, after: int = 0) -> None:
        """After `after` more requests to `method path` (the path with ids, e.g.
        /v1/invoiceitems) went through, the next `times` ones get a 500."""
        self._failures[(method, path)] = (after, times)

    def pay(self, invoice_id: str) -> dict[str, Any]:
        inv = self.invoices[invoice_id]
        inv.update(status="paid", amount_paid=inv["amount_due"], amount_remaining=0, paid=True)
        return self.event("invoice.paid", inv)

    def fail_payment(self, invoice_id: str) -> dict[str, Any]:
        inv = self.invoices[invoice_id]
        inv["attempt_count"] = inv.get("attempt_count", 0) + 1
        return self.event("invoice.payment_failed", inv)

    def event(self, type: str, obj: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": _id("evt"),
            "object": "event",
            "api_version": "2025-01-27.acacia",
            "created": int(time.time()),
            "livemode": False,
            "pending_webhooks": 1,
            "type": type,
            "data": {"object": _public(obj)},
        }

    @staticmethod
    def sign(payload: bytes, secret: str, timestamp: int | None = None) -> str:
        """The `Stripe-Signature` header of `payload`: HMAC-SHA256 of `{t}.{payload}`."""
        t = int(time.time()) if timestamp is None else timestamp
        mac = hmac.new(secret.encode(), f"{t}.".encode() + payload, hashlib.sha256).hexdigest()
        return f"t={t},v1={mac}"

    # --- serving ----------------------------------------------------------------------------

    def __enter__(self) -> FakeStripe:
        # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY on accepted connections only then,
        # and without it every keep-alive response waits ~40 ms for a delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        server = uvicorn.Server(uvicorn.Config(self.app(), log_level="warning", lifespan="off"))
        self._server = server
        # Its own thread and loop: usable from sync code and from any test's event loop.
        self._thread = threading.Thread(
            target=lambda: asyncio.run(server.serve(sockets=[sock])), name="fake-stripe", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake Stripe did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def app(self) -> Litestar:
        fake = self

        async def dispatch(request: Request, handler: Any, *args: str) -> Response[Any]:
            method, path = request.method, request.url.path
            raw = request.url.query if method == "GET" else (await request.body()).decode()
            params = parse_form(parse_qsl(raw or "", keep_blank_values=True))
            key = request.headers.get("idempotency-key")
            try:
                fake._authenticate(request.headers.get("authorization"))
                skip, times = fake._failures.get((method, path), (0, 0))
                if skip:
                    fake._failures[(method, path)] = (skip - 1, times)
                elif times:
                    fake._failures[(method, path)] = (0, times - 1)
                    raise StripeError(500, "Simulated Stripe failure.", type="api_error")
                if key is not None and method == "POST":
                    fingerprint = json.dumps([method, path, params], sort_keys=True)
                    seen = fake._idempotency.get(key)
                    if seen is not None:
                        if seen[0] != fingerprint:
                            raise StripeError(
                                400,
                                "Keys for idempotent requests can only be used with the same parameters "
                                "they were first used with. Try using a key other than "
                                f"'{key}' if you meant to execute a different request.",
                                type="idempotency_error",
                            )
                        fake.calls.append(Call(method, path, params, key, seen[1], True, seen[2]))
                        return Response(seen[2], status_code=seen[1], headers={"Idempotent-Replayed": "true"})
                body = _public(handler(params, *args))
                if key is not None and method == "POST":
                    fake._idempotency[key] = (fingerprint, 200, body)
                fake.calls.append(Call(method, path, params, key, 200, False, body))
                return Response(body, status_code=200, headers={"Request-Id": _id("req")})
            except StripeError as exc:
                fake.calls.append(Call(method, path, params, key, exc.status, False, exc.body))
                return Response(exc.body, status_code=exc.status, headers={"Request-Id": _id("req")})

        @post("/v1/customers")
        async def create_customer(request: Request) -> Response[Any]:
            return await dispatch(request, fake._create_customer)

        @get("/v1/customers/search")
        async def search_customers(request: Request) -> Response[Any]:
            return await dispatch(request, fake._search_customers)

        @get("/v1/customers/{customer_id:str}")
        async def get_customer(request: Request, customer_id: FromPath[str]) -> Response[Any]:
            return await dispatch(request, fake._get, customer_id)

        @post("/v1/invoices")
        async def create_invoice(request: Request) -> Response[Any]:
            return await dispatch(request, fake._create_invoice)

        @get("/v1/invoices")
        async def list_invoices(request: Request) -> Response[Any]:
            return await dispatch(request, fake._list_invoices)

        @get("/v1/invoices/{invoice_id:str}")
        async def get_invoice(request: Request, invoice_id: FromPath[str]) -> Response[Any]:
            return await dispatch(request, fake._get, invoice_id)

        @post("/v1/invoices/{invoice_id:str}/finalize")
        async def finalize_invoice(request: Request, invoice_id: FromPath[str]) -> Response[Any]:
            return await dispatch(request, fake._finalize_invoice, invoice_id)

        @post("/v1/invoiceitems")
        async def create_invoice_item(request: Request) -> Response[Any]:
            return await dispatch(request, fake._create_invoice_item)

        @get("/v1/invoiceitems")
        async def list_invoice_items(request: Request) -> Response[Any]:
            return await dispatch(request, fake._list_invoice_items)

        @post("/v1/billing/meter_events")
        async def create_meter_event(request: Request) -> Response[Any]:
            return await dispatch(request, fake._create_meter_event)

        return Litestar(
            [
                create_customer,
                search_customers,
                get_customer,
                create_invoice,
                list_invoices,
                get_invoice,
                finalize_invoice,
                create_invoice_item,
                list_invoice_items,
                create_meter_event,
            ],
            openapi_config=None,
        )

    # --- behaviour --------------------------------------------------------------------------

    def _authenticate(self, authorization: str | None) -> None:
        scheme, _, value = (authorization or "").partition(" ")
        key = value
        if scheme.lower() == "basic":  # curl -u sk_...: is how Stripe's own docs call it
            with contextlib.suppress(ValueError):
                key = base64.b64decode(value).decode().partition(":")[0]
        if not value:
            raise StripeError(
                401,
                "You did not provide an API key. You need to provide your API key in the Authorization "
                "header, using Bearer auth (e.g. 'Authorization: Bearer YOUR_SECRET_KEY').",
            )
        if not hmac.compare_digest(key.encode(), self.api_key.encode()):
            raise StripeError(401, f"Invalid API Key provided: {key[:8]}{'*' * 8}")

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _customer(self, customer_id: Any, param: str = "customer") -> dict[str, Any]:
        if not isinstance(customer_id, str) or customer_id not in self.customers:
            raise StripeError(400, f"No such customer: '{customer_id}'", param=param, code="resource_missing")
        return self.customers[customer_id]

    def _get(self, _: dict[str, Any], object_id: str) -> dict[str, Any]:
        for store in (self.customers, self.invoices):
            if object_id in store:
                return store[object_id]
        raise StripeError(404, f"No such object: '{object_id}'", param="id", code="resource_missing")

    def _create_customer(self, params: dict[str, Any]) -> dict[str, Any]:
        customer = {
            "id": _id("cus"),
            "object": "customer",
            "created": int(time.time()),
            "livemode": False,
            "name": params.get("name"),
            "email": params.get("email"),
            "description": params.get("description"),
            "metadata": params.get("metadata") or {},
            "_seq": self._next(),
        }
        self.customers[customer["id"]] = customer
        return customer

    def _search_customers(self, params: dict[str, Any]) -> dict[str, Any]:
        # Only the form this project sends: metadata['key']:'value'.
        query = params.get("query") or ""
        m = re.fullmatch(r"\s*metadata\['([^']+)'\]\s*:\s*'([^']*)'\s*", query)
        if m is None:
            raise StripeError(400, f"Unsupported search query in the fake: {query!r}", param="query")
        found = [c for c in self.customers.values() if c["metadata"].get(m[1]) == m[2]]
        return {
            "object": "search_result",
            "url": "/v1/customers/search",
            "data": sorted(found, key=lambda c: -c["_seq"]),
            "has_more": False,
            "next_page": None,
        }

    def _create_invoice(self, params: dict[str, Any]) -> dict[str, Any]:
        _missing(params, "customer")
        customer = self._customer(params["customer"])
        invoice_id = _id("in")
        invoice = {
            "id": invoice_id,
            "object": "invoice",
            "created": int(time.time()),
            "livemode": False,
            "customer": customer["id"],
            "currency": params.get("currency") or "usd",
            "description": params.get("description"),
            "metadata": params.get("metadata") or {},
            "status": "draft",
            "auto_advance": params.get("auto_advance") == "true",
            "collection_method": params.get("collection_method") or "charge_automatically",
            "pending_invoice_items_behavior": params.get("pending_invoice_items_behavior") or "exclude",
            "number": None,
            "lines": {
                "object": "list",
                "data": [],
                "has_more": False,
                "url": f"/v1/invoices/{invoice_id}/lines",
            },
            "subtotal": 0,
            "total": 0,
            "amount_due": 0,
            "amount_paid": 0,
            "amount_remaining": 0,
            "attempt_count": 0,
            "_seq": self._next(),
        }
        if invoice["pending_invoice_items_behavior"] == "include":
            for item in self.invoice_items.values():
                if item["customer"] == customer["id"] and item["invoice"] is None:
                    self._attach(item, invoice)
        self.invoices[invoice_id] = invoice
        return invoice

    def _attach(self, item: dict[str, Any], invoice: dict[str, Any]) -> None:
        item["invoice"] = invoice["id"]
        invoice["lines"]["data"].append(
            {
                "id": _id("il"),
                "object": "line_item",
                "amount": item["amount"],
                "currency": item["currency"],
                "description": item["description"],
                "metadata": item["metadata"],
                "period": item["period"],
            }
        )
        total = sum(line["amount"] for line in invoice["lines"]["data"])
        invoice.update(subtotal=total, total=total, amount_due=total, amount_remaining=total)

    def _list(self, items: list[dict[str, Any]], params: dict[str, Any], url: str) -> dict[str, Any]:
        limit = min(max(_int(params, "limit") or 10, 1), 100)
        items = sorted(items, key=lambda o: -o["_seq"])  # newest first, as Stripe lists
        if after := params.get("starting_after"):
            ids = [o["id"] for o in items]
            if after not in ids:
                raise StripeError(400, f"No such object: '{after}'", param="starting_after")
            items = items[ids.index(after) + 1 :]
        return {"object": "list", "url": url, "data": items[:limit], "has_more": len(items) > limit}

    def _list_invoices(self, params: dict[str, Any]) -> dict[str, Any]:
        found = list(self.invoices.values())
        if customer := params.get("customer"):
            found = [i for i in found if i["customer"] == customer]
        if status := params.get("status"):
            found = [i for i in found if i["status"] == status]
        return self._list(found, params, "/v1/invoices")

    def _finalize_invoice(self, params: dict[str, Any], invoice_id: str) -> dict[str, Any]:
        invoice = self.invoices.get(invoice_id)
        if invoice is None:
            raise StripeError(
                404, f"No such invoice: '{invoice_id}'", param="invoice", code="resource_missing"
            )
        if invoice["status"] != "draft":
            raise StripeError(
                400,
                "This invoice is already finalized, you can't re-finalize a non-draft invoice.",
                code="invoice_not_editable",
            )
        if "auto_advance" in params:
            invoice["auto_advance"] = params["auto_advance"] == "true"
        invoice["status"] = "open" if invoice["amount_due"] > 0 else "paid"
        invoice["number"] = f"TM-{len([i for i in self.invoices.values() if i['number']]) + 1:04d}"
        return invoice

    def _create_invoice_item(self, params: dict[str, Any]) -> dict[str, Any]:
        _missing(params, "customer", "currency")
        customer = self._customer(params["customer"])
        amount = _int(params, "amount", required=True)
        invoice = None
        if invoice_id := params.get("invoice"):
            invoice = self.invoices.get(invoice_id)
            if invoice is None or invoice["customer"] != customer["id"]:
                raise StripeError(
                    400, f"No such invoice: '{invoice_id}'", param="invoice", code="resource_missing"
                )
            if invoice["status"] != "draft":
                raise StripeError(
                    400, "You can only add invoice items to draft invoices.", code="invoice_not_editable"
                )
            if invoice["currency"] != params["currency"]:
                raise StripeError(
                    400, "The currency of the item differs from the invoice's.", param="currency"
                )
        period = params.get("period") or {}
        item = {
            "id": _id("ii"),
            "object": "invoiceitem",
            "customer": customer["id"],
            "amount": amount,
            "currency": params["currency"],
            "description": params.get("description"),
            "metadata": params.get("metadata") or {},
            "period": {"start": _int(period, "start") or 0, "end": _int(period, "end") or 0},
            "invoice": None,
            "livemode": False,
            "date": int(time.time()),
            "_seq": self._next(),
        }
        self.invoice_items[item["id"]] = item
        if invoice is not None:
            self._attach(item, invoice)
        return item

    def _list_invoice_items(self, params: dict[str, Any]) -> dict[str, Any]:
        found = list(self.invoice_items.values())
        if invoice := params.get("invoice"):
            found = [i for i in found if i["invoice"] == invoice]
        if customer := params.get("customer"):
            found = [i for i in found if i["customer"] == customer]
        return self._list(found, params, "/v1/invoiceitems")

    def _create_meter_event(self, params: dict[str, Any]) -> dict[str, Any]:
        _missing(params, "event_name", "payload")
        payload = params["payload"]
        if not isinstance(payload, dict):
            raise StripeError(400, "Invalid object", param="payload")
        customer_id = payload.get("stripe_customer_id")
        if not customer_id:
            raise StripeError(
                400, "Missing stripe_customer_id in payload.", param="payload[stripe_customer_id]"
            )
        self._customer(customer_id, "payload[stripe_customer_id]")
        value = payload.get("value")
        if value is None or not re.fullmatch(r"-?\d+(\.\d+)?", str(value)):
            raise StripeError(400, "payload[value] must be a number.", param="payload[value]")
        now = int(self.clock())
        timestamp = _int(params, "timestamp") or now
        if timestamp < now - 35 * 86400 or timestamp > now + 300:
            raise StripeError(
                400,
                "Timestamp must be within the past 35 calendar days or up to 5 minutes in the future.",
                param="timestamp",
            )
        identifier = params.get("identifier") or _id("mev")
        event = {
            "object": "billing.meter_event",
            "created": now,
            "event_name": params["event_name"],
            "identifier": identifier,
            "livemode": False,
            "payload": payload,
            "timestamp": timestamp,
        }
        # Stripe enforces identifier uniqueness (for at least 24 h): a second event with the same
        # identifier is not counted again.
        return self.meter_events.setdefault(identifier, event)
