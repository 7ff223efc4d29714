"""Plan files: the YAML plan format (docs/how-to/plans.md), and the executor that runs its nodes.

Invariants
- A malformed file is refused with ``PlanError(invalid_plan_file)`` naming the file, line and field, before
  anything is compiled or written; compile errors are re-raised the same way, located at the node.
- The file is untrusted input, read in bounded time and memory (``_safe_yaml``: ≤ 1 MiB, nesting ≤ 128,
  ≤ 250,000 YAML nodes counting aliases expanded; duplicate and non-string keys refused).
- Everything checkable at load is checked at load (ids, ``approval``, ``maximum_plan_nodes``, the full compile,
  every node's boundary declaration), so ``smthrs plan`` / ``run --key`` refuse before a card is stored or an
  idempotency key spent.
- The node body is what its key folds (``{"run": cmd}`` or ``{"call": target, "with": {...}}``) and the executor
  reads the action from it, so a generated merge node runs its loser's action.
- A ``run`` command runs in the sandbox root as its own process group with ``SMTHRS_NODE_ID``,
  ``SMTHRS_ATTEMPT`` and ``SMTHRS_INPUTS`` set; an interrupt kills the whole group (:class:`CommandInterrupted`).
  The inherited environment is NOT part of the key. Its value is ``{"exit_code": 0, "stdout": ...}``.
- ``approval:`` nodes are gated by the scheduler's gate (a scheduler without one fails them); ``wait:`` nodes are
  durable timers the scheduler runs itself (``timer.py``).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..boundary import Declaration, IsolatedCall, IsolationKind, command_preexec, resolve_isolation
from ..errors import PlanError
from ..plan import Pending, Plan, Ref, Value, compile_plan, node
from ..plan.compile import DEFAULT_MAXIMUM_PLAN_NODES
from ._safe_yaml import Marks, load_bounded, read_bounded
from ._session import declaration_of
from .model import NodeInput
from .timer import check_wait_spec

__all__ = [
    "load_plan",
    "read_plan_file",
    "PlanFile",
    "PlanFileExecutor",
    "CommandFailed",
    "CommandInterrupted",
]

#: Plan, flow and node ids in a plan file (they name cards, runs and journal entries; none needs more).
MAX_ID_CHARS = 256
_APPROVALS = (None, "none", "required")
_TOP = {"plan", "flow", "nodes", "approval", "envelope", "maximum_plan_nodes"}
_NODE = {
    "id",
    "run",
    "call",
    "with",
    "wait",
    "reads",
    "writes",
    "removes",
    "needs",
    "inputs",
    "priority",
    "kind",
    "tier",
    "boundary",
    "conflict",
    "runtime",
    "nondeterministic",
    "layers",
    "capabilities",
    "approval",
}
_CHOICES = {
    "kind": ("step", "agent"),
    "tier": ("sealed", "compensable", "irreversible"),
    "boundary": ("hard", "expected"),
    "conflict": ("serialize", "lane", "fail"),
    "runtime": ("delay-rebase", "stop-merge"),
}


class CommandFailed(RuntimeError):
    """A ``run`` command exited non-zero (the node fails; the message carries the tail of its stderr)."""

    def __init__(self, node_id: str, exit_code: int, stderr: str) -> None:
        tail = stderr.strip().splitlines()[-5:]
        super().__init__(
            f"node {node_id!r}: command exited with status {exit_code}"
            + (": " + " | ".join(tail) if tail else "")
        )
        self.exit_code = exit_code


class CommandInterrupted(CommandFailed):
    """A ``run`` command's process group was killed because its scheduler pass was interrupted."""

    def __init__(self, node_id: str, exit_code: int, reason: str | None) -> None:
        super().__init__(node_id, exit_code, f"killed: the scheduler pass was interrupted ({reason})")


