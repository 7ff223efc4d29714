"""Isolated bodies: a building body runs in a forked child where every workspace path means its sandbox.

- Modes (the isolation table of docs/tutorials/flow-authors.md): ``namespace`` (a private mount namespace with the sandbox bind-mounted over
  the workspace path), ``process`` (a child whose working directory is the sandbox; a Python-level open of a
  workspace path outside it is refused by an audit hook, ``BoundaryRefusal(undeclared_read | undeclared_write)``
  naming the path) and ``thread`` (an explicit opt-out in the calling thread, with the same audit-hook refusals;
  workspace files only through ``ws``).
- In both child modes an undeclared workspace path the body reads is ``BoundaryRefusal(undeclared_read)`` naming the
  path and the ``reads=`` entry that would allow it.
- Only the result crosses back (pickled once into a file, read once); the body's log records are handled by the
  parent's logger; an exception keeps its type, with the child's traceback attached as a note.
- A child that dies (SIGKILL, out of memory) is ``BoundaryError(body_died)``: the caller's sandbox is discarded,
  nothing is copied back. :meth:`IsolatedCall.kill` kills the child; a parent that dies takes the child with it
  (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import gc
import inspect
import logging
import os
import pickle
import select
import shutil
import signal
import struct
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn, get_args

from ..errors import BoundaryError, BoundaryRefusal
from ..plan.fileset import entry_matches
from ..settings import Isolation  # what a step or node asks for: one definition
from .boundary import Declaration

__all__ = [
    "ISOLATIONS",
    "Isolation",
    "IsolationKind",
    "IsolatedCall",
    "resolve_isolation",
    "namespace_available",
    "command_preexec",
    "isolation_ran",
    "record_isolation",
    "UndeclaredPath",
]

log = logging.getLogger(__name__)

#: What actually ran (journaled with every build).
IsolationKind = Literal["namespace", "process", "thread"]
ISOLATIONS: tuple[str, ...] = get_args(Isolation)

#: Workspace top-level directories bound back read-only into a namespace view: the Python environment
#: (``.smthrs`` and ``.git`` stay hidden: no body reads the state database or the repository's hooks).
_BOUND_BACK = (".venv",)
#: Reads of these suffixes under the workspace are imports, not data (``process``/``thread`` mode): module
#: sources are folded into the step's identity, so reading them is not an undeclared input.
_CODE_SUFFIXES = (".py", ".pyc", ".pth", ".so")

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_NOATIME = 1024
_MS_NODIRATIME = 2048
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MS_RELATIME = 1 << 21
_MS_STRICTATIME = 1 << 24
_PR_SET_PDEATHSIG = 1

#: The isolation the body of the current dispatch ran under (set by :meth:`IsolatedCall.run` in the dispatching
#: context, read by the dispatch seam into the entry's provenance).
_RAN: contextvars.ContextVar[str | None] = contextvars.ContextVar("smthrs_isolation_ran", default=None)

_LIBC: Any = None
_PROBE: dict[str, bool] = {}
_PROBE_LOCK = threading.Lock()
#: The kind a degraded ``auto`` was told about, once per process (the journal says it on every build).
_WARNED: set[str] = set()


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def record_isolation(kind: str | None) -> None:
    """Say, in this context, which isolation the current body ran under (``None`` forgets it)."""
    _RAN.set(kind)


def isolation_ran() -> str | None:
    """The isolation the last body dispatched in this context ran under, if one ran."""
    return _RAN.get()


# -- choosing ---------------------------------------------------------------------------------------------------


def namespace_available(workspace: str | os.PathLike[str] | None = None) -> bool:
    """Whether this process may give a child its own mount namespace showing a sandbox over ``workspace`` (or
    over a scratch directory when none is named). Probed once per workspace by a forked child that sets up
    exactly the view a body gets — unsharing alone is not enough: a kernel or security module may allow the
    namespace and still refuse the bind mounts, and a workspace's own mount may refuse them where another
    allows them."""
    key = os.path.abspath(os.fspath(workspace)) if workspace is not None else ""
    with _PROBE_LOCK:
        known = _PROBE.get(key)
        if known is None:
            known = _PROBE[key] = _probe_namespace(key or None)
        return known


def _probe_namespace(workspace: str | None) -> bool:
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    scratch = tempfile.mkdtemp(prefix="smthrs-probe-")
    try:
        shown = os.path.join(scratch, "shown")
        os.mkdir(shown)
        if workspace is None:
            workspace = os.path.join(scratch, "ws")
            os.makedirs(os.path.join(workspace, _BOUND_BACK[0]))  # the read-only rebind is probed too
        _libc()  # loaded here: a forked child of a threaded process must not run the dynamic loader
        _flush_stdio()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's exit status is the answer
            ok = 1
            with contextlib.suppress(BaseException):
                enter_view(workspace, shown)
                ok = 0
            os._exit(ok)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status) == 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def resolve_isolation(
    choice: str, *, subject: str = "", workspace: str | os.PathLike[str] | None = None
) -> IsolationKind:
    """The kind a choice runs as here (for bodies over ``workspace``). ``namespace`` where namespaces are refused is
    ``BoundaryError(isolation_unavailable)`` (never a silent downgrade); ``auto`` falls back to ``process`` and
    says so once per process (and on every build's journal record)."""
    if choice not in ISOLATIONS:
        raise BoundaryError(
            "unsupported_boundary",
            f"isolation {choice!r} is not one of {', '.join(ISOLATIONS)}",
            isolation=choice,
        )
    if choice == "thread":
        return "thread"
    forks = hasattr(os, "fork")
    if choice == "process":
        if not forks:
            raise _unavailable("process", subject, "this platform cannot fork a child process")
        return "process"
    if namespace_available(workspace):
        return "namespace"
    if choice == "namespace":
        raise _unavailable(
            "namespace",
            subject,
            "this kernel or container refuses a private mount namespace to this user",
        )
    if not forks:  # pragma: no cover - no fork (Windows): the audit-hook refusals in the calling thread
        kind: IsolationKind = "thread"
    else:
        kind = "process"
    if kind not in _WARNED:
        _WARNED.add(kind)
        log.warning(
            "smthrs: private mount namespaces are not available here; step bodies run isolated as %r: relative "
            "paths land in the sandbox and a Python open of a workspace path outside it is refused, but C "
            "libraries and subprocesses opening absolute workspace paths are not confined (SMTHRS_ISOLATION)",
            kind,
        )
    return kind


def _unavailable(kind: str, subject: str, why: str) -> BoundaryError:
    who = f"{subject}: " if subject else ""
    return BoundaryError(
        "isolation_unavailable",
        f"{who}isolation {kind!r} was asked for but {why}; choose isolation='auto' (falls back to 'process', "
        "which refuses Python opens of workspace paths outside the sandbox) or run where it is allowed",
        isolation=kind,
    )


# -- the guard: refusals by audit hook ----------------------------------------------------------------------------


class UndeclaredPath(BoundaryRefusal, PermissionError):
    """An isolated body opened an undeclared workspace path. Also a ``PermissionError``: code that treats an
    unopenable file as absent (``linecache``, "load the config if there is one") sees exactly what the hermetic
    sandbox holds — no such file — while the error, when it propagates, is the typed refusal."""


@dataclass(frozen=True)
class _Guard:
    """What an audit hook refuses: ``view`` is where the body's workspace appears (the workspace path itself in
    a namespace, else the sandbox root); ``live`` is the real workspace when it is NOT the view (process and
    thread modes), where every open is refused."""

    view: str
    live: str | None
    declaration: Declaration
    subject: str
    thread: bool = False

    def rel(self, base: str, path: str) -> str | None:
        if path == base:
            return "."
        if path.startswith(base + os.sep):
            return path[len(base) + 1 :]
        return None

    def check(self, path: Any, write: bool) -> None:
        if isinstance(path, int):
            return
        try:
            p = os.fsdecode(os.fspath(path))
        except TypeError:
            return
        full = os.path.normpath(os.path.join(os.getcwd(), p))
        in_view = self.rel(self.view, full)
        if in_view is not None:
            if in_view == "." or write or in_view.split(os.sep)[0] in _BOUND_BACK:
                return
            if not os.path.lexists(full) and not self._declared(in_view):
                raise self._refusal("undeclared_read", p, in_view, live=False)
            return
        if self.live is None:
            return
        in_live = self.rel(self.live, full)
        if in_live is None or in_live == "." or in_live.split(os.sep)[0] in _BOUND_BACK:
            return
        if not write and in_live.endswith(_CODE_SUFFIXES):
            return  # an import of a project module: its source is part of the step's identity
        raise self._refusal("undeclared_write" if write else "undeclared_read", p, in_live, live=True)

    def _declared(self, rel: str) -> bool:
        rel = rel.replace(os.sep, "/")
        d = self.declaration
        return any(entry_matches(e, rel) for e in (*d.reads, *d.writes))

    def _refusal(self, code: str, given: str, rel: str, *, live: bool) -> UndeclaredPath:
        rel = rel.replace(os.sep, "/")
        declared = self._declared(rel)
        who = f"step {self.subject}: " if self.subject else ""
        what = "writes" if code == "undeclared_write" else "reads"
        if live and declared and self.thread:
            fix = (
                f"{rel!r} is declared, but {given!r} names the live workspace, not the sandbox; an in-thread body "
                f"(isolation='thread') reaches its files through `ws` only: open ws / {rel!r}"
            )
        elif live and declared:
            fix = (
                f"{rel!r} is declared, but {given!r} names the live workspace, not the sandbox; open it through a "
                "path relative to the working directory or through `ws` (this body runs without a private mount "
                "namespace, so absolute workspace paths are not redirected)"
            )
        else:
            fix = f"declare it: {what}=[{rel!r}] (or a glob/tree covering it)"
        return UndeclaredPath(
            code,
            f"{who}the body opened {given!r}, an undeclared workspace path ({what[:-1]}); {fix}",
            path=rel,
        )


def _open_is_write(mode: Any, flags: Any) -> bool:
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    if isinstance(flags, int):
        return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
    return False


_MUTATING = {
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.rename": (0, 1),
    "os.truncate": (0,),
    "os.chmod": (0,),
    "os.utime": (0,),
    "os.symlink": (1,),
    "os.link": (1,),
    "shutil.rmtree": (0,),
}
_LISTING = {"os.listdir": (0,), "os.scandir": (0,)}

_GUARD: threading.local = threading.local()
_HOOKED = False
_HOOK_LOCK = threading.Lock()


def _audit(event: str, args: tuple[Any, ...]) -> None:
    guard: _Guard | None = getattr(_GUARD, "active", None)
    if guard is None:
        return
    if event == "open":
        guard.check(
            args[0], _open_is_write(args[1] if len(args) > 1 else None, args[2] if len(args) > 2 else None)
        )
        return
    where = _MUTATING.get(event)
    if where is not None:
        for i in where:
            if i < len(args) and args[i] is not None:
                guard.check(args[i], True)
        return
    where = _LISTING.get(event)
    if where is not None and args and args[0] is not None:
        guard.check(args[0], False)


def _install_hook() -> None:
    global _HOOKED
    with _HOOK_LOCK:
        if not _HOOKED:
            # An audit hook cannot be removed: it stays, and is a thread-local check outside guarded bodies.
            sys.addaudithook(_audit)
            _HOOKED = True


@contextlib.contextmanager
def _guarded(guard: _Guard) -> Iterator[None]:
    _install_hook()
    previous = getattr(_GUARD, "active", None)
    _GUARD.active = guard
    try:
        yield
    finally:
        _GUARD.active = previous


# -- the namespace view -------------------------------------------------------------------------------------------


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _unshare() -> None:
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        return
    _check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWUSER), "unshare(CLONE_NEWUSER|CLONE_NEWNS)")
    # The caller's own ids map to themselves: files the body creates are owned as they would be outside.
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def _mount(src: str | None, target: str, flags: int) -> None:
    libc = _libc()
    rc = libc.mount(None if src is None else os.fsencode(src), os.fsencode(target), None, flags, None)
    _check(rc, f"mount {src} -> {target}")


