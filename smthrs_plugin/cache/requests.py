"""The one builder of the cache seam's :class:`DispatchRequest`, for plan nodes and ``@step`` calls alike.

:func:`build_request` assembles every request: the scheduler (``scheduler/_session.py``) for each plan node it
prepares, ``@step`` (``prefect/step.py``) for each call, through :func:`node_request` when the caller has no pinned
observations and measures the declared reads now (:func:`measure_reads`).

- The tier picks the key kind here and nowhere else: sealed → the content key (``plan.keys.dispatch_key``);
  compensable, irreversible or timer → the run-local key (``plan.keys.run_local_key``). This module never invents,
  weakens or post-processes a key.
- Only a content-keyed request consults or publishes the shared tier (unless the caller narrows that further).
- ``components`` (for ``smthrs cache explain``) always has the same five members, whoever calls (docs/rules.md,
  "The request a dispatch is keyed by").
- Measuring is the caller's; the request carries exactly the read pairs its key folded, in the caller's order
  (sorted by path), for the seam to re-measure before serving a hit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from ..boundary.boundary import Declaration
from ..boundary.measure import ABSENT as ABSENT_FILE
from ..boundary.measure import Measurer
from ..errors import CanonicalError, SchedulerError
from ..plan.keys import (
    ABSENT,
    ORDERING_ONLY,
    dispatch_key,
    effects_json,
    input_value_digest,
    material_body,
    plan_key,
    run_local_key,
)
from ..plan.model import NodeDraft, Pending, Value
from .model import DispatchRequest, SandboxMode, SettleHook

__all__ = ["build_request", "content_keyed", "declaration_of", "measure_reads", "node_request"]

#: The plan id of a run-local key whose node belongs to no plan (a ``@step`` call).
NO_PLAN = "-"


def declaration_of(draft: NodeDraft) -> Declaration:
    """The boundary declaration of a node's effects."""
    e = draft.effects
    return Declaration(e.reads, e.writes, tuple(e.removes), e.boundary_mode)  # type: ignore[arg-type]


def content_keyed(draft: NodeDraft) -> bool:
    """Whether ``draft`` gets the content dispatch key (sealed, and not a ``wait:`` timer) rather than the
    run-local ordinal key."""
    return draft.material.tier == "sealed" and draft.wait is None


def measure_reads(measurer: Measurer, declaration: Declaration) -> tuple[tuple[str, str], ...]:
    """Measure every declared read now: ``((path, digest), ...)`` sorted by path, ``"absent"`` for a declared exact
    path that does not exist. ``BoundaryError`` when the workspace cannot be measured. No declared read: nothing
    to measure, so the workspace is not touched (a hit pays no system call for it)."""
    if not declaration.reads:
        return ()
    measured = measurer.measure_entries(declaration.reads)
    return tuple((p, s.digest if s is not None else ABSENT_FILE) for p, s in measured.items())


def _uncomputable(draft: NodeDraft, why: str, cause: BaseException) -> SchedulerError:
    return SchedulerError(
        "key_uncomputable",
        f"dispatch key of node {draft.id!r} cannot be computed: {why}",
        cause=cause,
        node=draft.id,
    )


