"""``POST /rpc``: the control plane's verbs as JSON-RPC 2.0 methods. PURE of any web framework (``_app.py`` is the
HTTP side: bounded body, credential, status codes).

Methods are the CLI verbs, taking the CLI's argument and option names as ``params`` (the README's ``smthrs serve``
section), plus the review page's reads ``review.pending {}``, ``review.card {ident}`` (a plan id) and
``review.history {ident}`` (a plan id or a run id: who decided, when, scope, digest, receipt, what happens next).
A result is the object the CLI prints with ``--json``, in the one JSON vocabulary (``wire.py``,
``smthrs_plugin/vocabulary.py``); the review reads follow its rules for their own keys (``_review.py``).

- One request object per call, with an ``id``: a batch or a notification is refused ``-32600`` before anything runs;
  unknown params ``-32602``.
- Mutations go through :class:`~smthrs_plugin.control.facade.Control` exactly like the CLI, as the principal the
  transport authenticated; principal fields in ``params`` (``as``, ``as_``, ``principal``) are dropped (a
  ``principal`` inside a signal's ``value`` stays).
- ``resume`` records the receipt (``launcher=None``); it does not drive the run.
- A refusal is a JSON-RPC error whose ``data`` is the typed error, never its ``cause`` (codes: docs/rules.md,
  "JSON-RPC"); anything else is a bug, logged and answered ``-32603`` with no details.
- ``plan {path}`` reads a plan file INSIDE the server's workspace only; ``plan {text}`` takes the YAML itself.
"""

from __future__ import annotations

import logging
import stat
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..control.authority import NodeTarget, PlanTarget
from ..control.facade import Control
from ..control.identity import Principal, refuse
from ..errors import ControlError, InvalidInput, SmthrsError, passing_fault
from ..runtime import Runtime
from .wire import loads_json, plan_payload, receipt_payload, runs_payload, show_payload

__all__ = [
    "MUTATIONS",
    "READS",
    "METHODS",
    "Call",
    "RpcFailure",
    "Methods",
    "parse_call",
    "error_response",
    "result_response",
    "PARSE_ERROR",
    "INVALID_REQUEST",
    "METHOD_NOT_FOUND",
    "INVALID_PARAMS",
    "INTERNAL_ERROR",
    "REFUSED",
]

log = logging.getLogger("smthrs.serve")

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
#: A typed refusal of the control plane (the JSON-RPC "server error" range).
REFUSED = -32000

#: Methods that write: they need the bearer credential.
MUTATIONS = frozenset({"plan", "approve", "deny", "cancel", "resume", "signal"})
#: Methods that only read: open to every caller.
READS = frozenset({"show", "runs", "review.pending", "review.card", "review.history"})
METHODS = MUTATIONS | READS

#: Principal fields a caller might send; the transport decides who acts, so they are dropped unread.
_PRINCIPAL_FIELDS = frozenset({"as", "as_", "principal"})


@dataclass(frozen=True)
class _Spec:
    required: frozenset[str]
    optional: frozenset[str]


def _spec(required: str = "", optional: str = "") -> _Spec:
    return _Spec(frozenset(required.split()), frozenset(optional.split()))


_SPECS: dict[str, _Spec] = {
    "plan": _spec("", "path text inputs"),
    "show": _spec("run_id"),
    "runs": _spec("", "status waiting flow limit cursor"),
    "approve": _spec("ident", "request digest scope key"),
    "deny": _spec("ident", "request digest key"),
    "cancel": _spec("run_id", "reason"),
    "resume": _spec("run_id key"),
    "signal": _spec("run_id name value", "key"),
    "review.pending": _spec(),
    "review.card": _spec("ident"),
    "review.history": _spec("ident"),
}
assert set(_SPECS) == METHODS


@dataclass(frozen=True)
class Call:
    """One parsed JSON-RPC request: its ``id``, ``method`` (one of :data:`METHODS`) and ``params`` (an object)."""

    id: int | str
    method: str
    params: dict[str, Any]

    @property
    def mutation(self) -> bool:
        return self.method in MUTATIONS


