"""Plans, PURE (no I/O): declarations, path entries, keys, compile/append/verify, runtime graph, admission.

Import order is one-way: fileset → model → keys → compile; graph and admission sit beside compile and only
read compiled nodes. Nothing here touches a database, a file or the network.
"""

from __future__ import annotations

from ..errors import GraphError, PlanError
from .admission import Admission, AdmissionWork, Concurrency
from .compile import (
    DEFAULT_MAXIMUM_PLAN_NODES,
    append_plan,
    compile_plan,
    plan_digest,
    priority_json,
    verify_plan,
)
from .fileset import Filegroup, Glob, TreeArtifact
from .graph import OUTCOMES, SUCCESS, GraphWork, NodeState, Outcome, Propagation, RuntimeGraph, Settled
from .keys import (
    ABSENT,
    ORDERING_ONLY,
    dispatch_key,
    effects_json,
    input_value_digest,
    material_body,
    plan_key,
    project,
    resolve_refs,
    run_local_key,
)
from .model import (
    KEY_MATERIAL_VERSION,
    Conflict,
    Effects,
    Input,
    KeyMaterial,
    Literal,
    NodeDraft,
    Pending,
    Plan,
    PlanNode,
    Ref,
    node,
)

__all__ = [
    "ABSENT",
    "Admission",
    "AdmissionWork",
    "Concurrency",
    "Conflict",
    "DEFAULT_MAXIMUM_PLAN_NODES",
    "Effects",
    "Filegroup",
    "Glob",
    "GraphError",
    "GraphWork",
    "Input",
    "KEY_MATERIAL_VERSION",
    "KeyMaterial",
    "Literal",
    "NodeDraft",
    "NodeState",
    "ORDERING_ONLY",
    "OUTCOMES",
    "Outcome",
    "Pending",
    "Plan",
    "PlanError",
    "PlanNode",
    "Propagation",
    "Ref",
    "RuntimeGraph",
    "SUCCESS",
    "Settled",
    "TreeArtifact",
    "append_plan",
    "compile_plan",
    "dispatch_key",
    "effects_json",
    "input_value_digest",
    "material_body",
    "node",
    "plan_digest",
    "plan_key",
    "priority_json",
    "project",
    "resolve_refs",
    "run_local_key",
    "verify_plan",
]