@dataclass(frozen=True)
class PlanFileExecutor:
    """Runs plan-file nodes from their bodies (``run`` / ``call``). Stateless and picklable.

    ``actions`` (plugins): named plan actions — ``call: <name>`` (no ``:``) runs ``actions[name]`` with the
    same contract as a ``pkg.module:function`` target; the runtime passes the plugins' actions (``rt.actions``)."""

    actions: Mapping[str, Any] = field(default_factory=dict)
    #: How a node's body is kept from the live workspace (``auto | namespace | process | thread``, the runtime's
    #: ``SMTHRS_ISOLATION``): a ``call:`` function runs like a step body (``boundary.IsolatedCall``); a ``run:``
    #: command in a namespace sees the sandbox at the workspace's own path (elsewhere its working directory is
    #: the sandbox, as always). None: the environment's ``SMTHRS_ISOLATION`` (read when a node runs).
    isolation: str | None = None

    def __call__(self, ni: NodeInput) -> Any:
        # A node declaring ``approval:`` reaches the executor only once the scheduler's gate approved it (the
        # gate is asked before the attempt begins: ``PlanScheduler(gate=...)``, wired by the runtime).
        draft = ni.node.draft
        body = draft.material.body
        if not isinstance(body, dict) or not ({"run", "call"} & set(body)):
            raise PlanError(
                "invalid_plan",
                f"node {ni.node.id!r} has no run: or call: action"
                + (" (a wait: node is the scheduler's timer)" if draft.wait else ""),
            )
        kind = self._isolation(ni)
        if "run" in body:
            return _run_command(ni, str(body["run"]), namespace=kind == "namespace")
        target, kwargs = str(body["call"]), body.get("with") or {}
        if kind is None:
            return _call(ni, target, kwargs, self.actions)
        call = IsolatedCall(ni.workspace or ni.root, ni.root, ni.declaration, kind, subject=f"node {ni.id}")
        # In a namespace the workspace's own path shows the sandbox (the sandbox path itself may be hidden there).
        seen = replace(ni, root=Path(call.workspace)) if kind == "namespace" else ni
        with ni.cancel.on_cancel(call.kill):
            return call.run(lambda: _call(seen, target, kwargs, self.actions))

    def _isolation(self, ni: NodeInput) -> IsolationKind | None:
        """The isolation this node's body runs under; None where there is nothing to isolate from (an executor
        called without a workspace or declaration, e.g. directly by a test)."""
        if ni.workspace is None or ni.declaration is None:
            return None
        # The variable Settings.isolation reads, without parsing every setting once per node.
        choice = self.isolation if self.isolation is not None else os.environ.get("SMTHRS_ISOLATION", "auto")
        return resolve_isolation(choice, subject=f"node {ni.id}", workspace=ni.workspace)


def _run_command(ni: NodeInput, cmd: str, *, namespace: bool = False) -> dict[str, Any]:
    env = dict(os.environ)
    env.update(
        SMTHRS_NODE_ID=ni.node.id,
        SMTHRS_ATTEMPT=str(ni.attempt),
        SMTHRS_INPUTS=json.dumps([None if v is None or not _present(v) else v for v in ni.inputs]),
    )
    proc = subprocess.Popen(
        cmd,
        shell=True,
        cwd=ni.root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        # In a namespace, absolute workspace paths in the command resolve to its sandbox too.
        preexec_fn=command_preexec(ni.workspace, ni.root) if namespace and ni.workspace is not None else None,
    )
    try:
        with ni.cancel.on_cancel(lambda: _kill_group(proc)):
            out, err = proc.communicate()
    except BaseException:
        # The waiting thread itself was interrupted (Ctrl-C reaches the thread, not a command in its own session).
        _kill_group(proc)
        proc.wait()
        raise
    if ni.cancel.cancelled and proc.returncode != 0:
        raise CommandInterrupted(ni.node.id, proc.returncode, ni.cancel.reason)
    if proc.returncode != 0:
        raise CommandFailed(ni.node.id, proc.returncode, err.decode("utf-8", errors="replace"))
    return {"exit_code": 0, "stdout": out.decode("utf-8", errors="replace")}


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the command's whole process group (the shell and everything it started)."""
    killpg = getattr(os, "killpg", None)
    try:
        if killpg is not None:
            killpg(proc.pid, signal.SIGKILL)
        else:  # pragma: no cover - no process groups on this platform: the shell alone
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already (the command exited on its own)


