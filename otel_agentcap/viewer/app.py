"""The Starlette application of ``otel-agentcap ui``: pages, static assets and a read-only JSON
API over the event log.

Every database session it opens is read-only (``default_transaction_read_only``) with a statement
timeout. Bound to loopback it answers only requests whose ``Host`` names this machine (so a web page
on another origin cannot reach it through DNS rebinding). With tokens (``otel_agentcap.tokens``;
required beyond loopback) every request needs one as a bearer token, or the cookie that ``/login``
sets once a token is typed in a browser; a token bound to some runs lists and shows those runs
only, any other run answers 404 as an unknown one.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any, Final
from urllib.parse import parse_qs, quote

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from otel_agentcap.exporters.postgres import store
from otel_agentcap.exporters.postgres.connection import check_not_closed_by_server
from otel_agentcap.exporters.postgres.errors import (
    AgentCapStorageError,
    LockWaitTimeout,
    RunNotFound,
)
from otel_agentcap.serving import TlsConfig
from otel_agentcap.tokens import ANONYMOUS, Authenticator, Principal, RunScope, session_value

from . import documents

_log = logging.getLogger(__name__)

COOKIE: Final = "agentcap_session"
_LOCKED: Final = (
    "the event log is unavailable: another session holds a lock on it (a migration or other "
    "DDL?); try again later"
)
STATEMENT_TIMEOUT_MS: Final = 30_000
LOOPBACK_HOSTS: Final = frozenset({"localhost", "127.0.0.1", "::1"})
#: The largest body ``/login`` reads: a form with one token (at most 512 characters) is far
#: smaller; a larger body is answered 413 unread.
MAX_LOGIN_FORM: Final = 4096

#: The principal of a request without a valid token, on the pages that need none: no run.
NOBODY: Final = Principal("nobody", RunScope())
#: The key of the request's principal in its ASGI scope.
_PRINCIPAL: Final = "otel_agentcap.principal"

_CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)


@dataclass(frozen=True, slots=True)
class ViewerConfig:
    dsn: str
    #: The bearer tokens; with any, every request needs one (a server bound beyond loopback must
    #: have some), and a token bound to runs sees only those.
    authenticator: Authenticator = field(default_factory=Authenticator)
    #: Serve HTTPS with this certificate (``ViewerServer``).
    tls: TlsConfig | None = None
    #: Base address of a Jaeger UI, for links to an event's span (``None``: no links).
    jaeger_url: str | None = None
    #: Host names (without port) a request may name; ``None`` accepts any (token-protected).
    allowed_hosts: frozenset[str] | None = LOOPBACK_HOSTS
    #: How often an open run page asks whether the run grew.
    poll_seconds: float = 2.0
    pool_size: int = 4
    #: How long a request waits for a database connection before answering 503.
    connect_timeout: float = 10.0
    #: How long a query waits for a lock another session holds on a table of the log (a
    #: migration, other DDL) before the request answers 503 saying so; 0: up to the statement
    #: timeout (30 s).
    lock_timeout: float = store.READ_LOCK_TIMEOUT


def static_text(name: str) -> str:
    """A file shipped in ``otel_agentcap/viewer/static``."""
    return resources.files("otel_agentcap.viewer").joinpath("static", name).read_text("utf-8")


@cache
def _page(name: str) -> str:
    return static_text(name)


@cache
def _run_page() -> str:
    from .pages import served_run_page

    return served_run_page()


def _host_name(raw: str) -> str:
    if raw.startswith("["):  # [::1]:8080
        return raw[1:].split("]", 1)[0].lower()
    return raw.rsplit(":", 1)[0].lower() if raw.count(":") == 1 else raw.lower()


class GuardMiddleware:
    """Host check, token check and security headers, in front of every route."""

    def __init__(self, app: ASGIApp, config: ViewerConfig) -> None:
        self.app = app
        self.config = config

    def _principal(self, scope: Scope) -> Principal | None:
        """Who sent the request: its bearer token, else its login cookie; None if neither is a
        configured token's."""
        authenticator = self.config.authenticator
        if not authenticator.enabled:
            return ANONYMOUS
        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization")
        if authorization is not None:
            principal = authenticator.authenticate(authorization.decode("latin-1"))
            if principal is not None:
                return principal
        for part in headers.get(b"cookie", b"").decode("latin-1").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE:
                return authenticator.check_session(value)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        allowed = self.config.allowed_hosts
        host = _host_name(headers.get(b"host", b"").decode("latin-1"))
        if allowed is not None and host not in allowed:
            await JSONResponse({"error": "unknown host"}, status_code=400)(scope, receive, send)
            return
        path: str = scope["path"]
        public = path == "/login" or path.startswith("/static/")
        principal = self._principal(scope)
        # In the request's own scope: the "state" dict may be shared by the requests of a
        # connection, or of the server (Hypercorn 0.17 passes the lifespan state itself).
        scope[_PRINCIPAL] = principal or NOBODY
        if principal is None and not public:
            if path.startswith("/api/"):
                response: Response = JSONResponse(
                    {"error": "a bearer token is required"},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
            else:
                response = RedirectResponse(f"/login?next={quote(path)}", status_code=303)
            await response(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = [
                    (b"content-security-policy", _CSP.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"),
                    (b"cache-control", b"no-store"),
                ]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, send_with_headers)


class _JsonResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":"), default=str).encode()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _int_param(request: Request, name: str, default: int | None = None) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"missing parameter {name!r}")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"parameter {name!r} must be an integer") from None