def _locked_flags(target: str) -> int:
    """The flags a bind remount of ``target`` must repeat: inside a user namespace the kernel refuses (EPERM) a
    remount that would drop nosuid/nodev/noexec or change the atime mode of a mount it inherited."""
    f = os.statvfs(target).f_flag
    flags = (
        (_MS_NOSUID if f & os.ST_NOSUID else 0)
        | (_MS_NODEV if f & os.ST_NODEV else 0)
        | (_MS_NOEXEC if f & os.ST_NOEXEC else 0)
        | (_MS_NODIRATIME if f & os.ST_NODIRATIME else 0)
    )
    if f & os.ST_NOATIME:
        return flags | _MS_NOATIME
    if f & os.ST_RELATIME:
        return flags | _MS_RELATIME
    return flags | _MS_STRICTATIME


def enter_view(workspace: str, sandbox_root: str) -> int:
    """In this (single-threaded, forked) process: a private mount namespace in which ``workspace`` shows
    ``sandbox_root``. Returns a descriptor of the real workspace (for imports; never a plain path)."""
    _unshare()
    _mount(None, "/", _MS_REC | _MS_PRIVATE)  # nothing done here propagates back to the host
    # Opened inside the new namespace (a bind source must be a mount of the caller's own namespace), before the
    # sandbox covers the path.
    real = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    _mount(sandbox_root, workspace, _MS_BIND | _MS_REC)
    for name in _BOUND_BACK:
        src = f"/proc/self/fd/{real}/{name}"
        if not os.path.isdir(src):
            continue
        target = os.path.join(workspace, name)
        os.makedirs(target, exist_ok=True)  # the mount point, in the sandbox root; removed after the body
        _mount(src, target, _MS_BIND | _MS_REC)
        _mount(None, target, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _locked_flags(target))
    return real


