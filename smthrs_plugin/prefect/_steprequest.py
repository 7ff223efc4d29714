"""A ``@step`` call's dispatch request: built once per distinct key input and reused (:func:`request_for`), with
the checks that refuse a call before its body runs (a declared read missing, an undeclared workspace path passed
as an argument)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import threading
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prefect.settings import PREFECT_TASKS_REFRESH_CACHE

from ..boundary.boundary import Declaration
from ..boundary.measure import ABSENT as ABSENT_FILE
from ..cache.model import DispatchRequest
from ..cache.requests import build_request, declaration_of, measure_reads, node_request
from ..canonical import canonical_bytes
from ..codecs import path_arguments
from ..errors import CacheError, CanonicalError
from ..plan import NodeDraft
from ..plan.fileset import entry_matches

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime import Runtime

__all__ = ["StepLike", "check_path_arguments", "request_for"]


class StepLike(Protocol):
    """What a request is built from: the step's spec (``_step._StepSpec``)."""

    identity: str
    tier: str
    reads: tuple[Any, ...]
    refresh_cache: bool | None
    request_options: dict[str, Any]

    def draft(self, arguments: Mapping[str, Any], *, boundary_check: bool = False) -> NodeDraft: ...


class _RequestMemo:
    """The requests a step built, by what they were built from (see :func:`request_for`). Bounded; per step and
    process (never pickled with the step: a worker process builds its own)."""

    __slots__ = ("lock", "drafts", "requests")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.drafts: dict[tuple[bytes, bytes, str], tuple[NodeDraft, Declaration]] = {}
        self.requests: dict[tuple[bytes, bytes, str, tuple[tuple[str, str], ...]], DispatchRequest] = {}

    def put(self, table: dict[Any, Any], key: Any, value: Any) -> None:
        with self.lock:
            if len(table) >= _MEMO_CAPACITY:
                table.pop(next(iter(table)))
            table[key] = value


#: Requests (and drafts) remembered per step: a bound on memory, not on correctness.
_MEMO_CAPACITY = 256
_MEMOS: weakref.WeakKeyDictionary[StepLike, _RequestMemo] = weakref.WeakKeyDictionary()
_MEMOS_LOCK = threading.Lock()


def _memo_of(spec: StepLike) -> _RequestMemo:
    memo = _MEMOS.get(spec)
    if memo is None:
        with _MEMOS_LOCK:
            memo = _MEMOS.setdefault(spec, _RequestMemo())
    return memo


def request_for(
    spec: StepLike,
    rt: Runtime,
    run_id: str,
    attempt: int,
    values: dict[str, Any],
    canonical: bytes,
    env: dict[str, Any],
) -> tuple[NodeDraft, DispatchRequest]:
    """The call's draft and dispatch request. A sealed step's request is a pure function of its canonical
    argument key forms, its environment, its workspace and the read digests measured NOW (the key folds exactly
    these; run id and attempt only label the request), so it is built once per distinct combination and reused
    — the reads are still measured on every call, and the seam still re-verifies them before serving a hit. A
    non-sealed step's key folds the run, so it is always built afresh."""
    measurer = rt.dispatcher.measurer
    try:
        env_bytes = canonical_bytes(env)
    except CanonicalError:
        env_bytes = None  # built the long way: the key computation reports it
    if spec.tier != "sealed" or env_bytes is None:
        draft = spec.draft(values)
        fresh_request = node_request(
            draft,
            run_id=run_id,
            workspace=rt.workspace,
            measurer=measurer,
            environment=env,
            attempt=attempt,
            subject=spec.identity,
        )
        _check_reads(spec, rt, fresh_request.reads)
        return draft, _called(spec, dataclasses.replace(fresh_request, **spec.request_options))
    memo = _memo_of(spec)
    base = (canonical, env_bytes, str(rt.workspace))
    drafted = memo.drafts.get(base)
    if drafted is None:
        fresh = spec.draft(values)
        drafted = (fresh, declaration_of(fresh))
        memo.put(memo.drafts, base, drafted)
    draft, decl = drafted
    reads = measure_reads(measurer, decl)
    _check_reads(spec, rt, reads)
    request = memo.requests.get((*base, reads))
    if request is None:
        request = build_request(
            draft,
            run_id=run_id,
            workspace=rt.workspace,
            reads=reads,
            declaration=decl,
            environment=env,
            attempt=attempt,
            subject=spec.identity,
        )
        request = dataclasses.replace(request, **spec.request_options)
        memo.put(memo.requests, (*base, reads), request)
    elif request.run_id != run_id or request.attempt != attempt:
        request = dataclasses.replace(request, run_id=run_id, attempt=attempt)
        memo.put(memo.requests, (*base, reads), request)  # the next call of this run reuses it as is
    return draft, _called(spec, request)


def _check_reads(spec: StepLike, rt: Runtime, reads: Iterable[tuple[str, str]]) -> None:
    """Refuse a call whose declared exact read does not exist, before the body runs: a typo in ``reads=`` would
    otherwise run a body that cannot see its input (and key the call on the file's absence)."""
    missing = [path for path, digest in reads if digest == ABSENT_FILE]
    if not missing:
        return
    declared = [str(r) for r in spec.reads]
    raise CacheError(
        "missing_read",
        f"step {spec.identity} declares reads={declared!r} but {', '.join(missing)} "
        f"{'does' if len(missing) == 1 else 'do'} not exist in the workspace {rt.workspace}: create "
        f"{'it' if len(missing) == 1 else 'them'} first (or run the step that writes "
        f"{'it' if len(missing) == 1 else 'them'}), or correct the path",
        step=spec.identity,
        paths=missing,
    )


def _called(spec: StepLike, request: DispatchRequest) -> DispatchRequest:
    """The request of this call: a refresh is decided now — the step's ``refresh_cache``, else Prefect's
    ``PREFECT_TASKS_REFRESH_CACHE`` as it is set at this call (as Prefect resolves it for its own tasks)."""
    refresh = spec.refresh_cache
    if refresh is None:
        refresh = bool(PREFECT_TASKS_REFRESH_CACHE.value())
    return dataclasses.replace(request, refresh=True) if refresh else request


def check_path_arguments(
    spec: StepLike, bound: inspect.BoundArguments, workspace: Path, declaration: Declaration
) -> None:
    """A ``pathlib`` argument naming a workspace file the step does not declare is refused: its key folds the
    path's TEXT, so a hit would be served after the file's bytes changed. Declared, it is measured like any read.
    (A relative path means the workspace: an isolated body runs there.)"""
    for name, value in bound.arguments.items():
        for path in path_arguments(value):
            full = os.path.normpath(os.path.join(workspace, os.fspath(path)))
            if full != str(workspace) and not full.startswith(str(workspace) + os.sep):
                continue
            rel = os.path.relpath(full, workspace).replace(os.sep, "/")
            if rel == "." or any(entry_matches(e, rel) for e in (*declaration.reads, *declaration.writes)):
                continue
            raise CacheError(
                "invalid_declaration",
                f"step {spec.identity}: argument {name!r} is the workspace path {rel!r}, which the step does not "
                f"declare; a path argument is keyed by its text, not by the file's bytes, so declare the file the "
                f"body reads: reads=[{rel!r}] (or writes=[{rel!r}] for an output)",
                step=spec.identity,
                argument=name,
                path=rel,
            )
