"""The ASGI application of ``smthrs serve`` (FastAPI): the review page, ``POST /rpc`` and ``/projections``.

Invariants
- **Nothing is parsed that was not bounded.** ``/rpc`` refuses a ``Content-Length`` over :data:`MAX_BODY_BYTES`
  before reading a byte (``413``), and reads a body without one chunk by chunk, refusing as soon as the count
  passes the bound: a hostile client can make the server hold at most one bounded body per request.
- **A mutation is authenticated before it is looked at** (``_auth.py``): the method name is the only thing read
  from an unauthenticated mutation; ``401`` (no credential) / ``403`` (wrong one), nothing written.
- **HTTP status**: ``200`` for every JSON-RPC response to a well-formed call (a result, or an error object for a
  typed refusal), ``503`` with ``Retry-After`` for an error object marked ``retryable`` (a passing fault of the
  store: the same call succeeds once it is gone), ``400`` when the body is not one JSON-RPC request
  (``-32700``/``-32600``), ``401``/``403`` for the credential, ``413`` over the size bound, ``500`` for a bug
  (``-32603``).
- **Loopback stays loopback**: a server bound to a loopback address answers only requests whose ``Host`` names a
  loopback host (``421`` otherwise), so a web page cannot reach it through DNS rebinding. Pages are never framed
  (``frame-ancestors 'none'``): a framed Approve button could be clicked for someone else.
- **Slow clients are the protocol's business** (``_connections``): header and body deadlines close them; a body cut
  short that way ends its request here without a traceback, nothing parsed.
- Blocking work (the database) runs on worker threads; the event loop only moves bytes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from ..errors import ControlError, InvalidInput, SmthrsError
from ..runtime import Runtime
from ._auth import ServeAuth
from ._projections import Projections
from .rpc import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    PARSE_ERROR,
    REFUSED,
    Methods,
    RpcFailure,
    error_response,
    parse_call,
)
from .wire import MAX_BODY_BYTES

__all__ = ["create_app", "STATIC_DIR", "MAX_BODY_BYTES"]

STATIC_DIR = Path(__file__).with_name("static")
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
_SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", b"frame-ancestors 'none'"),
    (b"referrer-policy", b"no-referrer"),
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def create_app(
    rt: Runtime,
    auth: ServeAuth,
    *,
    stopping: threading.Event | None = None,
    loopback_host: str | None = None,
) -> ASGIApp:
    """The application over ``rt``'s database. ``stopping`` ends live projection streams when set (the server sets
    it on SIGTERM/SIGINT); ``loopback_host`` (the loopback address the server is bound to, or None for a network
    bind) turns on the ``Host`` check. Mutations go through ``rt``'s control plane (the one it hands out)."""
    control = rt.control()
    methods = Methods(rt, control, auth.principal)
    projections = Projections(rt.db, stopping if stopping is not None else threading.Event())
    app = FastAPI(
        title="smthrs serve",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        swagger_ui_oauth2_redirect_url=None,
    )

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        page = STATIC_DIR / "index.html"
        if not page.is_file():
            missing = ControlError(
                "invalid_options",
                "the review page is not installed with this package; reinstall smthrs_plugin",
            )
            return _json({"error": _public(missing)}, 404)
        return FileResponse(
            page, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-store"}
        )

    app.mount("/static", StaticFiles(directory=STATIC_DIR, check_dir=False), name="static")

    @app.post("/rpc", include_in_schema=False)
    async def rpc(request: Request) -> Response:
        body = await _bounded_body(request)
        if isinstance(body, Response):
            return body
        try:
            call = parse_call(body)
        except RpcFailure as failure:
            status = 400 if failure.rpc_code in (PARSE_ERROR, INVALID_REQUEST) else 200
            return _json(failure.response(), status)
        if call.mutation:
            verdict = auth.verdict(request.headers.get("authorization"))
            if verdict != "ok":
                refused = ControlError(
                    "unauthorized",
                    f"{call.method} changes state: send `Authorization: Bearer <token>` (the token `smthrs serve` "
                    "printed, or the configured credential)"
                    + ("" if verdict == "missing" else "; the credential sent is not valid"),
                )
                return _json(
                    error_response(call.id, REFUSED, refused),
                    401 if verdict == "missing" else 403,
                    {"WWW-Authenticate": 'Bearer realm="smthrs"'},
                )
        answer = await run_in_threadpool(methods.call, call)
        error = answer.get("error", {})
        if error.get("code") == INTERNAL_ERROR:
            return _json(answer, 500)
        if error.get("data", {}).get("retryable"):
            return _json(
                answer, 503, {"Retry-After": "5"}
            )  # a passing fault: proxies and clients retry on 503
        return _json(answer, 200)

    @app.get("/projections", include_in_schema=False)
    async def projections_http(request: Request) -> Response:
        return await projections.http(request)

    @app.websocket("/projections")
    async def projections_ws(websocket: WebSocket) -> None:
        await projections.websocket(websocket)

    return _guarded(app, loopback_host)