def _text(name: str, value: str) -> str:
    """A text parameter as the log can hold it: PostgreSQL text has no NUL character, so one
    with NUL names nothing stored (400 rather than a database error)."""
    if "\x00" in value:
        raise ValueError(f"parameter {name!r} must not contain NUL")
    return value


def _principal(request: Request) -> Principal:
    principal: Principal = request.scope[_PRINCIPAL]
    return principal


def _run_param(request: Request) -> str:
    """The run a request names; ``RunNotFound`` (404) when its token may not read it, as for a
    run that is not stored."""
    run_id = request.query_params.get("run")
    if not run_id:
        raise ValueError("missing parameter 'run'")
    _text("run", run_id)
    if not _principal(request).allows(run_id):
        raise RunNotFound(run_id)
    return run_id


def create_app(config: ViewerConfig) -> Starlette:
    """The ASGI application; its lifespan opens and closes the read-only connection pool."""
    pool: ConnectionPool[Any] = ConnectionPool(
        config.dsn,
        min_size=1,
        max_size=config.pool_size,
        open=False,
        name="agentcap-ui",
        kwargs={"autocommit": True},
        configure=lambda conn: _configure_connection(conn, config.lock_timeout),
        reconnect_timeout=0,
        # One the server closed while idle (idle_session_timeout, a restart) is replaced before
        # a request uses it, instead of answering 503 (no round trip).
        check=check_not_closed_by_server,
    )

    @contextlib.contextmanager
    def connection() -> Iterator[psycopg.Connection[Any]]:
        with pool.connection(timeout=config.connect_timeout) as conn:
            yield conn

    def api(handler: Callable[[Request, psycopg.Connection[Any]], Any]) -> Callable[..., Any]:
        def endpoint(request: Request) -> Response:
            try:
                with connection() as conn:
                    answer = handler(request, conn)
                return answer if isinstance(answer, Response) else _JsonResponse(answer)
            except ValueError as exc:
                return _error(400, str(exc))
            except LookupError as exc:  # RunNotFound is one
                return _error(404, str(exc))
            except (LockWaitTimeout, psycopg.errors.LockNotAvailable):
                _log.warning("the event log is locked: %s", _LOCKED)
                return _error(503, _LOCKED)
            except (PoolTimeout, AgentCapStorageError, psycopg.OperationalError) as exc:
                _log.warning("the event log is unavailable: %s", exc)
                return _error(503, f"the event log is unavailable: {exc}")
            except psycopg.Error as exc:
                _log.exception("query of the web view failed")
                return _error(500, f"database error: {str(exc).strip().splitlines()[0]}")

        return endpoint

    def runs(request: Request, conn: psycopg.Connection[Any]) -> Any:
        return documents.runs_document(
            conn,
            limit=_int_param(request, "limit", 200),
            offset=_int_param(request, "offset", 0),
            search=_text("q", request.query_params.get("q") or "") or None,
            scope=_principal(request).scope,
        )

    def run(request: Request, conn: psycopg.Connection[Any]) -> Any:
        return documents.run_document(conn, _run_param(request))

    def version(request: Request, conn: psycopg.Connection[Any]) -> Any:
        return documents.version_document(conn, _run_param(request))

    def labels(request: Request, conn: psycopg.Connection[Any]) -> Any:
        agents = [_text("agent", a) for a in request.query_params.getlist("agent")] or None
        return documents.labels_document(
            conn,
            _run_param(request),
            _int_param(request, "from"),
            _int_param(request, "to"),
            agents,
        )

    def event(request: Request, conn: psycopg.Connection[Any]) -> Any:
        agent = request.query_params.get("agent")
        if agent is None:
            raise ValueError("missing parameter 'agent'")
        return documents.event_document(
            conn, _run_param(request), _text("agent", agent), _int_param(request, "seq")
        )

    def payload(request: Request, conn: psycopg.Connection[Any]) -> Any:
        run_id = _run_param(request)
        if "conflict" in request.query_params:
            text = documents.payload_text(conn, run_id, conflict_id=_int_param(request, "conflict"))
        else:
            agent = request.query_params.get("agent")
            if agent is None:
                raise ValueError("missing parameter 'agent' (or 'conflict')")
            text = documents.payload_text(
                conn, run_id, agent_id=_text("agent", agent), seq=_int_param(request, "seq")
            )
        return Response(text, media_type="application/json")

    def conflict(request: Request, conn: psycopg.Connection[Any]) -> Any:
        return documents.conflict_document(conn, _run_param(request), _int_param(request, "id"))

    def settings(request: Request) -> Response:
        return _JsonResponse(
            {"jaeger_url": config.jaeger_url, "poll_ms": int(config.poll_seconds * 1000)}
        )

    def runs_page(request: Request) -> Response:
        return HTMLResponse(_page("runs.html"))

    def run_stored(request: Request) -> bool:
        """False when the page's run is known not to be stored, or not the token's; True too
        when the log cannot be asked (the page then says what the API answers)."""
        run_id: str = request.path_params["run_id"] or request.query_params.get("run", "")
        if not run_id or "\x00" in run_id or not _principal(request).allows(run_id):
            return False
        try:
            with connection() as conn:
                store.run_start(conn, run_id)
        except RunNotFound:
            return False
        except (PoolTimeout, AgentCapStorageError, psycopg.Error) as exc:
            _log.warning("the event log is unavailable: %s", exc)
        return True

    def run_page(request: Request) -> Response:
        # The page of a run that is not stored is a 404, as its API answers are: the page says
        # why once it asks.
        return HTMLResponse(_run_page(), status_code=200 if run_stored(request) else 404)

    async def login(request: Request) -> Response:
        if not config.authenticator.enabled:
            return RedirectResponse("/", status_code=303)
        target = request.query_params.get("next", "/")
        if not target.startswith("/") or target.startswith("//"):
            target = "/"
        if request.method == "POST":
            body = await _small_body(request, MAX_LOGIN_FORM)
            if body is None:
                return PlainTextResponse("the login form is too large", status_code=413)
            form = parse_qs(body.decode("utf-8", "replace"))
            presented = (form.get("token") or [""])[0].strip()
            if config.authenticator.check_token(presented) is not None:
                response = RedirectResponse(target, status_code=303)
                response.set_cookie(
                    COOKIE,
                    session_value(presented),
                    httponly=True,
                    samesite="strict",
                    secure=request.url.scheme == "https",
                )
                return response
            return HTMLResponse(_page("login.html"), status_code=401)
        return HTMLResponse(_page("login.html"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        pool.open(wait=False)
        try:
            yield
        finally:
            pool.close()

    static = resources.files("otel_agentcap.viewer").joinpath("static")
    routes = [
        Route("/", runs_page),
        Route("/runs/{run_id:path}", run_page),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/api/config", settings),
        Route("/api/runs", api(runs)),
        Route("/api/run", api(run)),
        Route("/api/run/version", api(version)),
        Route("/api/run/labels", api(labels)),
        Route("/api/run/event", api(event)),
        Route("/api/run/conflict", api(conflict)),
        Route("/api/run/payload", api(payload)),
        Mount("/static", app=StaticFiles(directory=str(static)), name="static"),
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(GuardMiddleware, config=config)],
        lifespan=lifespan,
    )


async def _small_body(request: Request, limit: int) -> bytes | None:
    """The request's body, or None as soon as it is longer than ``limit`` bytes: the rest is
    never read, so a client cannot make the server hold a body of any size."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return body


def _configure_connection(
    conn: psycopg.Connection[Any], lock_timeout: float = store.READ_LOCK_TIMEOUT
) -> None:
    conn.execute(b"SET default_transaction_read_only = on")
    conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}".encode())
    store.limit_lock_waits(conn, lock_timeout)
