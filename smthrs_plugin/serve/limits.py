"""The connection limits of ``smthrs serve`` (deadlines and caps) and their counter. PURE of any web framework, so
the CLI can show the defaults without loading uvicorn; ``_connections`` enforces them in the HTTP protocol."""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass

from ..errors import ControlError

__all__ = [
    "ConnectionLimits",
    "ConnectionGate",
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_CLIENT_CONNECTIONS",
    "FD_HEADROOM",
]

#: Seconds a client has to send a request's headers. An honest client sends them in one write; this is far above
#: any scheduling delay of a busy machine.
DEFAULT_HEADER_TIMEOUT_S = 30.0
#: Seconds a client has to send a request's body once its headers arrived: the largest body (about 4 MiB) arrives
#: in time over any link faster than about 0.6 Mbit/s.
DEFAULT_BODY_TIMEOUT_S = 60.0
#: Open connections in total (lowered to half the process's open-file limit when that is smaller: every connection
#: is a file descriptor, and running out of them stops ``accept`` for everyone).
DEFAULT_MAX_CONNECTIONS = 512
#: Open connections per client address: a browser holds about six, a script one.
DEFAULT_MAX_CLIENT_CONNECTIONS = 64
#: File descriptors kept free beside the connections (the database, the journal, logs, worker threads' files).
FD_HEADROOM = 64


def _open_file_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits of one server (see the module docstring). ``max_connections=None`` takes
    :data:`DEFAULT_MAX_CONNECTIONS`, or half the open-file limit when that is smaller. Refuses
    (``ControlError(invalid_options)``) a non-positive value, and a total the open-file limit cannot hold."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int | None = None
    max_client_connections: int = DEFAULT_MAX_CLIENT_CONNECTIONS

    def __post_init__(self) -> None:
        for option, value in (
            ("header_timeout", self.header_timeout_s),
            ("body_timeout", self.body_timeout_s),
            ("max_client_connections", self.max_client_connections),
            ("max_connections", 1 if self.max_connections is None else self.max_connections),
        ):
            if not (value > 0 and math.isfinite(value)):
                raise ControlError(
                    "invalid_options",
                    f"--{option.replace('_', '-')} must be a finite number above 0, got {value}",
                    option=option,
                )
        files = _open_file_limit()
        if self.max_connections is None:
            total = DEFAULT_MAX_CONNECTIONS if files is None else min(DEFAULT_MAX_CONNECTIONS, files // 2)
            object.__setattr__(self, "max_connections", max(1, total))
        elif files is not None and self.max_connections > files - FD_HEADROOM:
            raise ControlError(
                "invalid_options",
                f"--max-connections {self.max_connections} does not fit the open-file limit of this process "
                f"({files}, of which {FD_HEADROOM} stay free for the server's own files); lower it or raise the "
                "limit (`ulimit -n`)",
                option="max_connections",
            )

    @property
    def total(self) -> int:
        """The total cap, resolved."""
        assert self.max_connections is not None  # resolved in __post_init__
        return self.max_connections


class ConnectionGate:
    """Counts the open connections of one server, per client address and in total; admits or refuses new ones."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.total = 0
        self.by_client: dict[str, int] = {}

    def admit(self, client: str) -> str | None:
        """Count a new connection from ``client`` and answer None, or answer why it is refused (nothing counted)."""
        if self.total >= self.limits.total:
            return f"the server holds {self.total} connections, its limit; retry in a few seconds"
        held = self.by_client.get(client, 0)
        if held >= self.limits.max_client_connections:
            return (
                f"this client address holds {held} connections, the limit per client; reuse a connection "
                "(keep-alive) or close one"
            )
        self.by_client[client] = held + 1
        self.total += 1
        return None

    def release(self, client: str) -> None:
        """Uncount one connection from ``client`` (admitted before)."""
        held = self.by_client[client] - 1
        if held:
            self.by_client[client] = held
        else:
            del self.by_client[client]
        self.total -= 1
