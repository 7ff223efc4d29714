"""Who may change something through ``smthrs serve``: the bearer credential, the bind rule, the operator principal.

Invariants
- **Reads are open, mutations need the credential.** Every call that writes (``plan``, ``approve``, ``deny``,
  ``cancel``, ``resume``, ``signal``) must carry ``Authorization: Bearer <token>``: no header answers ``401``, any
  other value ``403`` — decided before the request's parameters are looked at, so a refused call writes nothing.
- **Loopback gets a fresh token per server session** (printed to stderr by the command, even with ``--quiet``);
  a configured credential (``SMTHRS_SERVE_TOKEN``, or ``--token-file``) is accepted beside it. **A network bind
  refuses to start without a configured credential** (``ControlError(invalid_options)``, exit 2): a server reachable
  from other machines with no way to authenticate a decision must not exist, even for a moment.
- **The token is compared in constant time** (``hmac.compare_digest`` over UTF-8 bytes, against every accepted
  credential, without an early exit) and never appears in a message, a log line, a URL or a response.
- **The transport decides who acts.** An authenticated caller acts as the configured operator principal (default
  ``local/operator``, the identity the default approval authority recognises); a principal named in the request
  is ignored (``rpc.py`` drops it), so the token cannot be re-aimed at another identity.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..control.identity import LOCAL_OPERATOR, Principal
from ..errors import ControlError

__all__ = [
    "TOKEN_ENV",
    "MIN_TOKEN_CHARS",
    "MAX_TOKEN_FILE_BYTES",
    "ServeAuth",
    "Verdict",
    "is_loopback",
    "configured_credential",
    "auth_for_bind",
]

TOKEN_ENV = "SMTHRS_SERVE_TOKEN"
#: A configured credential shorter than this is refused: it could be guessed by a network caller.
MIN_TOKEN_CHARS = 16
#: The largest ``--token-file`` read: a token is a line; a larger file is not a token file.
MAX_TOKEN_FILE_BYTES = 4096

Verdict = Literal["ok", "missing", "wrong"]


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine (``localhost``, ``127.0.0.0/8``, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything, so it is a network bind


def configured_credential(token_file: Path | None) -> str | None:
    """The configured bearer credential: ``--token-file`` (its content, surrounding whitespace stripped) wins over
    ``SMTHRS_SERVE_TOKEN``; None when neither is given. Refuses an unreadable file, one that is not a regular file or
    is over :data:`MAX_TOKEN_FILE_BYTES`, and a credential shorter than :data:`MIN_TOKEN_CHARS` (the message never
    shows the credential)."""
    if token_file is not None:
        text = _read_token_file(token_file).strip()
        where = f"--token-file {str(token_file)!r}"
    else:
        env = os.environ.get(TOKEN_ENV)
        if env is None:
            return None
        text, where = env.strip(), TOKEN_ENV
    if len(text) < MIN_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in text):
        raise ControlError(
            "invalid_options",
            f"the bearer credential in {where} must be at least {MIN_TOKEN_CHARS} printable characters without "
            "spaces; generate one, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`",
            option="token_file" if token_file is not None else "token",
        )
    return text


def _read_token_file(token_file: Path) -> str:
    """The text of ``token_file``, read bounded. Opened without blocking and checked to be a regular file before a
    byte is read: a FIFO would block the start for ever and ``/dev/zero`` would be read until memory runs out."""
    shown = f"--token-file {str(token_file)!r}"

    def refused(why: str, cause: BaseException | None = None) -> ControlError:
        return ControlError(
            "invalid_options",
            f"{shown} {why}; give a regular file holding the bearer token (at most {MAX_TOKEN_FILE_BYTES} bytes)",
            option="token_file",
            cause=cause,
        )

    try:
        fd = os.open(token_file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise refused(f"cannot be opened ({exc.strerror or type(exc).__name__})", exc) from exc
    try:
        mode = os.fstat(fd).st_mode  # of what was opened, not of the name: no swap between check and read
        if not stat.S_ISREG(mode):
            raise refused(f"is not a regular file (a {_file_kind(mode)})")
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_TOKEN_FILE_BYTES:
            chunk = os.read(fd, MAX_TOKEN_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise refused(f"cannot be read ({exc.strerror or type(exc).__name__})", exc) from exc
    finally:
        os.close(fd)
    if size > MAX_TOKEN_FILE_BYTES:
        raise refused(f"is larger than {MAX_TOKEN_FILE_BYTES} bytes")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise refused("is not UTF-8 text", exc) from exc


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    )
    return next((name for test, name in kinds if test(mode)), "special file")


@dataclass(frozen=True)
class ServeAuth:
    """The credentials one server session accepts and the principal an authenticated caller acts as."""

    tokens: tuple[str, ...]
    principal: Principal = LOCAL_OPERATOR
    #: The per-session token of a loopback bind (to print once at start), or None.
    session_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("a server session accepts at least one credential")

    def __repr__(self) -> str:  # never the tokens
        return f"ServeAuth(principal={self.principal}, credentials={len(self.tokens)})"

    def verdict(self, authorization: str | None) -> Verdict:
        """``ok`` for a valid ``Bearer`` credential, ``missing`` without the header, ``wrong`` otherwise."""
        if authorization is None:
            return "missing"
        scheme, _, presented = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not presented:
            return "wrong"
        given = presented.strip().encode("utf-8", "surrogatepass")
        ok = False
        for token in self.tokens:  # every credential is compared: no early exit to time
            ok |= hmac.compare_digest(given, token.encode("utf-8"))
        return "ok" if ok else "wrong"


def auth_for_bind(host: str, token_file: Path | None, principal: Principal = LOCAL_OPERATOR) -> ServeAuth:
    """The credentials of a server bound to ``host`` (see the module invariants): a fresh session token on loopback
    (plus the configured credential when there is one); the configured credential on any other bind, refused
    (``invalid_options``) when there is none."""
    configured = configured_credential(token_file)
    if is_loopback(host):
        session = secrets.token_urlsafe(32)
        tokens = (session,) if configured is None else (session, configured)
        return ServeAuth(tokens, principal, session)
    if configured is None:
        raise ControlError(
            "invalid_options",
            f"refusing to bind {host!r} without a bearer credential: a network bind must authenticate every "
            f"decision. Set {TOKEN_ENV} (or pass --token-file FILE) to a secret of at least {MIN_TOKEN_CHARS} "
            "characters and send it as `Authorization: Bearer <token>`, or bind 127.0.0.1 (a per-session token is "
            "printed then)",
            option="host",
        )
    return ServeAuth((configured,), principal, None)
