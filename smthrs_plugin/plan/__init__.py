"""Plans, PURE (no I/O): declarations, path entries, keys, compile/append/verify, runtime graph, admission.

The public namespace ``sp.plan`` (``__all__``): declare nodes (:func:`node`, inputs :class:`Ref`, :class:`Pending`
and :class:`Value`, paths :class:`Glob`, :class:`TreeArtifact`, :class:`Filegroup`), compile them
(:func:`compile_plan`, :func:`append_plan`, :func:`verify_plan`) into a :class:`Plan` of :class:`PlanNode`
(with their :class:`WriteConflict` annotations), and follow its outcomes (:class:`RuntimeGraph`). A plan is run
by a runtime: ``rt.scheduler(run_id).run(plan, executor)``; a plan FILE is loaded by ``sp.load_plan`` (it needs
the scheduler's executor, a floor above this pure one).

Import order is one-way: fileset → model → keys → compile; graph and admission sit beside compile and only
read compiled nodes. Nothing here touches a database, a file or the network.
"""

from __future__ import annotations

from .admission import Concurrency
from .compile import append_plan, compile_plan, verify_plan
from .fileset import Filegroup, Glob, TreeArtifact
from .graph import RuntimeGraph
from .keys import ABSENT
from .model import Input, NodeDraft, Pending, Plan, PlanNode, Ref, Value, WriteConflict, node

# A constant input is a `Value` (`Literal` would shadow typing.Literal) and a compiled node's overlap annotation a
# `WriteConflict` (`Conflict` is the control plane's receipt): one name per concept across the public namespaces.
__all__ = [
    "ABSENT",
    "Concurrency",
    "Filegroup",
    "Glob",
    "Input",
    "NodeDraft",
    "Pending",
    "Plan",
    "PlanNode",
    "Ref",
    "RuntimeGraph",
    "TreeArtifact",
    "Value",
    "WriteConflict",
    "append_plan",
    "compile_plan",
    "node",
    "verify_plan",
]
