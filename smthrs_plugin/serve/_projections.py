"""``/projections``: a run's watch events over HTTP (``application/x-ndjson``) and WebSocket, resumable by cursor.

Each event is the object ``smthrs watch RUN --json`` prints per line (``wire.event_payload``: ``{sequence, kind,
run_id, occurred_at_ms, payload, cursor, partition}``, the ``payload`` being the journal record as written).

Invariants
- **Gap- and duplicate-free across reconnects** because nothing here keeps state of its own: every connection is one
  :func:`~smthrs_plugin.observe.watch.watch` of one run, started strictly after the ``after_cursor`` the client
  brings back (the last event it processed). Events are sent in the watch's order, one per line / message, so the
  last complete one a client received is exactly where it resumes.
- **Refused before streaming**: a missing or malformed ``run_id``/``after_cursor``, a cursor of another run or
  database, or a run this database has neither a row nor a journal for (``run_not_found``, as ``smthrs watch``)
  answers ``400``/``404`` with ``{"error": ...}`` (HTTP) or one ``{"error": ...}`` message and close code ``1008``
  (WebSocket) — never an empty stream a script would read as "no events".
- **Bounded**: at most :data:`MAX_STREAMS` streams at once (each holds a worker thread while it waits for the
  journal; more answer ``503``/close ``1013``), on their own thread limiter so readers can never starve ``/rpc``.
  A stream waits in slices of :data:`IDLE_S`, so a disconnect or a server shutdown ends it within one slice
  (close ``1001`` on shutdown; the HTTP stream simply ends).
- Reads need no credential (calls without the token keep read access). A browser page of another
  origin may not open the WebSocket (its ``Origin`` must name the host the client connected to): a WebSocket is
  not covered by the same-origin policy, and run events are not for other sites to read.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from ..errors import ControlError, InvalidInput, SmthrsError
from ..observe.watch import ControlEvent, WatchStream, require_watchable, watch
from ..stores.database import Database
from .wire import event_payload

__all__ = ["Projections", "MAX_STREAMS", "IDLE_S", "open_projection"]

#: Concurrent projection streams one server holds (HTTP and WebSocket together).
MAX_STREAMS = 32
#: How long one wait for the next event lasts before the stream looks at its connection and the server again.
IDLE_S = 0.5
_WS_PARAMS = frozenset({"run_id", "after_cursor"})
_HTTP_PARAMS = _WS_PARAMS | {"follow"}


def open_projection(db: Database, query: Mapping[str, str], *, websocket: bool) -> WatchStream:
    """The watch a ``/projections`` request asks for (refused input raises before anything is streamed)."""
    unknown = set(query) - (_WS_PARAMS if websocket else _HTTP_PARAMS)  # a WebSocket always follows
    if unknown:
        raise ControlError(
            "invalid_options",
            f"unknown query parameters {sorted(unknown)}; /projections takes run_id, after_cursor"
            + ("" if websocket else " and follow"),
            option="query",
        )
    run_id = query.get("run_id")
    if not run_id:
        raise InvalidInput(
            "invalid_input",
            "run_id is required: a projection resumes one run (the cursor is partition-local)",
            bound="run_id",
        )
    follow = True if websocket else _flag(query.get("follow", "false"))
    stream = watch(db, run_id, follow=follow, after_cursor=query.get("after_cursor"))
    try:
        require_watchable(db, run_id)
    except BaseException:
        stream.close()
        raise
    return stream


def _flag(text: str) -> bool:
    if text in ("true", "1"):
        return True
    if text in ("false", "0"):
        return False
    raise ControlError("invalid_options", f"follow must be true or false, got {text[:20]!r}", option="follow")


def _line(ev: ControlEvent) -> str:
    return json.dumps(event_payload(ev), sort_keys=True)


def _status(exc: SmthrsError) -> int:
    return 404 if exc.code == "run_not_found" else 400


class Projections:
    """The two ``/projections`` endpoints over one database; ``stopping`` is set when the server shuts down."""

    def __init__(self, db: Database, stopping: threading.Event) -> None:
        self.db = db
        self.stopping = stopping
        self._limiter = anyio.CapacityLimiter(MAX_STREAMS)
        self._lock = threading.Lock()
        self._open = 0

    def _admit(self) -> bool:
        with self._lock:
            if self._open >= MAX_STREAMS:
                return False
            self._open += 1
            return True

    def _release(self) -> None:
        with self._lock:
            self._open -= 1

    async def _open_stream(self, query: Mapping[str, str], websocket: bool) -> WatchStream:
        return await anyio.to_thread.run_sync(
            lambda: open_projection(self.db, query, websocket=websocket), limiter=self._limiter
        )

    async def _next(self, stream: WatchStream, follow: bool) -> ControlEvent | None:
        """The next event; None when the stream ended (snapshot) or nothing arrived within :data:`IDLE_S`."""
        if follow:
            return await anyio.to_thread.run_sync(stream.next_within, IDLE_S, limiter=self._limiter)
        return await anyio.to_thread.run_sync(lambda: next(stream, None), limiter=self._limiter)

    # -- HTTP ----------------------------------------------------------------------------------------------------------
    async def http(self, request: Request) -> Response:
        if not self._admit():
            return _busy_response()
        try:
            stream = await self._open_stream(dict(request.query_params), websocket=False)
        except SmthrsError as exc:
            self._release()
            return JSONResponse({"error": _public(exc)}, status_code=_status(exc))
        except BaseException:
            self._release()
            raise
        closed = False

        def close() -> None:
            # Idempotent; runs however the response ends (finished, client gone before or during the stream).
            nonlocal closed
            if not closed:
                closed = True
                stream.close()
                self._release()

        return _ClosingStream(
            self._ndjson(stream),
            close,
            media_type="application/x-ndjson",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    async def _ndjson(self, stream: WatchStream) -> AsyncIterator[bytes]:
        follow = stream.follow
        while not (follow and self.stopping.is_set()):
            ev = await self._next(stream, follow)
            if ev is None:
                if follow:
                    continue
                return
            yield (_line(ev) + "\n").encode("utf-8")

    # -- WebSocket -----------------------------------------------------------------------------------------------------
    async def websocket(self, ws: WebSocket) -> None:
        if not _same_origin(ws.headers):
            await ws.close(code=1008, reason="cross-origin WebSocket refused")
            return
        if not self._admit():
            await ws.accept()
            await ws.close(code=1013, reason="too many projection streams; retry later")
            return
        try:
            await ws.accept()
            try:
                stream = await self._open_stream(dict(ws.query_params), websocket=True)
            except SmthrsError as exc:
                await ws.send_text(json.dumps({"error": _public(exc)}, sort_keys=True))
                await ws.close(code=1008, reason=exc.code)
                return
            try:
                await self._pump(ws, stream)
            finally:
                stream.close()
        finally:
            self._release()

    async def _pump(self, ws: WebSocket, stream: WatchStream) -> None:
        async with anyio.create_task_group() as tg:

            async def until_disconnect() -> None:
                # Messages from the client carry nothing; reading them is how a disconnect is noticed while idle.
                while True:
                    message = await ws.receive()
                    if message["type"] == "websocket.disconnect":
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(until_disconnect)
            try:
                while not self.stopping.is_set():
                    ev = await self._next(stream, True)
                    if ev is not None:
                        await ws.send_text(_line(ev))
                if ws.application_state is WebSocketState.CONNECTED:
                    await ws.close(code=1001, reason="server shutting down")
            except (WebSocketDisconnect, OSError):
                pass  # the client went away mid-send: nothing to deliver to, and its cursor resumes it
            tg.cancel_scope.cancel()


class _ClosingStream(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends: an async generator that was never started
    (the client left before the first byte) would never run its own ``finally``."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _public(exc: SmthrsError) -> dict[str, Any]:
    data = exc.to_dict()
    data.pop("cause", None)
    return data


def _busy_response() -> Response:
    busy = ControlError(
        "invalid_options",
        f"this server already streams {MAX_STREAMS} projections; close one, or retry later",
        option="streams",
    )
    return JSONResponse({"error": _public(busy)}, status_code=503, headers={"Retry-After": "5"})


def _same_origin(headers: Mapping[str, str]) -> bool:
    origin = headers.get("origin")
    if origin is None:
        return True  # not a browser (scripts, the websockets client): nothing to protect against
    host = headers.get("host", "")
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()