def _present(v: Any) -> bool:
    from ..plan import ABSENT

    return v is not ABSENT


def _call(ni: NodeInput, target: str, kwargs: Mapping[str, Any], actions: Mapping[str, Any]) -> Any:
    if ":" not in target:
        action = actions.get(target)
        if action is None:
            raise PlanError(
                "invalid_plan",
                f"node {ni.node.id!r}: no plan action named {target!r} (installed: {sorted(actions) or 'none'}); "
                "install the plugin that provides it (`smthrs plugins` lists them) or use call: 'pkg.module:function'",
            )
        return action(ni, **dict(kwargs))
    module, _, name = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise PlanError(
            "invalid_plan",
            f"node {ni.node.id!r}: cannot import {target!r} ({exc}); use call: 'pkg.module:function'",
        ) from exc
    return fn(ni, **dict(kwargs))


@dataclass(frozen=True)
class PlanFile:
    """A loaded plan file: the compiled plan, its executor, and the declared plan-level data."""

    plan: Plan
    executor: PlanFileExecutor
    path: Path
    approval: Any = None
    envelope: Mapping[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ parsing


class _Refuser:
    def __init__(self, path: Path, marks: Marks) -> None:
        self.path = path
        self.marks = marks

    def __call__(
        self, where: tuple[Any, ...], field_name: str, why: str, cause: BaseException | None = None
    ) -> PlanError:
        line = self.marks.line(where)
        return PlanError(
            "invalid_plan_file",
            f"{self.path}:{line}: field {field_name!r}: {why}",
            cause=cause,
            file=str(self.path),
            line=line,
            field=field_name,
        )


def read_plan_file(path: str | os.PathLike[str], actions: Mapping[str, Any] | None = None) -> PlanFile:
    """Parse and compile a plan file (see the module docstring); ``PlanError(invalid_plan_file)`` names the
    line and field of anything malformed. ``actions``: the named plan actions ``call: <name>`` may use (from
    plugins, ``rt.actions``); when given, a name that is not among them is refused here, located."""
    p = Path(path)
    # Bounded before anything else: the size on read, then depth, aliases, duplicate and non-string keys while
    # the document is built (``_safe_yaml``); nothing here walks a structure the loader has not counted.
    loaded = load_bounded(read_bounded(p), source=str(p))
    if loaded is None:
        raise PlanError(
            "invalid_plan_file",
            f"{p}:1: the file is empty; declare plan:, flow: and nodes:",
            file=str(p),
            line=1,
            field="plan",
        )
    data = loaded.value
    refuse = _Refuser(p, loaded.marks)
    if not isinstance(data, dict):
        raise refuse((), "plan", "the top level must be a mapping with plan:, flow: and nodes:")
    for k in data:
        if k not in _TOP:
            raise refuse((k,), str(k), f"unknown top-level field; known: {', '.join(sorted(_TOP))}")
    plan_id = data.get("plan")
    if not isinstance(plan_id, str) or not plan_id:
        raise refuse(("plan",), "plan", "the plan id must be a non-empty string (plan: release-1.4)")
    _check_length(plan_id, ("plan",), "plan", refuse)
    flow = data.get("flow", plan_id)
    if not isinstance(flow, str) or not flow:
        raise refuse(("flow",), "flow", "flow must be a non-empty string (flow: ci/release)")
    _check_length(flow, ("flow",), "flow", refuse)
    approval = data.get("approval")
    if approval not in _APPROVALS:
        raise refuse(
            ("approval",),
            "approval",
            f"{approval!r} is not understood; write `approval: required` (or leave it out)",
        )
    maximum = data.get("maximum_plan_nodes", DEFAULT_MAXIMUM_PLAN_NODES)
    if type(maximum) is not int or not 1 <= maximum <= DEFAULT_MAXIMUM_PLAN_NODES:
        # A file may lower the library's cap, never raise it: the cap bounds what one file can make the
        # scheduler hold (generated merge nodes included), and the file is the untrusted side.
        raise refuse(
            ("maximum_plan_nodes",),
            "maximum_plan_nodes",
            f"must be an integer from 1 to {DEFAULT_MAXIMUM_PLAN_NODES:,} (the library's cap; a plan file may "
            f"lower it, not raise it), not {maximum!r}",
        )
    envelope = data.get("envelope", {})
    if not isinstance(envelope, dict):
        raise refuse(("envelope",), "envelope", "must be a mapping")
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise refuse(("nodes",), "nodes", "must be a non-empty list of nodes (- id: build ...)")
    if len(nodes) > maximum:
        # Refused before any node is built (compile would refuse it too, after building them all).
        raise refuse(
            ("nodes", maximum),
            "nodes",
            f"the plan declares {len(nodes):,} nodes, over maximum_plan_nodes={maximum:,}; split the plan",
        )
    drafts = []
    where_of: dict[str, int] = {}
    for i, raw in enumerate(nodes):
        drafts.append(_node(raw, i, refuse))
        where_of.setdefault(drafts[-1].id, i)
        target = raw.get("call")
        if actions is not None and isinstance(target, str) and ":" not in target and target not in actions:
            raise refuse(
                ("nodes", i, "call"),
                "call",
                f"no plan action named {target!r} (installed: {sorted(actions) or 'none'}); install the plugin "
                "that provides it (`smthrs plugins` lists them) or use 'pkg.module:function'",
            )
    try:
        plan = compile_plan(plan_id, flow, drafts, maximum_plan_nodes=maximum)
    except PlanError as exc:
        raise _locate(exc, nodes, where_of, refuse) from exc
    for n in plan.nodes:
        # The step boundary's own rules (a glob removal, and whatever else it cannot honour), checked here so a
        # file is refused at load — before a card is stored or an idempotency key spent — not at scheduling.
        try:
            declaration_of(n)
        except PlanError as exc:
            i = where_of[n.id]
            f, j = _declaration_field(nodes[i], n.effects.boundary_mode)
            raise refuse(("nodes", i, f) if j is None else ("nodes", i, f, j), f, exc.message, exc) from exc
    return PlanFile(plan, PlanFileExecutor(dict(actions or {})), p, approval, envelope)


def load_plan(
    path: str | os.PathLike[str], actions: Mapping[str, Any] | None = None
) -> tuple[Plan, PlanFileExecutor]:
    """``(plan, executor)`` of a plan file: run it with ``scheduler.run(plan, executor)``."""
    pf = read_plan_file(path, actions)
    return pf.plan, pf.executor


def _node(raw: Any, i: int, refuse: _Refuser) -> Any:
    at = ("nodes", i)
    if not isinstance(raw, dict):
        raise refuse(at, "nodes", f"node #{i} must be a mapping (- id: build ...)")
    for k in raw:
        if k not in _NODE:
            raise refuse((*at, k), str(k), f"unknown node field; known: {', '.join(sorted(_NODE))}")
    node_id = raw.get("id")
    if not isinstance(node_id, str) or not node_id:
        raise refuse((*at, "id"), "id", f"node #{i} needs a non-empty string id")
    _check_length(node_id, (*at, "id"), "id", refuse)
    actions = [k for k in ("run", "call") if k in raw]
    if len(actions) > 1:
        raise refuse((*at, "call"), "call", f"node {node_id!r} declares both run: and call:; choose one")
    if not actions and "wait" not in raw:
        raise refuse(
            at, "run", f"node {node_id!r} needs run: (a shell command) or call: (pkg.module:function)"
        )
    body: dict[str, Any] = {}
    if "run" in raw:
        if not isinstance(raw["run"], str) or not raw["run"].strip():
            raise refuse((*at, "run"), "run", "must be a non-empty shell command string")
        body["run"] = raw["run"]
    if "call" in raw:
        target = raw["call"]
        if (
            not isinstance(target, str)
            or not target.strip()
            or target.startswith(":")
            or target.endswith(":")
        ):
            raise refuse(
                (*at, "call"),
                "call",
                "must be 'pkg.module:function' or the name of a plan action from a plugin",
            )
        body["call"] = target
        if "with" in raw:
            if not isinstance(raw["with"], dict):
                raise refuse((*at, "with"), "with", "must be a mapping of keyword arguments")
            body["with"] = raw["with"]
    elif "with" in raw:
        raise refuse((*at, "with"), "with", "is only meaningful with call:")
    for f in ("reads", "writes", "removes", "needs", "layers"):
        v = raw.get(f, [])
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise refuse((*at, f), f, "must be a list of strings")
    for f, choices in _CHOICES.items():
        if f in raw and raw[f] not in choices:
            raise refuse((*at, f), f, f"must be one of {', '.join(choices)}, not {raw[f]!r}")
    if "priority" in raw and type(raw["priority"]) is not int:
        raise refuse((*at, "priority"), "priority", f"must be an integer, not {raw['priority']!r}")
    if "nondeterministic" in raw and type(raw["nondeterministic"]) is not bool:
        raise refuse((*at, "nondeterministic"), "nondeterministic", "must be true or false")
    for f in ("approval", "wait"):
        if f in raw and not isinstance(raw[f], dict):
            raise refuse((*at, f), f, "must be a mapping")
    if "wait" in raw:
        if actions:
            raise refuse(
                (*at, "wait"),
                "wait",
                f"a timer node runs no action: move {actions[0]}: to a node that needs it",
            )
        try:
            check_wait_spec(node_id, raw["wait"])
        except PlanError as exc:
            raise refuse((*at, "wait"), "wait", exc.message, exc) from exc
    inputs: list[Any] = [
        _input(x, (*at, "inputs", j), refuse) for j, x in enumerate(_list(raw, "inputs", at, refuse))
    ]
    needs = raw.get("needs", [])
    inputs += [Pending(n) for n in ([needs] if isinstance(needs, str) else needs)]
    kwargs: dict[str, Any] = {
        "body": body,
        "inputs": inputs,
        "reads": _strs(raw.get("reads", [])),
        "writes": _strs(raw.get("writes", [])),
        "removes": _strs(raw.get("removes", [])),
        "layers": _strs(raw.get("layers", [])),
    }
    for f, arg in (
        ("priority", "priority"),
        ("kind", "kind"),
        ("tier", "tier"),
        ("boundary", "boundary"),
        ("conflict", "conflict"),
        ("runtime", "runtime"),
        ("nondeterministic", "nondeterministic"),
        ("capabilities", "capabilities"),
        ("approval", "approval"),
        ("wait", "wait"),
    ):
        if f in raw:
            kwargs[arg] = raw[f]
    try:
        return node(node_id, **kwargs)
    except PlanError as exc:
        field_name, index = _field_of(exc, raw)
        where = (*at, field_name) if field_name in raw else at
        raise refuse(where if index is None else (*where, index), field_name, exc.message, exc) from exc


def _check_length(v: str, where: tuple[Any, ...], field_name: str, refuse: _Refuser) -> None:
    if len(v) > MAX_ID_CHARS:
        raise refuse(
            where,
            field_name,
            f"is {len(v):,} characters long; an id is at most {MAX_ID_CHARS} characters — choose a shorter one",
        )


def _declaration_field(raw: Mapping[str, Any], mode: Any) -> tuple[str, int | None]:
    """The field (and item) a step-boundary refusal is about: the first entry the boundary refuses on its own,
    else ``removes`` (a refused combination, e.g. a path both written and removed)."""
    for f in ("removes", "writes", "reads"):
        for j, entry in enumerate(_strs(raw.get(f, []))):
            try:
                Declaration.of(**{f: [entry]}, mode=mode)
            except PlanError:
                return f, j
    return "removes", None


def _strs(v: Any) -> list[str]:
    return [v] if isinstance(v, str) else list(v)


def _list(raw: Mapping[str, Any], f: str, at: tuple[Any, ...], refuse: _Refuser) -> list[Any]:
    v = raw.get(f, [])
    if not isinstance(v, list):
        raise refuse((*at, f), f, "must be a list")
    return v


def _input(x: Any, where: tuple[Any, ...], refuse: _Refuser) -> Any:
    if isinstance(x, str) and x:
        return Ref(x)
    if isinstance(x, dict) and len(x.keys() - {"path"}) == 1:
        kind = next(iter(x.keys() - {"path"}))
        if kind == "ref" and isinstance(x["ref"], str):
            path = x.get("path", [])
            if isinstance(path, str):
                path = path.split(".")
            if not isinstance(path, list) or not all(isinstance(s, str) for s in path):
                raise refuse((*where, "path"), "inputs", "path must be a list of object keys")
            return Ref(x["ref"], path=path)
        if kind == "pending" and isinstance(x["pending"], str) and "path" not in x:
            return Pending(x["pending"])
        if kind == "literal" and "path" not in x:
            return Value(x["literal"])
    raise refuse(
        where,
        "inputs",
        f"{x!r} is not an input: use {{ref: id, path: [key]}}, {{pending: id}}, {{literal: v}}",
    )


def _field_of(exc: PlanError, raw: Mapping[str, Any]) -> tuple[str, int | None]:
    """The node field (and list index) a declaration error is about."""
    details = exc.details
    path = details.get("path")
    if isinstance(path, str):
        for f in ("reads", "writes", "removes"):
            items = _strs(raw.get(f, []))
            if path in items:
                return f, items.index(path)
    if "remove" in details:
        return "removes", None
    if "write" in details:
        return "writes", None
    if "field" in details and isinstance(details["field"], str):
        head = details["field"].split(".")[0]
        return {"material": "inputs", "effects": "reads", "conflict_strategy": "conflict"}.get(
            head, head
        ), None
    return ("reads" if exc.code == "invalid_effects" else "id"), None


def _locate(exc: PlanError, nodes: list[Any], where_of: Mapping[str, int], refuse: _Refuser) -> PlanError:
    d = exc.details
    node_id = d.get("node") or d.get("later")
    if exc.code == "cycle" and isinstance(d.get("cycle"), list) and d["cycle"]:
        node_id = d["cycle"][0]
    if not isinstance(node_id, str) or node_id not in where_of:
        return refuse(("nodes",), "nodes", exc.message, exc)
    i = where_of[node_id]
    if exc.code == "duplicate_node":
        i = [j for j, n in enumerate(nodes) if isinstance(n, dict) and n.get("id") == node_id][-1]
        return refuse(("nodes", i, "id"), "id", exc.message, exc)
    if exc.code in ("unknown_dependency", "cycle"):
        dep = d.get("dependency") or (
            d["cycle"][1] if exc.code == "cycle" and len(d.get("cycle", [])) > 1 else None
        )
        raw = nodes[i]
        for f in ("needs", "inputs"):
            items = raw.get(f, []) if isinstance(raw, dict) else []
            for j, item in enumerate(items if isinstance(items, list) else [items]):
                target = (
                    item
                    if isinstance(item, str)
                    else (item.get("ref") or item.get("pending"))
                    if isinstance(item, dict)
                    else None
                )
                if target == dep:
                    return refuse(("nodes", i, f, j), f, exc.message, exc)
        return refuse(("nodes", i), "needs", exc.message, exc)
    if exc.code in ("invalid_effects", "overlap_forbidden"):
        return refuse(("nodes", i, "writes"), "writes", exc.message, exc)
    return refuse(("nodes", i), "id", exc.message, exc)
