"""How long and how many: ``smthrs serve``'s connection limits, enforced in uvicorn's HTTP/1.1 protocol (h11).

uvicorn bounds an idle keep-alive connection (5 s) and, optionally, the number of requests in progress, but not a
client that opens a connection and then sends its request slowly (slowloris): such a connection is held forever,
and enough of them deny every other caller. :func:`guarded_protocol` returns uvicorn's h11 protocol with:

- **A header deadline**: a request's line and headers must be complete within ``header_timeout_s`` of the moment
  the server became ready for them (the connection opened, or the previous response was sent). Otherwise the
  connection is closed, answered ``408`` first when part of a request had arrived. A deadline, not an idle timer:
  trickling a byte now and then does not extend it.
- **A body deadline**: the request body must be complete within ``body_timeout_s`` of its headers; otherwise the
  connection is closed (the application sees a disconnect). No deadline runs while the application works on a
  complete request or streams its answer: that time is the server's, not the client's.
- **Connection caps**: at most ``max_client_connections`` open connections per client address and
  ``max_connections`` in total (WebSockets included, until they close). A connection over a cap is answered
  ``503`` and closed as soon as it is accepted, before a byte of it is read, so it costs nothing while honest
  callers from other addresses keep being served.

Invariant: each admitted connection is counted exactly once and released exactly once, when its transport is lost —
also after an upgrade to a WebSocket, whose protocol takes the transport over (the release moves with it).
Everything runs on the event loop thread, so the counters need no lock.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Literal

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import ControlError
from .limits import ConnectionGate, ConnectionLimits

__all__ = ["guarded_protocol"]

log = logging.getLogger("uvicorn.error")  # uvicorn's level applies: ``--quiet`` silences these warnings

Phase = Literal["headers", "body"]


def _error_body(code: str, message: str, **details: Any) -> bytes:
    error = ControlError(code, message, **details).to_dict()
    return json.dumps({"error": error}, sort_keys=True).encode("utf-8")


def _raw_response(status: int, reason: str, body: bytes, extra: str = "") -> bytes:
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"cache-control: no-store\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode("ascii") + body


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the deadlines and caps of :data:`gate` (a subclass per server, see
    :func:`guarded_protocol`)."""

    gate: ConnectionGate

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._client: str | None = None  # set once admitted; None: refused (or not yet made)
        self._released = False
        self._upgraded = False
        self._phase: Phase | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._started = False  # whether a byte of the request the deadline runs for has arrived

    # -- admission ---------------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        refusal = self.gate.admit(client)
        if refusal is not None:
            # Answered before anything is read and never handed to uvicorn: a refused connection holds no state.
            log.warning("smthrs serve: refused a connection from %s: %s", client, refusal)
            body = _error_body("too_many_connections", refusal, client=client)
            transport.write(_raw_response(503, "Service Unavailable", body, "retry-after: 5\r\n"))
            transport.close()
            return
        self._client = client
        super().connection_made(transport)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._client is None:
            return  # refused in connection_made: uvicorn never saw it
        self._stop_deadline()
        self._release()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._client is None:
            return  # refused: bytes that were in flight before the close
        self._started = True
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()  # the next request's header deadline starts now (or its pipelined request was read already)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        # The WebSocket protocol takes the transport over: no deadline applies to it any more, and the connection
        # must be released when IT loses the transport (this protocol never hears of it again).
        self._upgraded = True
        self._stop_deadline()
        super().handle_websocket_upgrade(event)
        ws = self.transport.get_protocol()
        if ws is self:
            return
        inner_lost = ws.connection_lost

        def connection_lost(exc: Exception | None) -> None:
            try:
                inner_lost(exc)
            finally:
                self._release()

        setattr(ws, "connection_lost", connection_lost)  # noqa: B010 (an instance attribute shadows the method)

    def _release(self) -> None:
        if self._client is not None and not self._released:
            self._released = True
            self.gate.release(self._client)

    # -- deadlines ---------------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Start, keep or stop the deadline for the part of the request the server now waits for."""
        if self._upgraded or self.transport is None or self.transport.is_closing():
            self._stop_deadline()
            return
        state = self.conn.their_state
        phase: Phase | None = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase == self._phase:
            return  # a deadline is not extended by more bytes of the same part
        self._stop_deadline()
        self._phase = phase
        self._started = False
        if phase is not None:
            limits = self.gate.limits
            seconds = limits.header_timeout_s if phase == "headers" else limits.body_timeout_s
            self._deadline = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = None

    def _expired(self, phase: Phase, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        log.warning(
            "smthrs serve: closed a connection from %s: the request %s did not arrive within %g s",
            self._client,
            phase,
            seconds,
        )
        if phase == "headers" and self._started and self.conn.our_state is h11.IDLE:
            # Part of a request arrived, none of it reached the application: say why before closing (a client that
            # is merely slow learns what to change). A connection that sent nothing is simply closed, like an idle
            # keep-alive one: an unasked-for response could be read as the answer to its next request.
            body = _error_body(
                "request_timeout",
                f"the request line and headers must arrive within {seconds:g} s of the connection being ready; "
                "send them in one go",
                limit_s=seconds,
            )
            self.transport.write(_raw_response(408, "Request Timeout", body))
        # In the body phase the application may already be answering: closing is all that is safe; it sees a
        # disconnect.
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` enforcing ``limits`` over one server's connections."""
    return type("SmthrsH11Protocol", (_GuardedH11,), {"gate": ConnectionGate(limits)})