_PKG_MEMO: dict[str, tuple[int, list[list[Any]]]] = {}
_PKG_LOCK = threading.Lock()


def workspace_packages(workspace: str) -> list[list[Any]]:
    """The ``__path__`` lists of imported packages that live under ``workspace`` (computed in the parent, once
    per change of ``sys.modules``: walking every module in the child would fault in a copy of half the heap)."""
    n = len(sys.modules)
    with _PKG_LOCK:
        memo = _PKG_MEMO.get(workspace)
        if memo is not None and memo[0] == n:
            return memo[1]
    found: list[list[Any]] = []
    for mod in list(sys.modules.values()):
        # The module's own dict: a module-level __getattr__ (lazy modules) must not run here.
        paths = getattr(mod, "__dict__", {}).get("__path__")
        if type(paths) is list and any(isinstance(p, str) and p.startswith(workspace) for p in paths):
            found.append(paths)
    with _PKG_LOCK:
        _PKG_MEMO[workspace] = (n, found)
    return found


def _repoint_imports(workspace: str, real: int, packages: list[list[Any]]) -> None:
    """``sys.path`` and package ``__path__`` entries under the workspace name the real tree through ``real``."""
    prefix = workspace + os.sep
    alias = f"/proc/self/fd/{real}"

    def moved(entry: Any) -> Any:
        if not isinstance(entry, str):
            return entry
        if entry == workspace:
            return alias
        if entry.startswith(prefix) and entry[len(prefix) :].split(os.sep)[0] not in _BOUND_BACK:
            return alias + os.sep + entry[len(prefix) :]
        return entry

    sys.path[:] = [moved(p) for p in sys.path]
    for paths in packages:
        paths[:] = [moved(p) for p in paths]


