"""Every typed error family of smthrs_plugin.

Invariant: each family has a *closed* set of codes (``codes``); constructing an error with a code outside its
family's set is a programming error and raises ``ValueError`` at once, so a code can never drift silently.
Every message says what happened *and what to do next*. Storage failures keep their original cause in
``__cause__`` (raise ... from exc) and in ``.cause``.

A node's own failure is an outcome (``failed``), never one of these exceptions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

__all__ = [
    "SmthrsError",
    "CanonicalError",
    "SettingsError",
    "PlanError",
    "GraphError",
    "SchedulerError",
    "StoreError",
    "FenceLost",
    "RunParentCycleError",
    "ArtifactError",
    "BoundaryError",
    "BoundaryRefusal",
    "MaterializationConflict",
    "ReplayError",
    "CacheError",
    "ControlError",
    "ApprovalDenied",
    "InvalidInput",
    "WaitError",
    "PluginError",
    "CodecError",
    "RemoteError",
    "passing_fault",
]


class SmthrsError(Exception):
    """Base of every refusal raised by smthrs_plugin. ``code`` is one of the family's closed ``codes``."""

    family: ClassVar[str] = "smthrs"
    codes: ClassVar[frozenset[str]] = frozenset()
    #: The codes of this family that name a *passing fault of the environment* (see :func:`passing_fault`).
    passing_codes: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self, code: str, message: str, *, cause: BaseException | None = None, **details: Any
    ) -> None:
        if code not in self.codes:
            raise ValueError(f"{type(self).__name__}: unknown code {code!r}; known: {sorted(self.codes)}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.cause = cause
        self.details: dict[str, Any] = details
        if cause is not None:
            self.__cause__ = cause

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"

    def __reduce__(self) -> tuple[Any, ...]:
        # A refusal raised in a task-runner worker (process pool, Dask) crosses back to the coordinator pickled;
        # Exception's default reduce would call __init__(message) and lose the code.
        return (_rebuild, (type(self), self.code, self.message, self.cause, self.details))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view used by ``--json`` CLI output and Prefect artifacts."""
        out: dict[str, Any] = {"family": self.family, "code": self.code, "message": self.message}
        for k, v in self.details.items():
            if isinstance(v, (str, int, float, bool)) or v is None:
                out[k] = v
            else:
                out[k] = repr(v)
        if self.cause is not None:
            out["cause"] = f"{type(self.cause).__name__}: {self.cause}"
        return out


def _codes(*names: str) -> frozenset[str]:
    return frozenset(names)


def _rebuild(
    cls: type[SmthrsError], code: str, message: str, cause: BaseException | None, details: dict[str, Any]
) -> SmthrsError:
    return cls(code, message, cause=cause, **details)


class CanonicalError(SmthrsError, ValueError):
    """A value cannot be canonicalised (RFC 8785): NaN, ±Infinity, non-str keys, cycles, lone surrogates, bytes,
    integers outside ±(2**53-1), or an object that is not plain JSON data."""

    family = "canonical"
    codes = _codes("not_canonicalizable")


class SettingsError(SmthrsError, ValueError):
    """An ``SMTHRS_*`` setting or an explicit runtime argument is malformed."""

    family = "settings"
    codes = _codes("invalid_setting")


class PlanError(SmthrsError, ValueError):
    """A plan or node declaration is refused before anything is written."""

    family = "plan"
    codes = _codes(
        "duplicate_node",
        "cycle",
        "unknown_dependency",
        "invalid_effects",
        "overlap_forbidden",
        "invalid_plan",
        "elaboration_failed",
        "invalid_node",
        "invalid_plan_file",
    )


class GraphError(SmthrsError, ValueError):
    """The in-memory runtime graph or admission policy was driven illegally: an unknown node id, a transition
    its state does not allow (settling twice, staging a node that never started), an outcome outside
    ``built|clean|failed|skipped|deferred``, or a concurrency cap that is not a positive int."""

    family = "graph"
    codes = _codes("unknown_node", "invalid_transition", "invalid_outcome", "invalid_concurrency")


class SchedulerError(SmthrsError):
    """A refusal the scheduler itself raises. A node's own failure is an outcome, not one of these.
    ``prefect_unavailable``: the Prefect API a run was to be hosted by could not be reached (its ephemeral server
    did not start in time). ``task_run_lost``: the flow's task runner gave a node's Prefect task run up before it
    ended (a Dask cluster that cannot unpickle the task because a module is missing there, workers that died),
    with the runner's own error as the cause."""

    family = "scheduler"
    codes = _codes(
        "invalid_plan",
        "boundary_unavailable",
        "key_uncomputable",
        "elaboration_failed",
        "store_failed",
        "prefect_unavailable",
        "task_run_lost",
    )

    def __init__(
        self,
        code: str,
        message: str,
        *,
        cause: BaseException | None = None,
        cleanup_errors: Iterable[BaseException] = (),
        **details: Any,
    ) -> None:
        super().__init__(code, message, cause=cause, **details)
        self.cleanup_errors: tuple[BaseException, ...] = tuple(cleanup_errors)

    def __reduce__(self) -> tuple[Any, ...]:
        details = {**self.details, "cleanup_errors": self.cleanup_errors}
        return (_rebuild, (type(self), self.code, self.message, self.cause, details))


class StoreError(SmthrsError):
    """The durable store refused or failed. ``cause`` keeps the driver's original exception.

    Database faults are named by what they are (``stores/dberrors.py``): ``unreachable`` (server down, bad host,
    a file that cannot be opened), ``disk_full``, ``locked`` (a lock held past the wait), ``read_only``,
    ``contended`` (PostgreSQL serialization conflicts past the retry budget), ``not_a_database`` (the file exists
    but is not SQLite), ``corrupt`` (a malformed database image), ``schema_too_new``. The first five are passing
    faults (:func:`passing_fault`)."""

    family = "store"
    codes = _codes(
        "store_failed",
        "unsupported_url",
        "unreachable",
        "read_only",
        "schema_too_new",
        "decode_failed",
        "persistence_failed",
        "idempotency_conflict",
        "not_found",
        "invalid_argument",
        "backup_failed",
        "restore_failed",
        # database faults named by what they are (stores/dberrors.py)
        "disk_full",
        "locked",
        "contended",
        "not_a_database",
        "corrupt",
    )
    passing_codes = _codes("unreachable", "disk_full", "locked", "read_only", "contended")

    def to_dict(self) -> dict[str, Any]:
        """As :meth:`SmthrsError.to_dict`, but the ``cause`` shows only its first line: the rest of a SQLAlchemy
        error's text is the failed statement and its parameters, which no output prints."""
        out = super().to_dict()
        if self.cause is not None:
            lines = str(self.cause).strip().splitlines()
            out["cause"] = f"{type(self.cause).__name__}: {lines[0] if lines else ''}"
        return out


class FenceLost(StoreError):
    """This process no longer owns the run it tried to write: another owner claimed it (or it was fenced by
    disaster recovery). Stop working on the run; never retry the write under the old owner."""

    family = "store"
    codes = _codes("fence_lost", "cancel_requested")


class RunParentCycleError(StoreError):
    """Recording a run parent edge would create a cycle in the run DAG; nothing was written."""

    family = "store"
    codes = _codes("run_parent_cycle")


class ArtifactError(SmthrsError):
    """The fsspec artifact store refused or failed (content-addressed blobs and shared cache entries)."""

    family = "artifacts"
    codes = _codes(
        "not_found",
        "corrupt",
        "digest_mismatch",
        "unavailable",
        "invalid_digest",
        "invalid_url",
        "invalid_name",
        "too_large",
        "not_a_file",
    )
    passing_codes = _codes("unavailable")  # the store did not answer (endpoint gone, disk full, permissions)


class BoundaryError(SmthrsError):
    """A step boundary could not be measured or honoured (``UnsupportedBoundary`` is the catch-all)."""

    family = "boundary"
    codes = _codes(
        "unsupported_boundary",
        "invalid_path",
        "unreadable",
        "workspace_missing",
        "enumeration_budget",
        "changed_during_measurement",
        "materialization_conflict",
        "isolation_unavailable",
        "body_died",
        "value_not_transferable",
    )


class MaterializationConflict(BoundaryError):
    """Copy-back refused: the real workspace changed underneath a sandboxed step (between its prepare and the
    copy of its outputs). Nothing was copied; re-run the step on the new state (delay-rebase)."""

    codes = _codes("materialization_conflict")


class BoundaryRefusal(SmthrsError):
    """Hard-mode refusal of a settled step: what it wrote or left differs from its declaration."""

    family = "boundary"
    codes = _codes(
        "undeclared_write", "missing_declared_output", "surviving_declared_removal", "undeclared_read"
    )


class ReplayError(SmthrsError):
    """Replaying cached outputs failed: ``missing_artifact`` (hydrate and retry once), ``boundary_corruption``
    (integrity violation: never served), ``unsupported_boundary`` (the cause says why). A recorded entry that
    reaches beyond the requesting declaration is refused before anything is written: ``reserved_path`` (an
    output or removal under ``.smthrs/``, ``.git/`` or ``.venv/``), ``undeclared_output`` (an output the
    request does not declare written), ``undeclared_removal`` (a removal it does not declare, or one that would
    delete one of its declared reads)."""

    family = "replay"
    codes = _codes(
        "missing_artifact",
        "boundary_corruption",
        "unsupported_boundary",
        "reserved_path",
        "undeclared_output",
        "undeclared_removal",
    )


class CacheError(SmthrsError):
    """The content-addressed cache refused a publication or a declaration."""

    family = "cache"
    codes = _codes(
        "key_uncomputable",
        "result_mismatch",
        "invalid_declaration",
        "not_found",
        # a step's output over the cache size caps; a publisher key that cannot be read or written
        "output_too_large",
        "invalid_key",
        # a step returned a value no value codec stores exactly; a step's declared exact read does not exist
        "value_uncacheable",
        "missing_read",
        # a signed shared entry outside the bounds every reader enforces (size, depth): never published
        "entry_out_of_bounds",
        # the shared tier's S3 bucket does not exist: refused before anything runs or is written
        "bucket_missing",
    )


class ControlError(SmthrsError):
    """A control-plane refusal (approvals, receipts, runs)."""

    family = "control"
    codes = _codes(
        "unauthorized",
        "plan_not_found",
        "plan_denied",
        "plan_digest_mismatch",
        "envelope_mismatch",
        "already_resolved",
        "run_not_found",
        "approval_denied",
        "invalid_cursor",
        "source_changed",
        "invalid_options",
        "invalid_receipt",
        # smthrs serve: a connection over a cap, a request that did not arrive in time
        "too_many_connections",
        "request_timeout",
    )


class ApprovalDenied(ControlError):
    """A node approval this run asked for was denied: the node fails (an outcome for a plan node, a failed flow for
    a ``@step`` flow). A denial is final for that request; approve a new request (a new run) to try again."""

    codes = _codes("approval_denied")


class InvalidInput(SmthrsError, ValueError):
    """Caller input refused at the identity boundary, before anything was written; ``bound`` names the limit."""

    family = "control"
    codes = _codes("invalid_input")


class WaitError(SmthrsError):
    """A durable wait was refused: ``no_run_context`` (``sp.sleep``/``sp.wait_for`` called outside a driven run),
    ``invalid_wait`` (a malformed deadline, duration, name or flow registration), ``unregistered_flow`` (a run
    whose flow this process cannot drive), ``unresumable_flow`` (a Prefect flow run that would park although no
    driver could call it again: its parameters are not plain JSON), ``parameters_mismatch`` (a durable flow run
    asked for again with other parameters than the ones it started with)."""

    family = "waits"
    codes = _codes(
        "no_run_context", "invalid_wait", "unregistered_flow", "unresumable_flow", "parameters_mismatch"
    )


class PluginError(SmthrsError):
    """A plugin (entry-point group ``smthrs``) could not be loaded or broke the hook contract."""

    family = "plugin"
    codes = _codes(
        "load_failed",
        "invalid_plugin",
        "duplicate_plugin",
        "duplicate_action",
        "unknown_action",
        "invalid_default",
    )


class CodecError(SmthrsError, ValueError):
    """A typed value could not be keyed, stored or read back by the value codecs (:mod:`smthrs_plugin.codecs`):
    ``no_codec`` (no codec handles the type: register one through the ``smthrs_value_codecs`` hook),
    ``duplicate_codec`` (two codecs claim one tag), ``undecodable`` (a stored document is malformed, names an
    unknown tag, or no longer matches its type), ``reserved_key`` (a plain dict uses the reserved ``"$smthrs"``
    key), ``unsafe_codec`` (decoding would need to import or run code the process has not already loaded),
    ``invalid_value`` (the value has no exact stored form, e.g. a naive datetime)."""

    family = "codec"
    codes = _codes(
        "no_codec", "duplicate_codec", "undecodable", "reserved_key", "unsafe_codec", "invalid_value"
    )


class RemoteError(SmthrsError):
    """Remote execution over the content-addressed store failed (``prefect/_remote.py``): ``store_not_shared`` (the
    artifact store is not one the workers can reach), ``input_unavailable`` (a declared read's blob was missing or
    corrupt in the store even after it was uploaded again), ``output_unavailable`` (a blob a worker reported is
    missing or corrupt), ``invalid_delta`` (a worker reported a path outside its tree or an entry that is not a
    file, directory or link), ``unsupported_tree`` (a sandbox tree holding something that cannot be shipped),
    ``worker_failed`` (the task runner lost the body without an outcome)."""

    family = "remote"
    codes = _codes(
        "store_not_shared",
        "input_unavailable",
        "output_unavailable",
        "invalid_delta",
        "unsupported_tree",
        "worker_failed",
    )


def passing_fault(exc: BaseException | None) -> SmthrsError | None:
    """The passing fault of the environment behind ``exc`` (itself, or on its ``cause``/``__cause__`` chain), else
    None. A passing fault (a store unreachable, a full disk, a lock held too long, a read-only store, an artifact
    store that did not answer) is nobody's decision and no node's failure: the same request may succeed unchanged
    once it is gone, so a run it stops is left resumable, never settled ``failed``, and the CLI exits 75."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, SmthrsError) and exc.code in exc.passing_codes:
            return exc
        nxt = exc.cause if isinstance(exc, SmthrsError) and exc.cause is not None else exc.__cause__
        exc = nxt
    return None
