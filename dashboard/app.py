"""The dashboard as its own small Litestar app, mounted by the composition root at /dashboard.

Its own app, rather than routes of the main one, because a browser UI needs what an API
does not and must not change for the API: Jinja templates, CSRF protection, a session
cookie, HTML error pages instead of OpenAI-shaped JSON ones, and no OpenAPI entries. The
main app hands it the shared parts (settings, database, bus, the catalogue's configuration)
and runs its one
background task, the fleet tail, since a mounted app receives no lifespan events.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from litestar import Litestar, Request, Response, Router, asgi
from litestar.config.csrf import CSRFConfig
from litestar.datastructures import CacheControlHeader, MutableScopeHeaders
from litestar.exceptions import HTTPException, NotFoundException, PermissionDeniedException
from litestar.middleware.session.client_side import CookieBackendConfig
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.response import Redirect, Template
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig
from litestar.types import Message, Receive, Scope, Send
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.batches.services import batch_service
from control_plane.catalog.config import CatalogConfig
from control_plane.deps import UNIT_DEPENDENCIES
from dashboard import PREFIX, filters
from dashboard.auth import (
    SESSION_COOKIE,
    DashboardSettings,
    LoginRequired,
    NoDashboard,
    derive,
    session_cookie,
)
from dashboard.controllers import ROUTES
from dashboard.fleet import FleetStatus
from dashboard.web import layout
from tokenmill.bodies import Request as BodyRequest
from tokenmill.bus import EventBus
from tokenmill.errors import APIError
from tokenmill.limits import RateLimiter, make_limiter
from tokenmill.settings import Settings
from tokenmill.storage import open_storage

log = logging.getLogger("tokenmill.dashboard")

HERE = Path(__file__).parent
CSRF_COOKIE = "tm_csrf"
# The one-line messages for the next page (web.flash) travel in an encrypted cookie of their
# own; who is signed in does not (dashboard/auth.py).
FLASH_COOKIE = "tm_flash"
FLASH_SECONDS = 600
# Pages hold one tenant's data (and once, a new key's secret): never cached, never framed,
# and only our own scripts and styles run.
SECURITY_HEADERS = {
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "content-security-policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
    "script-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
}
# Sent when TOKENMILL_PUBLIC_URL is https: a year, the usual value (and what preload lists ask).
HSTS = "max-age=31536000"
# Largest body of a dashboard form (Litestar's default is 10 MB); the adapter upload sets its own.
FORM_BODY_BYTES = 1 << 20


# --- error pages ----------------------------------------------------------------------------


ERROR_NAMES = {
    400: "That did not work",
    403: "Not allowed",
    404: "Not found",
    409: "Not possible now",
    413: "Too large",
    429: "Too many requests",
    500: "Server error",
}


def _error_page(request: Request[Any, Any, Any], status: int, message: str) -> Response[Any]:
    # Inside the layout, with the navigation when the guard saw who is signed in (every page
    # of the dashboard, unknown paths included: see `controllers.unknown_page`).
    context = layout(request, f"{ERROR_NAMES.get(status, 'Error')} ({status})") | {
        "status": status,
        "message": message,
        "back": _came_from(request),
    }
    return Template("error.html", context=context, status_code=status)


def _came_from(request: Request[Any, Any, Any]) -> str | None:
    """The dashboard page that led here (the form's page, after a refused post), if any."""
    referer = urlsplit(request.headers.get("referer", ""))
    if referer.netloc and referer.netloc != request.headers.get("host"):
        return None
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    target = referer.path + (f"?{referer.query}" if referer.query else "")
    if not referer.path.startswith(PREFIX + "/") or target == here or referer.path == PREFIX + "/login":
        return None
    return target


def _login_required(request: Request[Any, Any, Any], _: LoginRequired) -> Response[Any]:
    target = request.url.path
    if request.url.query:
        target += "?" + request.url.query
    # After signing in, back to the page asked for (only ever a dashboard page).
    query = f"?next={target}" if request.method == "GET" and target.startswith(PREFIX) else ""
    redirect = Redirect(f"{PREFIX}/login{query}", status_code=303)
    if SESSION_COOKIE in request.cookies:  # ended or expired: the browser may forget it
        redirect.set_cookie(session_cookie(request.app.state, None))
    return redirect


def _no_dashboard(request: Request[Any, Any, Any], _: NoDashboard) -> Response[Any]:
    request.scope["session"] = {}
    response = _error_page(
        request, 403, "The dashboard is for platform and organisation admins; members use API keys."
    )
    response.set_cookie(session_cookie(request.app.state, None))
    return response


def _api_error(request: Request[Any, Any, Any], exc: APIError) -> Response[Any]:
    return _error_page(request, exc.status, exc.message)


def _forbidden(request: Request[Any, Any, Any], exc: PermissionDeniedException) -> Response[Any]:
    # Litestar's CSRF middleware raises this when a form's token is missing or stale.
    return _error_page(request, 403, "This form has expired or did not come from this site; reload the page.")


def _http(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    return _error_page(request, exc.status_code, exc.detail or "Something went wrong.")


def _not_found(request: Request[Any, Any, Any], _: NotFoundException) -> Response[Any]:
    return _error_page(request, 404, "There is no such page.")


def _internal(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    log.exception("dashboard error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error_page(request, 500, "The server had an error; it has been logged.")


# --- the app --------------------------------------------------------------------------------


def _engine_callback(engine: JinjaTemplateEngine) -> None:
    filters.install(engine.engine)


def build_app(
    settings: Settings,
    *,
    sessionmaker: async_sessionmaker[AsyncSession],
    bus: EventBus,
    catalog: CatalogConfig,
    fleet: FleetStatus,
    limiter: RateLimiter,
    dashboard_settings: DashboardSettings | None = None,
) -> Litestar:
    dash = dashboard_settings or DashboardSettings()
    secure = is_https(settings.public_url)
    flashes = CookieBackendConfig(
        secret=derive(settings.secret_key, "flash"),
        key=FLASH_COOKIE,
        path=PREFIX,
        max_age=FLASH_SECONDS,
        httponly=True,
        samesite="lax",
        secure=secure,
    )
    csrf = CSRFConfig(
        secret=derive(settings.secret_key, "csrf").hex(),
        cookie_name=CSRF_COOKIE,
        cookie_path=PREFIX,
        cookie_httponly=True,  # scripts read the token from the page's <meta>, not the cookie
        cookie_secure=secure,
        cookie_samesite="lax",
        header_name="x-csrftoken",
    )
    static = create_static_files_router(
        path="/static",
        directories=[HERE / "static"],
        cache_control=CacheControlHeader(max_age=3600),
        name="dashboard-static",
    )
    app = Litestar(
        # Under the prefix inside too, so the app sees the paths the browser uses.
        route_handlers=[Router(path=PREFIX, route_handlers=[*ROUTES, static])],
        middleware=[flashes.middleware],
        csrf_config=csrf,
        template_config=TemplateConfig(
            directory=HERE / "templates", engine=JinjaTemplateEngine, engine_callback=_engine_callback
        ),
        # Each request one unit of work, as on the admin API: changes commit when the handler
        # returns and are announced to the gateways then.
        dependencies=dict(UNIT_DEPENDENCIES),
        exception_handlers={
            LoginRequired: _login_required,
            NoDashboard: _no_dashboard,
            APIError: _api_error,
            PermissionDeniedException: _forbidden,
            NotFoundException: _not_found,
            HTTPException: _http,
            Exception: _internal,
        },
        cache_control=CacheControlHeader(no_store=True),
        # Forms decoded without 500s and with bounded fields; form bodies are small (the
        # adapter upload streams its files under limits of its own).
        request_class=BodyRequest,
        request_max_body_size=FORM_BODY_BYTES,
        openapi_config=None,
        logging_config=None,
        debug=False,
    )
    app.state.update(
        {
            "settings": settings,
            "dashboard_settings": dash,
            "secure_cookies": secure,
            "sessionmaker": sessionmaker,
            "bus": bus,
            "catalog": catalog,
            "fleet": fleet,
            "limiter": limiter,
            # The batches page's: the app's one store of files (the catalogue's), which the
            # gateway's /v1/files writes to and the batch runner reads.
            "batches": batch_service(settings, sessionmaker, catalog.storage or open_storage(settings)),
        }
    )
    return app


@dataclass(slots=True)
class Mounted:
    """What the composition root adds to its app: the route, the services to start and
    stop with it, and what to close at shutdown."""

    handler: Any
    app: Litestar
    services: list[Any] = field(default_factory=list)
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


def is_https(url: str | None) -> bool:
    return bool(url) and urlsplit(url or "").scheme.lower() == "https"


def mount(
    settings: Settings,
    *,
    sessionmaker: async_sessionmaker[AsyncSession],
    bus: EventBus,
    catalog: CatalogConfig,
) -> Mounted:
    """The dashboard under /dashboard, for `create_app`."""
    fleet = FleetStatus(bus, timeout=settings.worker_timeout_seconds)
    # Login attempts: in Redis when there is one (shared by every replica), else in memory.
    limiter = make_limiter(settings)
    app = build_app(
        settings, sessionmaker=sessionmaker, bus=bus, catalog=catalog, fleet=fleet, limiter=limiter
    )

    security_headers = dict(SECURITY_HEADERS)
    if is_https(settings.public_url):
        # Browsers that saw the dashboard over https never try plain http for it again.
        security_headers["strict-transport-security"] = HSTS

    @asgi(PREFIX, is_mount=True, copy_scope=True, include_in_schema=False)
    async def dashboard(scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableScopeHeaders.from_message(message)
                # Server time up to the first byte (the page is rendered by then): what the
                # browser's devtools and bench/dashboard.py read.
                headers.add("server-timing", f"app;dur={(time.perf_counter() - started) * 1000:.1f}")
                for name, value in security_headers.items():
                    headers.add(name, value)
            await send(message)

        # Litestar hands a mount the rest of the path with a "/" appended ("/static/x.css/"),
        # which no file matches: take it off again unless the browser sent it.
        path = scope["path"]
        if path != "/" and path.endswith("/") and not bytes(scope.get("raw_path") or b"").endswith(b"/"):
            path = path[:-1]
        # A scope of its own (the outer app's per-request state must not leak into this one),
        # with the whole path, as the browser sent it.
        inner = {**scope, "path": PREFIX + path, "state": {}}
        await app(inner, receive, send_with_headers)  # type: ignore[arg-type]

    return Mounted(dashboard, app, services=[fleet], closers=[limiter.close])