class RpcFailure(Exception):
    """A call answered with a JSON-RPC error object: the typed refusal, its JSON-RPC code and the request id (None
    when the request was unreadable)."""

    def __init__(self, rpc_code: int, error: SmthrsError, request_id: int | str | None = None) -> None:
        super().__init__(error.message)
        self.rpc_code = rpc_code
        self.error = error
        self.request_id = request_id

    def response(self) -> dict[str, Any]:
        return error_response(self.request_id, self.rpc_code, self.error)


def _invalid_request(message: str, request_id: int | str | None = None) -> RpcFailure:
    return RpcFailure(INVALID_REQUEST, ControlError("invalid_options", message, option="request"), request_id)


def parse_call(body: bytes) -> Call:
    """The request in ``body``, or :class:`RpcFailure` (parse error, invalid request, unknown method)."""
    try:
        data = loads_json(body, "the request body")
    except InvalidInput as exc:
        raise RpcFailure(PARSE_ERROR, exc) from exc
    if type(data) is list:
        raise _invalid_request("batch requests are not supported; send one JSON-RPC request object per call")
    if type(data) is not dict:
        raise _invalid_request("a JSON-RPC request is a JSON object {jsonrpc, id, method, params}")
    rid = data.get("id")
    request_id = rid if (type(rid) is str or type(rid) is int) else None
    if data.get("jsonrpc") != "2.0":
        raise _invalid_request('the request must say "jsonrpc": "2.0"', request_id)
    if request_id is None:
        raise _invalid_request(
            "the request needs an id (a string or an integer): this server answers every call, and a mutation "
            "sent as a notification would be applied without anyone reading its receipt",
        )
    extra = set(data) - {"jsonrpc", "id", "method", "params"}
    if extra:
        raise _invalid_request(f"unknown request members {sorted(extra)}", request_id)
    method = data.get("method")
    if type(method) is not str:
        raise _invalid_request(
            f"the request needs a method name (a string), got {_json_type(method)}; known: "
            + ", ".join(sorted(METHODS)),
            request_id,
        )
    if method not in METHODS:
        shown = repr(method)[:80]
        raise RpcFailure(
            METHOD_NOT_FOUND,
            ControlError(
                "invalid_options", f"no method {shown}; known: {', '.join(sorted(METHODS))}", option="method"
            ),
            request_id,
        )
    params = data.get("params", {})
    if type(params) is not dict:
        raise RpcFailure(
            INVALID_PARAMS,
            ControlError(
                "invalid_options",
                'params must be an object named by the CLI\'s option names, e.g. {"ident": PLAN_ID}',
                option="params",
            ),
            request_id,
        )
    return Call(request_id, method, params)