def _bound_back_mountpoints(sandbox_root: Path) -> None:
    """Remove the empty mount points a namespace child made in the sandbox root (they are not the body's)."""
    for name in _BOUND_BACK:
        with contextlib.suppress(FileNotFoundError, OSError):
            p = sandbox_root / name
            if p.is_dir() and not p.is_symlink() and not any(p.iterdir()):
                p.rmdir()


def command_preexec(
    workspace: str | os.PathLike[str], sandbox_root: str | os.PathLike[str]
) -> Callable[[], None]:
    """A ``subprocess.Popen(preexec_fn=...)`` that runs a command in the namespace view (``namespace`` only):
    absolute workspace paths in a ``run:`` command then resolve to its sandbox."""
    ws, root = os.path.abspath(os.fspath(workspace)), os.path.abspath(os.fspath(sandbox_root))

    def preexec() -> None:  # pragma: no cover - runs in the forked child before exec
        _set_pdeathsig()
        enter_view(ws, root)
        os.chdir(ws)

    return preexec


# -- running ------------------------------------------------------------------------------------------------------


class IsolatedCall:
    """One isolated call: :meth:`run` it once; :meth:`kill` (from any thread) ends its child — a cancellation.
    ``kind`` is what ran."""

    def __init__(
        self,
        workspace: str | os.PathLike[str],
        sandbox_root: str | os.PathLike[str],
        declaration: Declaration,
        kind: IsolationKind,
        *,
        subject: str = "",
    ) -> None:
        self.workspace = os.path.abspath(os.fspath(workspace))
        self.root = Path(os.path.abspath(os.fspath(sandbox_root)))
        self.declaration = declaration
        self.kind: IsolationKind = kind
        self.subject = subject
        self._pid: int | None = None
        self._killed = False
        self._lock = threading.Lock()

    def kill(self) -> None:
        """Kill the child (if it runs) with SIGKILL: the call then raises ``BoundaryError(body_died)``."""
        with self._lock:
            self._killed = True
            if self._pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._pid, signal.SIGKILL)

    def run(self, body: Callable[[], Any]) -> Any:
        """``body()`` isolated as :attr:`kind`; its value, or its exception re-raised here."""
        record_isolation(self.kind)
        if self.kind == "thread":
            guard = _Guard(str(self.root), self.workspace, self.declaration, self.subject, thread=True)
            with _guarded(guard):
                return body()
        return self._fork(body)

    def _fork(self, body: Callable[[], Any]) -> Any:
        with self._lock:
            if self._killed:
                raise self._died("it was cancelled before it started")
        scratch = self.root.parent
        result_path = scratch / f".isolated-result-{os.getpid()}-{threading.get_ident()}"
        result_fd = os.open(result_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        packages = workspace_packages(self.workspace) if self.kind == "namespace" else []
        r, w = os.pipe()
        try:
            _flush_stdio()  # buffered output must not be written twice (once by each process)
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child; measured by the parent's tests
                os.close(r)
                _child(self, body, w, result_fd, packages)
            os.close(w)
            w = -1
            with self._lock:
                self._pid = pid
                if self._killed:
                    os.kill(pid, signal.SIGKILL)
            try:
                status = self._wait(pid, r)
            except BaseException:
                # The waiting thread was interrupted (Ctrl-C, a timeout, a cancellation): the child goes with it.
                _kill_group(pid)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
                raise
            finally:
                with self._lock:
                    self._pid = None
            if status is None:
                # The child said it is done: whatever it started and left running goes now (its outputs are
                # settled next; nothing may still write into the sandbox), and its exit is reaped off this path.
                _kill_group(pid)
                _reap_later(pid)
            if self.kind == "namespace":
                _bound_back_mountpoints(self.root)
            return self._outcome(status, result_fd)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
            os.close(result_fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(result_path)

    def _wait(self, pid: int, r: int) -> int | None:
        """Relay the child's log records until it says it is done (``None``: its result is written; the exit
        itself — tearing down a copy of this process — is not waited for) or exits without saying so (its wait
        status). Exit is watched on a pidfd, not the pipe's EOF: a sibling forked meanwhile may hold a copy of
        the pipe's write end."""
        pidfd = _pidfd(pid)
        reader = _Frames()
        # poll, not select: a busy process's descriptors may be numbered past select()'s 1024.
        poller = select.poll()
        poller.register(r, select.POLLIN)
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
        open_pipe = True
        try:
            while True:
                # A bounded wait so an exception delivered to this thread (a timeout, Ctrl-C) is seen promptly.
                ready = {fd for fd, _ in poller.poll(500)}
                if open_pipe and r in ready:
                    chunk = os.read(r, 1 << 16)
                    if self._relay_all(reader, chunk):
                        return None
                    if chunk:
                        continue
                    open_pipe = False
                    poller.unregister(r)
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    os.set_blocking(r, False)
                    with contextlib.suppress(BlockingIOError):
                        while chunk := os.read(r, 1 << 16):
                            if self._relay_all(reader, chunk):
                                return status
                    return status
        finally:
            if pidfd is not None:
                os.close(pidfd)

    @staticmethod
    def _relay_all(reader: _Frames, chunk: bytes) -> bool:
        done = False
        for frame in reader.feed(chunk):
            if frame == _DONE:
                done = True
            else:
                _relay(frame)
        return done

    def _outcome(self, status: int | None, result_fd: int) -> Any:
        code = 0 if status is None else os.waitstatus_to_exitcode(status)
        size = os.fstat(result_fd).st_size
        if code != 0 or size == 0:
            if code < 0:
                why = f"it was killed by {signal.Signals(-code).name}"
                if self._killed:
                    why += " (cancelled)"
                elif -code == signal.SIGKILL:
                    why += " (out of memory, or killed from outside)"
            else:
                why = f"it exited with status {code} before returning"
            raise self._died(why)
        os.lseek(result_fd, 0, os.SEEK_SET)
        with os.fdopen(os.dup(result_fd), "rb") as f:
            tag, *rest = pickle.load(f)
        if tag == "ok":
            return rest[0]
        exc, tb = rest
        tb_text = "".join(tb.format()) if isinstance(tb, traceback.TracebackException) else str(tb)
        if isinstance(exc, BaseException):
            exc.add_note(f"(raised in the isolated body, {self.kind} isolation)\n{tb_text}")
            raise exc
        type_name, message = exc
        raise BoundaryError(
            "body_died",
            f"{self._who()}the body raised {type_name}: {message} — an exception that cannot cross the process "
            f"boundary (not picklable); its traceback:\n{tb_text}",
            error_type=type_name,
        )

    def _who(self) -> str:
        return f"step {self.subject}: " if self.subject else ""

    def _died(self, why: str) -> BoundaryError:
        return BoundaryError(
            "body_died",
            f"{self._who()}the isolated body died: {why}; nothing was copied back (re-run the step; if it was "
            "killed for memory, give the process more, or isolation='thread' to share the parent's)",
            isolation=self.kind,
        )


def _pidfd(pid: int) -> int | None:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:  # pragma: no cover - Linux < 5.3 or not Linux: polled by the bounded poll
        return None
    try:
        fd: int = opener(pid)
        return fd
    except OSError:  # pragma: no cover
        return None


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


def _set_pdeathsig() -> None:
    if sys.platform.startswith("linux"):
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# -- the child ----------------------------------------------------------------------------------------------------


def _child(  # pragma: no cover - the forked child
    call: IsolatedCall, body: Callable[[], Any], w: int, result_fd: int, packages: list[list[Any]]
) -> NoReturn:
    # Everything alive now moves out of the collector's reach: a collection in the child would otherwise touch
    # (and so copy) every object of the parent's heap.
    gc.freeze()
    code = 0
    try:
        parent = os.getppid()
        os.setpgid(0, 0)  # its own group: the parent ends whatever the body started and left running
        _set_pdeathsig()
        if os.getppid() != parent:  # the parent died before the death signal was armed
            os._exit(1)
        _ship_logs(w)
        sys.dont_write_bytecode = (
            True  # an import must not write __pycache__ into the sandbox or the workspace
        )
        if call.kind == "namespace":
            try:
                real = enter_view(call.workspace, str(call.root))
            except OSError as exc:
                raise _unavailable("namespace", call.subject, f"setting up its view failed ({exc})") from exc
            os.chdir(call.workspace)
            _repoint_imports(call.workspace, real, packages)
            guard = _Guard(call.workspace, None, call.declaration, call.subject)
        else:
            os.chdir(call.root)
            guard = _Guard(str(call.root), call.workspace, call.declaration, call.subject)
        _install_hook()
        _GUARD.active = guard
        value = body()
        if inspect.iscoroutine(value):
            import asyncio

            value = asyncio.run(value)
        _GUARD.active = None
        _write_result(result_fd, ("ok", value))
    except BaseException as exc:  # every failure crosses to the parent, typed when it can be
        _GUARD.active = None
        # Formatted in the parent, whose plain paths still reach the workspace's module sources.
        tb: Any = traceback.TracebackException.from_exception(exc, lookup_lines=False)
        try:
            pickle.dumps(tb)
        except Exception:
            tb = "".join(traceback.format_exception(exc))
        try:
            _write_result(result_fd, ("err", exc, tb))
        except BaseException:
            try:
                _write_result(result_fd, ("err", (type(exc).__qualname__, str(exc)), tb))
            except BaseException:
                code = 3
    finally:
        _flush_stdio()
    if code == 0:
        with contextlib.suppress(BaseException):
            _send(w, _DONE)
    os._exit(code)


def _write_result(fd: int, payload: tuple[Any, ...]) -> None:  # pragma: no cover - child side
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    f = os.fdopen(os.dup(fd), "wb")
    try:
        pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
    except BaseException:
        with contextlib.suppress(Exception):
            f.close()
        os.ftruncate(fd, 0)
        if payload[0] == "ok":
            value = payload[1]
            raise BoundaryError(
                "value_not_transferable",
                f"the body returned a {type(value).__module__}.{type(value).__qualname__}, which cannot cross from "
                "its isolated process (not picklable); return plain data or a value with a codec, or run the step "
                "with isolation='thread'",
            ) from None
        raise
    f.close()


_FRAME = struct.Struct("!I")
#: The child's last frame: its result is written (what follows is only its exit).
_DONE = "done"


def _kill_group(pid: int) -> None:
    """SIGKILL the child's process group (the child leads it: anything it started and left goes too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


_REAP: list[int] = []
_REAP_COND = threading.Condition()
_REAPER: threading.Thread | None = None


def _reap_later(pid: int) -> None:
    """Collect a finished child's exit status in a daemon thread (no zombie, no wait on this path)."""
    global _REAPER
    with _REAP_COND:
        _REAP.append(pid)
        if _REAPER is None or not _REAPER.is_alive():
            _REAPER = threading.Thread(target=_reaper, name="smthrs-isolation-reaper", daemon=True)
            _REAPER.start()
        _REAP_COND.notify()


def _reaper() -> None:
    while True:
        with _REAP_COND:
            while not _REAP:
                _REAP_COND.wait()
            pid = _REAP.pop()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _send(w: int, frame: Any) -> None:  # pragma: no cover - child side
    data = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_FRAME.pack(len(data)) + data)
    while view:
        try:
            n = os.write(w, view)
        except InterruptedError:
            continue
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                return
            raise
        view = view[n:]


class _Frames:
    """Length-prefixed pickled log records from the child's pipe."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, chunk: bytes) -> list[Any]:
        self.buf += chunk
        out: list[Any] = []
        while len(self.buf) >= _FRAME.size:
            (n,) = _FRAME.unpack_from(self.buf)
            if len(self.buf) < _FRAME.size + n:
                break
            data = bytes(self.buf[_FRAME.size : _FRAME.size + n])
            del self.buf[: _FRAME.size + n]
            # Our own child's frames (the pipe is private to the fork): trusted like the body itself.
            out.append(pickle.loads(data))
        return out


def _relay(record: logging.LogRecord) -> None:
    """Handle a child's record in the parent, by the same logger (so Prefect's handlers send it to the task run)."""
    logging.getLogger(record.name).handle(record)


def _ship_logs(w: int) -> None:  # pragma: no cover - child side
    """Every record a logger would hand to its handlers goes to the parent instead, once (the parent's logger
    then propagates it through its own handlers)."""
    lock = threading.Lock()
    fmt = logging.Formatter()

    def ship(self: logging.Logger, record: logging.LogRecord) -> None:
        record.msg = record.getMessage()
        record.args = None
        if record.exc_info:
            record.exc_text = fmt.formatException(record.exc_info)
            record.exc_info = None
        try:
            pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            # An extra attribute that does not pickle is carried as its repr (the message itself is text).
            for k, v in list(record.__dict__.items()):
                try:
                    pickle.dumps(v)
                except Exception:
                    record.__dict__[k] = repr(v)
        with lock:
            _send(w, record)

    logging.Logger.callHandlers = ship  # type: ignore[method-assign]
