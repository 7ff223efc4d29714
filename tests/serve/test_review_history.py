"""The review page's diffs and decision history (``serve._review``: ``review.card``'s ``previous``/``decision``,
``review.history``) on a real runtime: old → new values of every changed declaration, nodes re-keyed by an
upstream change, who decided a card or a node request (when, scope, digest, receipt), what the CI job does next,
and the Prefect flow-run link."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import smthrs_plugin as sp
from smthrs_plugin.cli.control_support import PlanLauncher
from smthrs_plugin.control.authority import NodeTarget
from smthrs_plugin.control.facade import Control
from smthrs_plugin.control.receipts import Accepted
from smthrs_plugin.errors import ControlError
from smthrs_plugin.plan import Plan, compile_plan, node
from smthrs_plugin.runtime import Runtime, open_runtime
from smthrs_plugin.serve._review import _changed, _node_json, card_view, history_view, prefect_ui_url

ENV = {"capabilities": ["deploy:prod"]}
FLOW_RUN = "0b4f3a52-6c1e-4c36-9d6e-3f2b8c1d9e70"


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.txt").write_text("release 1.4.0\n")
    return root


@pytest.fixture
def rt(ws: Path, db_url: str, tmp_path: Path) -> Iterator[Runtime]:
    with open_runtime(
        workspace=ws, db=db_url, artifacts=str(tmp_path / "artifacts"), host_id="hist-host"
    ) as r:
        yield r


@pytest.fixture
def control(rt: Runtime) -> Control:
    return rt.control()


def pipeline(build: str = "mkdir -p dist && cp src/app.txt dist/app.txt", **deploy: Any) -> Plan:
    return compile_plan(
        "release",
        "ci/release",
        [
            node("build", body={"run": build}, reads=["src/app.txt"], writes=["dist/"]),
            node("test", body={"run": "grep -q release dist/app.txt"}, reads=["dist/app.txt"],
                 inputs=[sp.plan.Pending("build")]),
            node("deploy", **{"body": {"run": "mkdir -p deployed && cp dist/app.txt deployed/app.txt"},
                              "reads": ["dist/app.txt"], "writes": ["deployed/"], "tier": "irreversible",
                              "inputs": [sp.plan.Pending("test")],
                              "approval": {"request": "ship", "envelope": ENV}, **deploy}),
        ],
    )  # fmt: skip


def parked_run(rt: Runtime, control: Control) -> tuple[Any, str]:
    card = control.plan(pipeline(), envelope=ENV, approval=True)
    control.approve(card.approval)
    receipt = control.run(card, idempotency_key="ci-key", launcher=PlanLauncher(rt, {}))
    assert isinstance(receipt, Accepted) and receipt.run_id is not None
    assert control.show(receipt.run_id).waiting_approval
    return card, receipt.run_id


# -- what changed ---------------------------------------------------------------------------------------------------


def test_only_build_changed_so_test_and_deploy_are_rekeyed_because_build_changed(control: Control) -> None:
    first = control.plan(pipeline(), envelope=ENV, approval=True)
    control.approve(first.approval)
    second = control.plan(pipeline(build="make dist"), envelope=ENV, approval=True)
    changes = card_view(control, second.plan_id)["previous"]["changes"]
    by_id = {c["id"]: c for c in changes["changed"]}
    assert list(by_id) == ["build", "test", "deploy"]
    build = by_id["build"]
    assert build["cause"] == "declaration" and build["fields"] == ["run"]
    assert build["values"] == {
        "run": {"old": "mkdir -p dist && cp src/app.txt dist/app.txt", "new": "make dist"}
    }
    for rekeyed in ("test", "deploy"):
        entry = by_id[rekeyed]
        assert (entry["cause"], entry["fields"], entry["values"], entry["because"]) == (
            "upstream",
            [],
            {},
            ["build"],
        )
        assert entry["key"]["old"] != entry["key"]["new"]
    assert changes["envelope"] is None and changes["added"] == [] and changes["removed"] == []


def test_every_changed_declaration_shows_its_old_and_new_value(control: Control) -> None:
    first = control.plan(pipeline(), envelope=ENV, approval=True)
    control.approve(first.approval)
    second = control.plan(
        pipeline(
            body={"call": "ops.deploy:ship", "with": {"target": "prod"}},
            reads=["dist/app.txt", "deploy.cfg"],
            writes=["deployed/", "audit.log"],
            removes=["stale/"],
            tier="compensable",
            approval={"request": "ship", "envelope": {"capabilities": ["deploy:prod", "db:migrate"]}},
        ),
        envelope={"capabilities": ["deploy:prod", "db:migrate"]},
        approval=True,
    )
    previous = card_view(control, second.plan_id)["previous"]
    [deploy] = previous["changes"]["changed"]
    values = deploy["values"]
    assert deploy["fields"] == ["run", "call", "with", "tier", "reads", "writes", "removes", "approval"]
    assert values["run"] == {"old": "mkdir -p deployed && cp dist/app.txt deployed/app.txt"}  # gone: no "new"
    assert values["call"] == {"new": "ops.deploy:ship"} and values["with"] == {"new": {"target": "prod"}}
    assert values["tier"] == {"old": "irreversible", "new": "compensable"}
    assert values["reads"] == {"old": ["dist/app.txt"], "new": ["dist/app.txt", "deploy.cfg"]}
    assert values["writes"] == {"old": ["deployed/"], "new": ["deployed/", "audit.log"]}
    assert values["removes"] == {"old": [], "new": ["stale/"]}
    assert values["approval"]["new"]["envelope"]["capabilities"] == ["deploy:prod", "db:migrate"]
    assert previous["changes"]["envelope"]["new"]["capabilities"] == ["deploy:prod", "db:migrate"]


def test_a_key_change_nothing_visible_explains_is_still_shown_as_the_key_change(control: Control) -> None:
    plan = pipeline()
    after = {n["id"]: n for n in (_node_json(p) for p in plan.nodes)}
    before = {nid: dict(n) for nid, n in after.items()}
    before["test"]["key"] = "key1_" + "0" * 64  # the same declaration under another key
    changed = _changed(plan, before, after)
    by_id = {c["id"]: c for c in changed}
    assert by_id["test"]["cause"] == "unexplained" and by_id["test"]["fields"] == []
    assert by_id["test"]["key"] == {"old": "key1_" + "0" * 64, "new": after["test"]["key"]}
    assert "deploy" not in by_id  # its own key did not change


# -- decisions -------------------------------------------------------------------------------------------------------


def test_a_plan_approval_is_in_the_history_with_who_when_scope_digest_and_its_receipt(
    control: Control,
) -> None:
    card = control.plan(pipeline(), envelope=ENV, approval=True)
    pending = history_view(control, card.plan_id)
    assert pending["decision"]["state"] == "pending" and pending["next"]["state"] == "waiting"
    receipt = control.approve(card.approval, scope="once")
    assert isinstance(receipt, Accepted)
    history = history_view(control, card.plan_id)
    assert type(history["planned_at_ms"]) is int
    decision = history["decision"]
    assert {k: decision[k] for k in ("kind", "state", "principal", "scope", "digest", "receipt")} == {
        "kind": "Plan",
        "state": "approved",
        "principal": "local/operator",
        "scope": "once",
        "digest": card.digest,
        "receipt": receipt.receipt_id,
    }
    assert type(decision["decided_at_ms"]) is int and type(decision["requested_at_ms"]) is int
    assert "decided_at" not in decision and decision["envelope"]["capabilities"] == ["deploy:prod"]
    assert card_view(control, card.plan_id)["decision"] == decision
    assert history["next"]["state"] == "retry"
    assert history["next"]["command"] == f"smthrs run {card.plan_id} --key KEY"


def test_a_decision_under_the_callers_own_key_names_no_guessed_receipt(control: Control) -> None:
    card = control.plan(pipeline(), envelope=ENV, approval=True)
    control.deny(card.approval, idempotency_key="my-own-key")
    history = history_view(control, card.plan_id)
    assert history["decision"]["state"] == "denied" and "receipt" not in history["decision"]
    assert history["next"]["state"] == "stopped" and "command" not in history["next"]


def test_a_node_decision_is_in_the_runs_history_and_the_next_step_is_the_resume_command(
    rt: Runtime, control: Control
) -> None:
    card, run_id = parked_run(rt, control)
    before = history_view(control, run_id)
    assert (before["kind"], before["status"], before["waiting_reason"], before["plan_id"]) == (
        "run",
        "parked",
        "approval",
        card.plan_id,
    )
    assert type(before["admitted_at_ms"]) is int
    assert before["plan_decision"]["state"] == "approved" and before["plan_decision"]["receipt"]
    assert [d["state"] for d in before["decisions"]] == ["pending"]
    assert before["next"]["state"] == "waiting" and before["prefect"] is None

    asked = control.show(run_id).pending[0]
    receipt = control.approve(NodeTarget(run_id, "ship", asked.digest, asked.envelope))
    assert isinstance(receipt, Accepted)
    after = history_view(control, run_id)
    [decision] = after["decisions"]
    assert {
        k: decision[k] for k in ("kind", "state", "request", "run_id", "principal", "scope", "receipt")
    } == {
        "kind": "Node",
        "state": "approved",
        "request": "ship",
        "run_id": run_id,
        "principal": "local/operator",
        "scope": "run",
        "receipt": receipt.receipt_id,
    }
    assert decision["key"] == asked.digest and "digest" not in decision  # the node's key1_ plan key
    assert after["next"]["state"] == "retry"
    assert after["next"]["command"] == f"smthrs resume {run_id} --key KEY"
    assert f"smthrs run {card.plan_id} --key KEY" in after["next"]["text"]
    # The command works as shown: the run completes.
    assert control.resume(run_id, idempotency_key="KEY", launcher=PlanLauncher(rt, {})).type == "Accepted"
    done = history_view(control, run_id)
    assert (
        done["status"] == "completed" and done["waiting_reason"] is None and done["next"]["state"] == "done"
    )


def test_a_run_parked_in_a_prefect_deployment_is_woken_and_links_its_flow_run(
    rt: Runtime, control: Control, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, run_id = parked_run(rt, control)
    # What the Prefect integration journals when a deployment's flow run binds the run.
    rt.journal.append(
        run_id, "prefect-flow-run", {"flow_run_id": FLOW_RUN, "flow": "ci/release", "parameters": {},
                                     "deployment_id": "dep-1"},
    )  # fmt: skip
    monkeypatch.delenv("PREFECT_UI_URL", raising=False)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    asked = control.show(run_id).pending[0]
    control.approve(NodeTarget(run_id, "ship", asked.digest, asked.envelope))
    history = history_view(control, run_id)
    assert history["prefect"] == {
        "flow_run_id": FLOW_RUN,
        "deployment_id": "dep-1",
        "url": f"http://127.0.0.1:4200/runs/flow-run/{FLOW_RUN}",
    }
    assert history["next"]["state"] == "woken" and "command" not in history["next"]
    assert FLOW_RUN in history["next"]["text"]
    monkeypatch.delenv("PREFECT_API_URL")
    assert history_view(control, run_id)["prefect"]["url"] is None  # no UI known: no link


def test_the_prefect_link_needs_an_http_ui_address_and_a_uuid() -> None:
    assert prefect_ui_url(FLOW_RUN, {"PREFECT_UI_URL": "https://prefect.example/"}) == (
        f"https://prefect.example/runs/flow-run/{FLOW_RUN}"
    )
    assert prefect_ui_url(FLOW_RUN, {"PREFECT_API_URL": "http://h:4200/api/"}) == (
        f"http://h:4200/runs/flow-run/{FLOW_RUN}"
    )
    assert prefect_ui_url(FLOW_RUN, {}) is None
    assert prefect_ui_url(FLOW_RUN, {"PREFECT_API_URL": "http://h:4200/elsewhere"}) is None
    assert prefect_ui_url(FLOW_RUN, {"PREFECT_UI_URL": "javascript:alert(1)//"}) is None
    assert prefect_ui_url("x/../../evil", {"PREFECT_UI_URL": "https://prefect.example"}) is None


def test_a_runs_history_is_bounded_and_counts_what_it_left_out(rt: Runtime, control: Control) -> None:
    _, run_id = parked_run(rt, control)
    history = control.run_history(run_id, limit=0)
    assert (history.decisions, history.omitted) == ((), 1)


def test_hostile_ids_are_shell_quoted_in_the_next_command(control: Control) -> None:
    hostile = "x'; touch /tmp/pwned; echo '"
    card = control.plan(compile_plan(hostile, "ci/x", [node("n", body={"run": "true"})]), approval=True)
    control.approve(card.approval)
    command = history_view(control, card.plan_id)["next"]["command"]
    assert shlex.split(command) == ["smthrs", "run", card.plan_id, "--key", "KEY"]


def test_an_unknown_ident_is_refused_and_history_reads_write_nothing(rt: Runtime, control: Control) -> None:
    _, run_id = parked_run(rt, control)

    def counts() -> list[int]:
        tables = (
            "journal_events",
            "control_plans",
            "control_tokens",
            "control_decisions",
            "control_receipts",
            "runs",
        )
        return [int(rt.db.read(lambda c, t=t: c.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one()))
                for t in tables]  # fmt: skip

    before = counts()
    history_view(control, run_id)
    assert counts() == before
    for ident in ("no-such-thing", ""):
        with pytest.raises(ControlError) as info:
            history_view(control, ident)
        assert info.value.code == "plan_not_found"