def result_response(request_id: int | str, result: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def error_response(request_id: int | str | None, rpc_code: int, error: SmthrsError | None) -> dict[str, Any]:
    """A JSON-RPC error object; ``data`` is the typed error without its internal ``cause`` (None: an internal
    error, answered without details)."""
    if error is None:
        body: dict[str, Any] = {
            "code": rpc_code,
            "message": "internal error; the server's log has the details",
        }
    else:
        data = error.to_dict()
        data.pop("cause", None)
        if passing_fault(error) is not None:
            # The store failed under the call, nobody refused it: the same call succeeds once the fault is gone
            # (the HTTP answer is 503 with Retry-After, see _app).
            data["retryable"] = True
        body = {"code": rpc_code, "message": error.message, "data": data}
    return {"jsonrpc": "2.0", "id": request_id, "error": body}


class Methods:
    """The method table over one runtime; ``principal`` is who an authenticated caller acts as."""

    def __init__(self, rt: Runtime, control: Control, principal: Principal) -> None:
        self.rt = rt
        self.control = control
        self.principal = principal
        self._table: dict[str, Callable[[dict[str, Any]], Any]] = {
            "plan": self._plan,
            "show": self._show,
            "runs": self._runs,
            "approve": self._approve,
            "deny": self._deny,
            "cancel": self._cancel,
            "resume": self._resume,
            "signal": self._signal,
            "review.pending": self._review_pending,
            "review.card": self._review_card,
            "review.history": self._review_history,
        }

    def call(self, call: Call) -> dict[str, Any]:
        """Run ``call`` (its credential already checked by the transport) and answer its JSON-RPC response."""
        try:
            params = _checked_params(call)
            return result_response(call.id, self._table[call.method](params))
        except SmthrsError as exc:
            code = (
                INVALID_PARAMS if isinstance(exc, InvalidInput) or exc.code == "invalid_options" else REFUSED
            )
            return error_response(call.id, code, exc)
        except Exception:
            # A bug, not a refusal: the operator gets the traceback, the caller no internals.
            log.exception("smthrs serve: %s (id %r) failed", call.method, call.id)
            return error_response(call.id, INTERNAL_ERROR, None)

    # -- writes ------------------------------------------------------------------------------------------------------
    def _plan(self, p: dict[str, Any]) -> dict[str, Any]:
        path, text = _opt_str(p, "path"), _opt_str(p, "text")
        if (path is None) == (text is None):
            raise _options(
                "give exactly one of path (a plan file in the workspace) or text (the plan YAML)", "path"
            )
        inputs = p.get("inputs", {})
        if type(inputs) is not dict:
            raise _options("inputs must be an object of plan inputs {KEY: VALUE}", "inputs")
        if text is not None:
            with tempfile.TemporaryDirectory(prefix="smthrs-serve-plan-") as tmp:
                f = Path(tmp) / "plan.yaml"
                f.write_text(text, encoding="utf-8")
                card = self._plan_file(f, inputs)
        else:
            assert path is not None
            card = self._plan_file(self._inside_workspace(path), inputs)
        return plan_payload(self.control, card)

    def _inside_workspace(self, path: str) -> Path:
        root = self.rt.workspace.resolve()
        if "\x00" in path:  # no file has such a name; the OS calls below would raise a bare ValueError
            raise _options(
                f"path {path[:200]!r} holds a NUL character; name a plan file of the workspace", "path"
            )
        candidate = Path(path)
        resolved = (candidate if candidate.is_absolute() else root / candidate).resolve()
        if not resolved.is_relative_to(root):
            raise _options(
                f"path {path!r} is outside the server's workspace {str(root)!r}; the server reads plan files of its "
                "workspace only — send the YAML as text instead",
                "path",
            )
        # A FIFO or device in the workspace would hold a worker thread for ever (or stream without end): only a
        # regular file is read. A missing file is left to the plan-file reader, which names it.
        try:
            mode = resolved.stat().st_mode
        except FileNotFoundError:
            return resolved
        except OSError as exc:
            raise ControlError(
                "invalid_options",
                f"path {path[:200]!r} cannot be looked at ({exc.strerror or type(exc).__name__}); name a plan file "
                "of the workspace, or send the YAML as text",
                option="path",
                cause=exc,
            ) from exc
        if not stat.S_ISREG(mode):
            raise _options(
                f"path {path!r} is not a regular file; name a plan file of the workspace, or send the YAML as text",
                "path",
            )
        return resolved

    def _plan_file(self, plan_file: Path, inputs: dict[str, Any]) -> Any:
        from ..scheduler.planfile import read_plan_file

        pf = read_plan_file(plan_file, actions=self.rt.actions)
        return self.control.plan(
            pf.plan,
            input=inputs,
            envelope=pf.envelope,
            approval=pf.approval == "required",
            principal=self.principal,
            renew=True,
        )

    def _approve(self, p: dict[str, Any]) -> dict[str, Any]:
        target = self._target(p)
        receipt = self.control.approve(
            target, scope=_opt_str(p, "scope"), idempotency_key=_opt_str(p, "key"), principal=self.principal
        )
        card = target if isinstance(target, PlanTarget) else None
        return receipt_payload(self.control, receipt, operation="approve", card=card)

    def _deny(self, p: dict[str, Any]) -> dict[str, Any]:
        target = self._target(p)
        receipt = self.control.deny(target, idempotency_key=_opt_str(p, "key"), principal=self.principal)
        card = target if isinstance(target, PlanTarget) else None
        return receipt_payload(self.control, receipt, operation="deny", card=card)

    def _cancel(self, p: dict[str, Any]) -> dict[str, Any]:
        receipt = self.control.cancel(
            _str(p, "run_id"), principal=self.principal, reason=_opt_str(p, "reason")
        )
        return receipt_payload(self.control, receipt, operation="cancel", run_id=_str(p, "run_id"))

    def _resume(self, p: dict[str, Any]) -> dict[str, Any]:
        receipt = self.control.resume(
            _str(p, "run_id"), idempotency_key=_str(p, "key"), principal=self.principal
        )
        return receipt_payload(self.control, receipt, operation="resume", run_id=_str(p, "run_id"))

    def _signal(self, p: dict[str, Any]) -> dict[str, Any]:
        run_id, name = _str(p, "run_id"), _str(p, "name")
        receipt = self.control.signal(
            run_id, name, p["value"], idempotency_key=_opt_str(p, "key"), principal=self.principal
        )
        return {**receipt_payload(self.control, receipt, operation="signal"), "name": name}

    def _target(self, p: dict[str, Any]) -> PlanTarget | NodeTarget:
        """The approval target named like ``smthrs approve IDENT [--request R] [--digest D]``."""
        return self.control.approval_target(_str(p, "ident"), _opt_str(p, "request"), _opt_str(p, "digest"))

    # -- reads ---------------------------------------------------------------------------------------------------------
    def _show(self, p: dict[str, Any]) -> dict[str, Any]:
        run_id = _str(p, "run_id")
        payload, exists = show_payload(self.rt.db, run_id)
        if not exists:
            run = payload["run"]
            why = (
                f"deleted (tombstone at revision {run['revision']})"
                if run["deleted"]
                else "never recorded here"
            )
            raise ControlError(
                "run_not_found", f"run {run_id!r} not found: {why}", run_id=run_id, deleted=run["deleted"]
            )
        return payload

    def _runs(self, p: dict[str, Any]) -> dict[str, Any]:
        limit = p.get("limit", 100)
        if type(limit) is not int:
            raise _options("limit must be an integer (1..200)", "limit")
        return runs_payload(
            self.rt.db,
            status=_opt_str(p, "status"),
            waiting=_opt_str(p, "waiting"),
            flow=_opt_str(p, "flow"),
            limit=limit,
            cursor=_opt_str(p, "cursor"),
        )

    def _review_pending(self, p: dict[str, Any]) -> Any:
        from . import _review  # the review page's reads, loaded when first asked for

        return _review.pending_items(self.control)

    def _review_card(self, p: dict[str, Any]) -> Any:
        from . import _review

        return _review.card_view(self.control, _str(p, "ident"))

    def _review_history(self, p: dict[str, Any]) -> Any:
        from . import _review

        return _review.history_view(self.control, _str(p, "ident"))


def _options(message: str, option: str) -> ControlError:
    return ControlError("invalid_options", message, option=option)


def _checked_params(call: Call) -> dict[str, Any]:
    params = {k: v for k, v in call.params.items() if k not in _PRINCIPAL_FIELDS}
    spec = _SPECS[call.method]
    unknown = set(params) - spec.required - spec.optional
    if unknown:
        known = sorted(spec.required | spec.optional)
        raise _options(
            f"{call.method}: unknown params {sorted(unknown)}; it takes {known or 'none'}", "params"
        )
    missing = spec.required - set(params)
    if missing:
        raise _options(f"{call.method}: missing params {sorted(missing)}", "params")
    return params


def _str(p: Mapping[str, Any], name: str) -> str:
    v = p[name]
    if type(v) is not str:
        raise refuse("plain_data", f"param {name!r} must be a string, got {_json_type(v)}")
    return v


def _opt_str(p: Mapping[str, Any], name: str) -> str | None:
    return None if p.get(name) is None else _str(p, name)


def _json_type(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number"
    )
