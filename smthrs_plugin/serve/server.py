"""Running ``smthrs serve``: bind, announce, serve with uvicorn, stop gracefully.

Invariants
- **Refusals come before the socket.** The credential rule (``_auth.auth_for_bind``) and the runtime are settled
  first; a network bind without a credential never listens, not even for a moment.
- **Exactly two announcement lines** go to stderr once the socket accepts connections (tests and scripts parse
  them; ``--quiet`` keeps them and silences everything else but errors):
  ``smthrs serve: approval token: TOKEN`` (loopback only, first, so a reader that stops at the next line already
  has it) and ``smthrs serve: listening on http://HOST:PORT/`` (the real port, also with ``--port 0``).
- **A hostile client holds nothing for long** (``_connections``): request headers and bodies have deadlines, and
  open connections are capped per client address and in total; over a cap a connection is answered ``503`` at once.
- **SIGTERM and SIGINT stop gracefully with exit 0**: no new connections, live projection streams end within one
  idle slice, requests in flight finish (every write is one transaction, so none is half-done), then the runtime
  closes. uvicorn re-raises the captured signal after it stopped; this module's own handlers absorb that, so the
  process exits by returning, not by the signal.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from ..control.identity import Principal
from ..errors import ControlError
from ..runtime import open_runtime
from ._app import create_app
from ._auth import auth_for_bind, is_loopback
from ._connections import ConnectionLimits, guarded_protocol

__all__ = ["run_server", "LISTENING_PREFIX", "TOKEN_PREFIX"]

LISTENING_PREFIX = "smthrs serve: listening on "
TOKEN_PREFIX = "smthrs serve: approval token: "
#: Seconds uvicorn waits for requests in flight at shutdown before cancelling them.
GRACE_S = 10
#: The largest WebSocket message a client may send (clients send nothing meaningful to /projections).
WS_MAX_BYTES = 64 * 1024


class _Server(uvicorn.Server):
    """uvicorn's server, announcing itself once it listens and telling the app when it starts stopping."""

    def __init__(self, config: uvicorn.Config, stopping: threading.Event, announce: list[str]) -> None:
        super().__init__(config)
        self._stopping = stopping
        self._announce = announce

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            for line in self._announce:
                print(line, file=sys.stderr, flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._stopping.set()  # before uvicorn waits for connections: live streams must end for it to finish
        super().handle_exit(sig, frame)


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
    except OSError as exc:
        raise ControlError(
            "invalid_options",
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port (0 picks a free one) "
            "or another --host",
            option="port",
            cause=exc,
        ) from exc
    sock.setblocking(False)
    return sock


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{port}/"


def run_server(
    *,
    host: str,
    port: int,
    quiet: bool,
    token_file: Path | None,
    principal: Principal,
    workspace: Path | None,
    db: str | None,
    limits: ConnectionLimits | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (see the module invariants); typed refusals raise before anything listens.
    ``limits``: the connection deadlines and caps (None: the defaults)."""
    auth = auth_for_bind(host, token_file, principal)
    limits = ConnectionLimits() if limits is None else limits
    stopping = threading.Event()
    with open_runtime(workspace=workspace, db=db) as rt:
        sock = _bind(host, port)
        try:
            real_port = int(sock.getsockname()[1])
            app = create_app(rt, auth, stopping=stopping, loopback_host=host if is_loopback(host) else None)
            config = uvicorn.Config(
                app,
                http=guarded_protocol(limits),
                log_level="error" if quiet else "info",
                access_log=not quiet,
                lifespan="off",
                ws_max_size=WS_MAX_BYTES,
                timeout_graceful_shutdown=GRACE_S,
                server_header=False,
                proxy_headers=False,
            )
            announce = [] if auth.session_token is None else [TOKEN_PREFIX + auth.session_token]
            announce.append(LISTENING_PREFIX + _url(host, real_port))
            server = _Server(config, stopping, announce)
            previous = _absorb_signals(server)
            try:
                server.run(sockets=[sock])
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        finally:
            sock.close()


def _absorb_signals(server: _Server) -> dict[int, Any]:
    """Install SIGTERM/SIGINT handlers that only ask ``server`` to stop: uvicorn replaces them while it serves and
    re-raises the signal that stopped it once it restored them (absorbed here), and one that arrives before uvicorn
    took over still stops the server. Returns the handlers to restore."""

    def stop(sig: int, frame: FrameType | None) -> None:
        server._stopping.set()
        server.should_exit = True

    return {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