def _public(exc: SmthrsError) -> dict[str, Any]:
    data = exc.to_dict()
    data.pop("cause", None)
    return data


def _json(payload: Any, status: int, headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps(payload, sort_keys=True, default=str),
        status_code=status,
        media_type="application/json",
        headers={"Cache-Control": "no-store", **(headers or {})},
    )


def _too_large(detail: str) -> Response:
    refused = InvalidInput(
        "invalid_input",
        f"the request body {detail} is over {MAX_BODY_BYTES:,} bytes; store large data as an artifact and pass its "
        "digest (bound 'canonical_bytes')",
        bound="canonical_bytes",
        limit=MAX_BODY_BYTES,
    )
    # The rest of the body is not read: the connection cannot be reused.
    return _json(error_response(None, INVALID_REQUEST, refused), 413, {"Connection": "close"})


async def _bounded_body(request: Request) -> bytes | Response:
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            malformed = ControlError("invalid_options", "malformed Content-Length", option="content-length")
            return _json(error_response(None, INVALID_REQUEST, malformed), 400)
        if int(length) > MAX_BODY_BYTES:
            return _too_large(f"announced ({int(length):,} bytes)")
    buf = bytearray()
    try:
        async for chunk in request.stream():
            if len(buf) + len(chunk) > MAX_BODY_BYTES:
                return _too_large("sent")
            buf += chunk
    except ClientDisconnect:
        # The connection closed before the body was complete (the client left, or missed the body deadline and
        # the server closed it): nothing was parsed or run, and this answer has no reader — it only ends the request.
        gone = ControlError(
            "request_timeout",
            "the connection closed before the request body was complete; send the whole body",
        )
        return _json(error_response(None, INVALID_REQUEST, gone), 400)
    return bytes(buf)


def _guarded(app: ASGIApp, loopback_host: str | None) -> ASGIApp:
    """``app`` behind the ``Host`` check of a loopback bind and with the security headers on every response."""
    allowed = None if loopback_host is None else _LOOPBACK_NAMES | {loopback_host.lower()}

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await app(scope, receive, send)
            return
        if allowed is not None and _host_name(scope) not in allowed:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": "unexpected Host"})
                return
            refused = ControlError(
                "invalid_options",
                "this server is bound to loopback and answers only for a loopback Host (open "
                "http://127.0.0.1:PORT/): another name could be a web page reaching it through DNS rebinding",
                option="host",
            )
            response = _json({"error": _public(refused)}, 421)
            await response(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_SECURITY_HEADERS]
            await send(message)

        await app(scope, receive, send_with_headers)

    return guarded


def _host_name(scope: Scope) -> str:
    for name, value in scope.get("headers", []):
        if name == b"host":
            host = value.decode("latin-1").strip().lower()
            if host.startswith("["):
                return host[: host.find("]") + 1]
            return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return ""
