"""The review page's reads (``smthrs_plugin.serve._review``) on a real runtime, SQLite and PostgreSQL: which plan
cards and node requests are pending, one card drawn for a reviewer (nodes, edges, envelope) and what changed since
the last approved card of the same plan. Real plans are planned, approved and run through the control plane and
its scheduler; the reads are checked to write nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import smthrs_plugin as sp
from smthrs_plugin.cli.control_support import PlanLauncher
from smthrs_plugin.control.authority import NodeTarget
from smthrs_plugin.control.facade import Control
from smthrs_plugin.control.receipts import Accepted, Parked
from smthrs_plugin.errors import ControlError
from smthrs_plugin.plan import Plan, compile_plan, node
from smthrs_plugin.runtime import Runtime, open_runtime
from smthrs_plugin.scheduler.planfile import PlanFileExecutor
from smthrs_plugin.serve._review import card_view, pending_items

ENV = {"capabilities": ["deploy:prod"]}


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.txt").write_text("release 1.4.0\n")
    return root


@pytest.fixture
def rt(ws: Path, db_url: str, tmp_path: Path) -> Iterator[Runtime]:
    with open_runtime(
        workspace=ws, db=db_url, artifacts=str(tmp_path / "artifacts"), host_id="review-host"
    ) as r:
        yield r


@pytest.fixture
def control(rt: Runtime) -> Control:
    return rt.control()


def pipeline(
    deploy: str = "mkdir -p deployed && cp dist/app.txt deployed/app.txt", extra: bool = False
) -> Plan:
    nodes = [
        node("build", body={"run": "mkdir -p dist && cp src/app.txt dist/app.txt"},
             reads=["src/app.txt"], writes=["dist/"]),
        node("test", body={"run": "grep -q release dist/app.txt"}, reads=["dist/app.txt"],
             inputs=[sp.plan.Pending("build")]),
        node("deploy", body={"run": deploy}, reads=["dist/app.txt"], writes=["deployed/"], tier="irreversible",
             inputs=[sp.plan.Pending("test")], approval={"request": "ship", "envelope": ENV}),
    ]  # fmt: skip
    if extra:
        nodes.append(node("notify", body={"call": "mypkg.hooks:notify", "with": {"channel": "#ops"}},
                          inputs=[sp.plan.Pending("deploy")]))  # fmt: skip
    return compile_plan("release", "ci/release", nodes)


def table_counts(rt: Runtime) -> dict[str, int]:
    names = ("journal_events", "control_plans", "control_tokens", "control_decisions", "control_grants",
             "control_receipts", "runs", "attempts")  # fmt: skip
    return {
        t: int(rt.db.read(lambda c, t=t: c.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one()))
        for t in names
    }


def test_a_gated_undecided_card_is_pending_and_leaves_the_list_once_decided(control: Control) -> None:
    gated = control.plan(pipeline(), envelope=ENV, approval=True)
    ungated = control.plan(compile_plan("lint", "ci/lint", [node("lint", body={"run": "true"})]))
    pending = pending_items(control)
    assert pending["requests"] == []
    assert pending["plans"] == [
        {
            "plan_id": gated.plan_id,
            "flow": "ci/release",
            "digest": gated.digest,
            "envelope": {"capabilities": ["deploy:prod"], "flows": [], "budget": {}},
            "approval": {"required": True, "state": "pending"},
            "nodes": 3,
        }
    ]
    assert ungated.plan_id not in [p["plan_id"] for p in pending["plans"]]
    control.approve(gated.approval)
    assert pending_items(control)["plans"] == []
    assert card_view(control, gated.plan_id)["approval"]["state"] == "approved"
    assert card_view(control, ungated.plan_id)["approval"] == {"required": False, "state": "not-required"}


def test_cards_are_found_among_many_journal_partitions(rt: Runtime, control: Control) -> None:
    early = control.plan(pipeline(), envelope=ENV, approval=True)
    for i in range(600):  # more partitions than one discovery page, on both sides of the plan partitions
        rt.journal.append(f"{'a' if i % 2 else 'z'}-run-{i:03d}", "test-filler", {})
    late = control.plan(pipeline(extra=True), envelope=ENV, approval=True)
    assert [p["plan_id"] for p in pending_items(control)["plans"]] == [early.plan_id, late.plan_id]


def test_a_denied_card_is_not_pending(control: Control) -> None:
    card = control.plan(pipeline(), envelope=ENV, approval=True)
    control.deny(card.approval)
    assert pending_items(control)["plans"] == []
    assert card_view(control, card.plan_id)["approval"]["state"] == "denied"


def test_card_view_draws_the_stored_graph_with_each_nodes_action_tier_and_effects(control: Control) -> None:
    card = control.plan(pipeline(extra=True), envelope=ENV, approval=True)
    view = card_view(control, card.plan_id)
    assert (view["plan_id"], view["flow"], view["digest"]) == (card.plan_id, "ci/release", card.digest)
    assert view["plan_key"] == card.plan_digest and view["plan_key"].startswith(
        "key1_"
    )  # a key1_ value: `key`
    assert view["envelope"]["capabilities"] == ["deploy:prod"]
    assert view["previous"] is None
    nodes = {n["id"]: n for n in view["nodes"]}
    assert list(nodes) == ["build", "test", "deploy", "notify"]
    assert nodes["build"]["run"] == "mkdir -p dist && cp src/app.txt dist/app.txt"
    assert (nodes["build"]["reads"], nodes["build"]["writes"]) == (["src/app.txt"], ["dist/"])
    assert nodes["deploy"]["tier"] == "irreversible" and nodes["build"]["tier"] == "sealed"
    assert nodes["deploy"]["approval"] == {"request": "ship", "envelope": ENV}
    assert nodes["deploy"]["needs"] == ["test"]
    assert nodes["notify"]["call"] == "mypkg.hooks:notify" and nodes["notify"]["with"] == {"channel": "#ops"}
    assert "run" not in nodes["notify"]
    assert view["edges"] == [["build", "test"], ["test", "deploy"], ["deploy", "notify"]]


def test_previous_is_the_last_approved_card_of_the_same_plan_with_what_changed(control: Control) -> None:
    first = control.plan(pipeline(), envelope=ENV, approval=True)
    control.approve(first.approval)
    denied = control.plan(pipeline(deploy="rm -rf deployed"), envelope=ENV, approval=True)
    control.deny(denied.approval)
    changed = control.plan(
        pipeline(deploy="rsync -a dist/ prod:/srv/app/", extra=True),
        envelope={"capabilities": ["deploy:prod", "notify:ops"]},
        approval=True,
    )
    previous = card_view(control, changed.plan_id)["previous"]
    assert previous is not None
    # The denied card is not what was last approved: the comparison is with `first`.
    assert (previous["plan_id"], previous["digest"]) == (first.plan_id, first.digest)
    changes = previous["changes"]
    assert (changes["added"], changes["removed"]) == (["notify"], [])
    [deploy] = changes["changed"]
    assert {k: v for k, v in deploy.items() if k != "key"} == {
        "id": "deploy",
        "fields": ["run"],
        "values": {
            "run": {
                "old": "mkdir -p deployed && cp dist/app.txt deployed/app.txt",
                "new": "rsync -a dist/ prod:/srv/app/",
            }
        },
        "because": [],
        "cause": "declaration",
    }
    assert changes["envelope"] == {
        "old": {"capabilities": ["deploy:prod"], "flows": [], "budget": {}},
        "new": {"capabilities": ["deploy:prod", "notify:ops"], "flows": [], "budget": {}},
    }
    # Who approved the card compared with.
    assert (
        previous["approval"]["state"] == "approved" and previous["approval"]["principal"] == "local/operator"
    )
    # Another plan's approved cards are never "previous".
    assert card_view(control, first.plan_id)["previous"] is None


def test_a_node_request_of_a_parked_run_is_pending_with_its_node_until_decided(
    rt: Runtime, control: Control
) -> None:
    card = control.plan(pipeline(), envelope=ENV, approval=True)
    assert control.run(card, idempotency_key="k") == Parked(card.plan_id)
    control.approve(card.approval)
    receipt = control.run(card, idempotency_key="k", launcher=PlanLauncher(rt, {}))
    assert isinstance(receipt, Accepted) and receipt.run_id is not None
    [request] = pending_items(control)["requests"]
    asked = control.show(receipt.run_id).pending[0]
    assert {k: v for k, v in request.items() if k != "requested_at_ms"} == {
        "run_id": receipt.run_id,
        "plan_id": card.plan_id,
        "request": "ship",
        "node": "deploy",
        "key": asked.digest,  # the gated node's key1_ plan key
        "envelope": {"capabilities": ["deploy:prod"], "flows": [], "budget": {}},
        "approvers": ["local/operator (scopes once, remembered, run)"],
    }
    assert type(request["requested_at_ms"]) is int and asked.digest.startswith("key1_")
    control.approve(NodeTarget(receipt.run_id, "ship", asked.digest, asked.envelope))
    assert pending_items(control)["requests"] == []


def test_a_request_of_a_run_the_control_plane_did_not_admit_has_no_plan_card(
    rt: Runtime, control: Control
) -> None:
    with pytest.raises(sp.RunParked):
        rt.scheduler("direct-1").run(pipeline(), PlanFileExecutor())
    [request] = pending_items(control)["requests"]
    assert (request["run_id"], request["request"], request["plan_id"], request["node"]) == (
        "direct-1",
        "ship",
        None,
        None,
    )


def test_the_reads_write_nothing(rt: Runtime, control: Control) -> None:
    first = control.plan(pipeline(), envelope=ENV, approval=True)
    control.approve(first.approval)
    second = control.plan(pipeline(extra=True), envelope=ENV, approval=True)
    before = table_counts(rt)
    pending_items(control)
    card_view(control, second.plan_id)
    assert table_counts(rt) == before


def test_an_unknown_card_is_refused_with_plan_not_found(control: Control) -> None:
    for ident in ("nope-000000000000", "", None):
        with pytest.raises(ControlError) as info:
            card_view(control, ident)  # type: ignore[arg-type]
        assert info.value.code == "plan_not_found"


def test_hostile_ids_and_commands_come_back_as_the_same_plain_strings(control: Control) -> None:
    hostile = "<script>window.__pwned=1</script>"
    plan = compile_plan(
        hostile,
        "ci/<img src=x onerror=window.__pwned=2>",
        [node("<b>n</b>", body={"run": "echo '<img src=x onerror=window.__pwned=3>'"})],
    )
    card = control.plan(plan, approval=True)
    [summary] = pending_items(control)["plans"]
    assert summary["plan_id"] == card.plan_id and summary["plan_id"].startswith(hostile)
    view: dict[str, Any] = card_view(control, card.plan_id)
    assert view["flow"] == "ci/<img src=x onerror=window.__pwned=2>"
    assert view["nodes"][0]["id"] == "<b>n</b>"
    assert view["nodes"][0]["run"] == "echo '<img src=x onerror=window.__pwned=3>'"
