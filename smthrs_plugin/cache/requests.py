"""Building a :class:`DispatchRequest` for a plan node: measure its declared reads, key it, record its components.

The key is ``plan.keys.dispatch_key`` (sealed) or ``plan.keys.run_local_key`` (non-sealed) — this module only
measures and assembles; it never invents a key of its own. ``components`` is the breakdown ``smthrs cache
explain`` diffs against the previous entry of the same subject: the material body, each input (a literal value or
the projected Ref value), the environment, and the hermetic member (measured read digests, write set, removals,
boundary mode).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..boundary.boundary import Declaration
from ..boundary.measure import ABSENT as ABSENT_FILE
from ..boundary.measure import Measurer
from ..plan.keys import (
    ABSENT,
    ORDERING_ONLY,
    dispatch_key,
    effects_json,
    material_body,
    plan_key,
    run_local_key,
)
from ..plan.model import Literal, NodeDraft, Pending
from .model import DispatchRequest, SandboxMode, SettleHook

__all__ = ["declaration_of", "node_request"]


def declaration_of(draft: NodeDraft) -> Declaration:
    """The boundary declaration of a node's effects."""
    e = draft.effects
    return Declaration(e.reads, e.writes, tuple(e.removes), e.boundary_mode)  # type: ignore[arg-type]


def _inputs(draft: NodeDraft, ref_values: Mapping[int, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, inp in enumerate(draft.material.inputs):
        if isinstance(inp, Literal):
            out[str(i)] = {"literal": inp.value}
        elif isinstance(inp, Pending):
            out[str(i)] = {"ordering": ORDERING_ONLY}
        else:
            v = ref_values.get(i, ABSENT)
            out[str(i)] = {"ref": inp.from_, "path": list(inp.path)} | ({} if v is ABSENT else {"value": v})
    return out


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
    sandbox: SandboxMode = "hermetic",
    on_settled: SettleHook | None = None,
    owner: Any = None,
    consult_shared: bool = True,
    publish_shared: bool = True,
) -> DispatchRequest:
    """Measure ``draft``'s declared reads on ``workspace`` and build its request.

    Sealed nodes get the content dispatch key; compensable/irreversible nodes the run-local key, which needs the
    node's plan key (``upstream_plan_keys`` = plan keys of its dependencies) and ``plan_id``. The subject is
    ``"<plan_id>/<node_id>"`` (just the node id without a plan id)."""
    refs = dict(ref_values or {})
    decl = declaration_of(draft)
    measured = measurer.measure_entries(decl.reads)
    reads = tuple((p, s.digest if s is not None else ABSENT_FILE) for p, s in measured.items())
    if draft.material.tier == "sealed":
        k = dispatch_key(draft, ref_values=refs, read_set=reads, environment=environment)
    else:
        k = run_local_key(plan_id or "-", draft.id, plan_key(draft, upstream_plan_keys or {}), run_id)
    effects = effects_json(draft.effects)
    components: dict[str, Any] = {
        "body": material_body(draft),
        "inputs": _inputs(draft, refs),
        "hermetic": {
            "readSet": [{"path": p, "digest": d} for p, d in reads],
            "writeSet": effects["writes"],
            "removes": effects["removes"],
            "boundaryMode": effects["boundaryMode"],
        },
    }
    if environment is not ABSENT:
        components["environment"] = environment
    return DispatchRequest(
        run_id=run_id,
        node_id=draft.id,
        attempt=attempt,
        key=k,
        components=components,
        tier=draft.material.tier,
        declaration=decl,
        reads=reads,
        workspace=Path(workspace),
        sandbox=sandbox,
        nondeterministic=bool(draft.material.nondeterministic),
        consult_shared=consult_shared,
        publish_shared=publish_shared,
        on_settled=on_settled,
        owner=owner,
        subject=f"{plan_id}/{draft.id}" if plan_id else draft.id,
    )