def _inputs(
    draft: NodeDraft,
    ref_values: Mapping[int, Any],
    memo: Mapping[tuple[str, tuple[str, ...]], str] | None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, inp in enumerate(draft.material.inputs):
        if isinstance(inp, Value):
            out[str(i)] = {"literal": inp.value}
        elif isinstance(inp, Pending):
            out[str(i)] = {"ordering": ORDERING_ONLY}
        else:
            ref: dict[str, Any] = {"ref": inp.from_, "path": list(inp.path)}
            if (
                i in ref_values
            ):  # a run-local node may be keyed without its Ref values: nothing to record then
                # A content key already put this digest in the run's memo; a run-local node computes it here.
                digest = memo.get((inp.from_, inp.path)) if memo is not None else None
                if digest is None:
                    try:
                        digest = input_value_digest(ref_values[i])
                    except CanonicalError as exc:
                        raise _uncomputable(draft, f"Ref input #{i} value: {exc.message}", exc) from exc
                ref["digest"] = digest
            out[str(i)] = ref
    return out


def build_request(
    draft: NodeDraft,
    *,
    run_id: str,
    workspace: str | Path,
    reads: Iterable[tuple[str, str]],
    declaration: Declaration | None = None,
    ref_values: Mapping[int, Any] | None = None,
    environment: Any = ABSENT,
    plan_id: str = "",
    node_key: str | None = None,
    attempt: int = 1,
    memo: MutableMapping[tuple[str, tuple[str, ...]], str] | None = None,
    subject: str | None = None,
    sandbox: SandboxMode = "hermetic",
    on_settled: SettleHook | None = None,
    owner: Any = None,
    consult_shared: bool | None = None,
    publish_shared: bool | None = None,
) -> DispatchRequest:
    """The request of one attempt of ``draft``: its key (kind picked by the tier, see the module invariants) and its
    ``components`` in the one shape ``smthrs cache explain`` reads.

    ``reads``: the measured ``(path, digest)`` pairs the key folds. ``declaration``: the boundary declaration
    (default :func:`declaration_of` the draft). ``ref_values``: the projected value of each Ref input by index
    (``plan.keys.resolve_refs``). ``environment``: plain JSON, or ``ABSENT`` for none (its own identity).
    ``plan_id``/``node_key``: the node's plan and plan key, for the run-local key (defaults: ``"-"`` and the plan
    key of the draft alone — right for a node without upstream, such as a ``@step``). ``memo``: the run's Ref
    digest memo (``dispatch_key``'s). ``subject``: what explain compares entries of (default
    ``"<plan_id>/<node id>"``, or the node id without a plan id). ``consult_shared``/``publish_shared``: default
    whether the request is content-keyed. ``SchedulerError(key_uncomputable)`` when the key cannot be computed."""
    refs = dict(ref_values or {})
    measured = tuple(reads)
    effects = effects_json(draft.effects)
    shared = content_keyed(draft)
    key_member: dict[str, Any]
    if shared:
        key = dispatch_key(draft, ref_values=refs, read_set=measured, environment=environment, memo=memo)
        key_member = {"kind": "content"}
    else:
        ordinal_plan = plan_id or NO_PLAN
        pk = node_key if node_key is not None else plan_key(draft, {})
        key = run_local_key(ordinal_plan, draft.id, pk, run_id)
        key_member = {
            "kind": "run-local",
            "ordinal": ["plan-node/v1", ordinal_plan, draft.id, pk],
            "runId": run_id,
        }
    components: dict[str, Any] = {
        "key": key_member,
        "body": material_body(draft),
        "inputs": _inputs(draft, refs, memo),
        "hermetic": {
            "readSet": [{"path": p, "digest": d} for p, d in measured],
            "writeSet": effects["writes"],
            "removes": effects.get("removes", []),  # the digest's effects omit an empty removal set
            "boundaryMode": effects["boundaryMode"],
        },
        "environment": {"omitted": True} if environment is ABSENT else environment,
    }
    return DispatchRequest(
        run_id=run_id,
        node_id=draft.id,
        attempt=attempt,
        key=key,
        components=components,
        tier=draft.material.tier,
        declaration=declaration if declaration is not None else declaration_of(draft),
        reads=measured,
        # Path(path) parses the path again: a scheduler passes the same Path for every node of its run.
        workspace=workspace if isinstance(workspace, Path) else Path(workspace),
        sandbox=sandbox,
        nondeterministic=bool(draft.material.nondeterministic),
        consult_shared=shared if consult_shared is None else consult_shared,
        publish_shared=shared if publish_shared is None else publish_shared,
        on_settled=on_settled,
        owner=owner,
        subject=subject if subject is not None else (f"{plan_id}/{draft.id}" if plan_id else draft.id),
    )


def node_request(
    draft: NodeDraft,
    *,
    run_id: str,
    workspace: str | Path,
    measurer: Measurer,
    plan_id: str = "",
    ref_values: Mapping[int, Any] | None = None,
    environment: Any = ABSENT,
    attempt: int = 1,
    upstream_plan_keys: Mapping[str, str] | None = None,
    subject: str | None = None,
    sandbox: SandboxMode = "hermetic",
    on_settled: SettleHook | None = None,
    owner: Any = None,
    consult_shared: bool | None = None,
    publish_shared: bool | None = None,
) -> DispatchRequest:
    """Measure ``draft``'s declared reads on ``workspace`` now and :func:`build_request` it — for callers with no
    pinned observations (``@step``, tests, the direct use of the seam in docs/explanation/cache.md).

    ``upstream_plan_keys``: the plan keys of its dependencies, for the run-local key of a non-sealed node with
    upstream inputs. Other arguments as :func:`build_request`."""
    decl = declaration_of(draft)
    return build_request(
        draft,
        run_id=run_id,
        workspace=workspace,
        reads=measure_reads(measurer, decl),
        declaration=decl,
        ref_values=ref_values,
        environment=environment,
        plan_id=plan_id,
        node_key=plan_key(draft, upstream_plan_keys) if upstream_plan_keys else None,
        attempt=attempt,
        subject=subject,
        sandbox=sandbox,
        on_settled=on_settled,
        owner=owner,
        consult_shared=consult_shared,
        publish_shared=publish_shared,
    )
