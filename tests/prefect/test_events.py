"""The ``smthrs.*`` Prefect events an automation can use (catalogue: ``smthrs_plugin/prefect/_events.py``), read back
through the session server's events API: names, resource ids, labels, related resources and payload keys — and
what a flow run's page shows: the Report / parked artifact and the parked state message naming the smthrs run id
and the commands that inspect, approve or cancel it."""

from __future__ import annotations

import inspect
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from _prefect_support import REPO, api_post, events_of, poll
from prefect import flow
from typer.testing import CliRunner

import smthrs_plugin as sp
from smthrs_plugin.cache.maintenance import revoke
from smthrs_plugin.prefect import _events, _flowrun
from smthrs_plugin.prefect.host import artifact_key, run_plan_in_flow
from smthrs_plugin.prefect.steprun import current_spec


@pytest.fixture(autouse=True)
def _bodies_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count body calls in this process's memory, so bodies run in-thread; how a body is isolated
    (a child process) is pinned by the isolation tests."""
    monkeypatch.setenv("SMTHRS_ISOLATION", "thread")


pytestmark = pytest.mark.prefect

#: Deadline for Prefect's asynchronous event pipeline (far above anything a busy 2-core machine needs).
DEADLINE_S = 120.0
#: SMTHRS_SERVE_URL as a team would set it (the emitter never contacts it).
SERVE_URL = "http://127.0.0.1:8765"
#: The documented payload keys of each event (the catalogue's contract).
NODE_KEYS = {"version", "run_id", "plan_id", "node", "attempt", "dispatch_key", "outcome", "cache_decision",
             "conflict", "error", "duration_ms"}  # fmt: skip
STEP_KEYS = {"version", "run_id", "step", "node", "attempt", "dispatch_key", "outcome", "cache_decision", "tier",
             "error", "timings_ms"}  # fmt: skip
REFUSED_KEYS = {"version", "run_id", "subject", "kind", "dispatch_key", "decision", "reason", "outcome"}
PARKED_KEYS = {"version", "run_id", "flow", "reason", "kind", "wait", "deadline", "deadline_ms", "commands",
               "review_url"}  # fmt: skip
REQUESTED_KEYS = {"version", "run_id", "plan_id", "flow", "request", "token_id", "digest", "envelope", "commands",
                  "review_url"}  # fmt: skip

CALLS: dict[str, int] = {}


@sp.step(reads=["in.txt"], writes=["out.txt"])
def shout(ws: sp.Workspace, times: int) -> int:
    CALLS["shout"] = CALLS.get("shout", 0) + 1
    (ws / "out.txt").write_text((ws / "in.txt").read_text().upper() * times)
    return times


@sp.step
def explode(x: int) -> int:
    raise RuntimeError(f"explode({x}) refuses")


@flow(persist_result=False)
def loud(times: int) -> str:
    from prefect.runtime import flow_run

    shout(times)
    with pytest.raises(RuntimeError, match="refuses"):
        explode(1)
    return str(flow_run.id)


@pytest.fixture
def ws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    (tmp_path / "in.txt").write_text("hey")
    monkeypatch.setenv(_events.SERVE_URL_ENV, SERVE_URL)
    monkeypatch.chdir(tmp_path)
    CALLS.clear()
    with sp.step_settings(workspace=tmp_path):
        yield tmp_path


def _about(api: str, prefix: str, resource_id: str) -> list[dict[str, Any]]:
    body = {
        "filter": {
            "event": {"prefix": [prefix]},
            "any_resource": {"id": [resource_id]},
            "occurred": {"since": "2000-01-01T00:00:00Z"},
        },
        "limit": 50,
    }
    events: list[dict[str, Any]] = api_post(api, "/events/filter", body)["events"]
    return events


def _related(event: dict[str, Any]) -> dict[str, str]:
    """role -> resource id of an event's related resources (ours and the ones Prefect adds)."""
    return {r["prefect.resource.role"]: r["prefect.resource.id"] for r in event["related"]}


def _flow_run(api: str, name: str) -> dict[str, Any]:
    (fr,) = api_post(api, "/flow_runs/filter", {"flow_runs": {"name": {"any_": [name]}}})
    return fr  # type: ignore[no-any-return]


def _artifact_markdown(api: str, run_id: str) -> str:
    latest = api_post(
        api, "/artifacts/latest/filter", {"artifacts": {"key": {"any_": [artifact_key(run_id)]}}}
    )
    assert len(latest) == 1, latest
    return str(latest[0]["data"])


def test_step_calls_emit_built_and_failed_events_naming_the_step_the_run_and_the_task_run(
    ws: Path, prefect_api: str
) -> None:
    first = loud(2)
    second = loud(2)
    assert CALLS == {"shout": 1}
    identity = shout.step_spec.identity
    for fr, outcome in ((first, "built"), (second, "clean")):
        # The failed call comes after shout's: once its event is there, shout's would be too.
        events = poll(
            lambda fr=fr: events_of(prefect_api, "smthrs.step.", fr),
            lambda e, outcome=outcome: (
                any(x["event"] == "smthrs.step.failed" for x in e) and (outcome == "clean" or len(e) >= 2)
            ),
            timeout_s=DEADLINE_S,
        )
        mine = [e for e in events if e["resource"]["prefect.resource.id"] == f"smthrs.step.{identity}"]
        if outcome == "clean":
            # A hit's task run ends Cached (Prefect's own record of it): no smthrs.step.clean says it again.
            assert mine == []
            continue
        (ev,) = mine
        run_id = f"prefect-{fr}"
        assert ev["event"] == f"smthrs.step.{outcome}"
        assert ev["resource"] == {
            "prefect.resource.id": f"smthrs.step.{identity}",
            "prefect.resource.name": "shout",
            "smthrs.run-id": run_id,
            "smthrs.step": identity,
            "smthrs.outcome": outcome,
        }
        related = _related(ev)
        assert related["flow-run"] == f"prefect.flow-run.{fr}"
        assert related["smthrs-run"] == f"smthrs.run.{run_id}"
        assert related["task-run"].startswith("prefect.task-run.")
        p = ev["payload"]
        assert set(p) == STEP_KEYS and p["version"] == 1 and p["run_id"] == run_id and p["step"] == identity
        assert (p["outcome"], p["cache_decision"], p["attempt"], p["error"]) == (
            outcome,
            "Miss" if outcome == "built" else "VerifiedHit",
            1,
            None,
        )
        assert p["tier"] == (None if outcome == "built" else "local")
        # A @step flow run has no Report: its page names its smthrs run and the commands once.
        md = _artifact_markdown(prefect_api, run_id)
        assert f"## smthrs run `{run_id}`" in md and f"| inspect | `smthrs show {run_id}` |" in md
        assert f"| cancel | `smthrs cancel {run_id}` |" in md
        failed = [e for e in events if e["event"] == "smthrs.step.failed"]
        assert len(failed) == 1 and "explode(1) refuses" in failed[0]["payload"]["error"]
        assert failed[0]["resource"]["smthrs.outcome"] == "failed"


def test_a_revoked_cache_entry_is_refused_and_emits_cache_refused_naming_the_key_and_the_reason(
    ws: Path, prefect_api: str
) -> None:
    loud(3)
    rt = current_spec().open()
    report = revoke(
        rt.dispatcher.local, rt.dispatcher.shared, shout.step_spec.identity, by="test", reason="bad"
    )
    (key,) = report.keys
    again = loud(3)
    assert CALLS == {"shout": 2}  # the refused entry was not served: the body ran again
    (ev,) = poll(lambda: events_of(prefect_api, "smthrs.cache.refused", again), lambda e: len(e) >= 1,
                 timeout_s=DEADLINE_S)  # fmt: skip
    identity = shout.step_spec.identity
    assert ev["resource"] == {
        "prefect.resource.id": f"smthrs.cache.{key}",
        "prefect.resource.name": identity,
        "smthrs.run-id": f"prefect-{again}",
        "smthrs.subject": identity,
        "smthrs.decision": "UnverifiableEvidence",
    }
    assert _related(ev)["smthrs-step"] == f"smthrs.step.{identity}"
    p = ev["payload"]
    assert set(p) == REFUSED_KEYS
    assert (p["kind"], p["dispatch_key"], p["decision"], p["outcome"]) == (
        "step",
        key,
        "UnverifiableEvidence",
        "built",
    )
    assert "revoked" in p["reason"]


def _write(ni: sp.NodeInput) -> dict:
    (ni.root / f"{ni.id}.txt").write_text(ni.id)
    return {"node": ni.id}


def test_plan_nodes_emit_node_events_and_the_report_artifact_names_the_run_and_its_commands(
    ws: Path, prefect_api: str
) -> None:
    nodes = [sp.plan.node(n, body={"n": n}, writes=[f"{n}.txt"]) for n in ("a", "b")]
    plan = sp.plan.compile_plan("evplan", "tests/events", nodes)
    with sp.open_runtime(ws) as rt:
        report = run_plan_in_flow(rt, "ev-plan-1", plan, _write)
    assert set(report.outcomes.values()) == {"built"}
    fr = _flow_run(prefect_api, "ev-plan-1")["id"]
    events = poll(
        lambda: events_of(prefect_api, "smthrs.node.", fr), lambda e: len(e) >= 2, timeout_s=DEADLINE_S
    )
    assert sorted(e["resource"]["prefect.resource.id"] for e in events) == [
        "smthrs.node.evplan.a",
        "smthrs.node.evplan.b",
    ]
    for ev in events:
        node = ev["resource"]["smthrs.node"]
        assert ev["event"] == "smthrs.node.built"
        assert ev["resource"]["smthrs.run-id"] == "ev-plan-1" and ev["resource"]["smthrs.plan-id"] == "evplan"
        assert _related(ev)["smthrs-run"] == "smthrs.run.ev-plan-1"
        assert _related(ev)["flow-run"] == f"prefect.flow-run.{fr}"
        assert set(ev["payload"]) == NODE_KEYS
        assert ev["payload"]["dispatch_key"] == report.settlement(node).dispatch_key

    md = _artifact_markdown(prefect_api, "ev-plan-1")
    assert "smthrs run id: `ev-plan-1`" in md
    assert "`smthrs show ev-plan-1`" in md and "`smthrs watch ev-plan-1`" in md
    assert f"[{SERVE_URL}/]({SERVE_URL}/)" in md
    assert "smthrs cancel" not in md  # a Report is attached to a settled run: nothing left to cancel


def test_a_plan_run_parked_on_a_timer_emits_run_parked_with_its_stored_deadline_and_names_the_commands(
    ws: Path, prefect_api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTHRS_WAIT_BUDGET_S", "0")
    (ws / "plan.yaml").write_text(
        "plan: cooling\nflow: ci/cooling\nnodes:\n"
        '  - id: build\n    run: "true"\n'
        "  - id: cool-down\n    wait: {seconds: 3600}\n    needs: [build]\n"
    )
    from smthrs_plugin.cli import app

    out = CliRunner().invoke(app, ["run", "plan.yaml", "--prefect", "--json", "--run-id", "ev-cool-1"])
    assert out.exit_code == 75, out.output
    with sp.open_runtime(ws) as rt:
        run = rt.runs.get("ev-cool-1")
    assert run is not None and run.status == "suspended" and run.waiting is not None
    due = run.waiting.wake_at_ms  # type: ignore[union-attr]

    fr = _flow_run(prefect_api, "ev-cool-1")
    (ev,) = poll(lambda: _about(prefect_api, "smthrs.run.parked", "smthrs.run.ev-cool-1"), lambda e: len(e) >= 1,
                 timeout_s=DEADLINE_S)  # fmt: skip
    assert ev["resource"] == {
        "prefect.resource.id": "smthrs.run.ev-cool-1",
        "prefect.resource.name": "ev-cool-1",
        "smthrs.run-id": "ev-cool-1",
        "smthrs.reason": "timer",
        "smthrs.wait": "node:cool-down",
    }
    assert _related(ev)["flow-run"] == f"prefect.flow-run.{fr['id']}"
    p = ev["payload"]
    assert set(p) == PARKED_KEYS
    assert (p["run_id"], p["flow"], p["reason"], p["kind"], p["wait"]) == (
        "ev-cool-1", "ci/cooling", "timer", "timer", "node:cool-down",
    )  # fmt: skip
    assert p["deadline_ms"] == due
    assert datetime.fromisoformat(p["deadline"]) == datetime.fromtimestamp(due / 1000, timezone.utc)
    assert p["commands"] == {
        "show": "smthrs show ev-cool-1",
        "watch": "smthrs watch ev-cool-1",
        "cancel": "smthrs cancel ev-cool-1",
    }
    assert p["review_url"] == f"{SERVE_URL}/"

    # The flow run's page: Paused ("Parked"), its message and its artifact name the run and the commands.
    assert (fr["state"]["type"], fr["state"]["name"]) == ("PAUSED", "Parked")
    message = fr["state"]["message"]
    for text in ("ev-cool-1", "smthrs show ev-cool-1", "smthrs watch ev-cool-1", "smthrs cancel ev-cool-1",
                 f"{SERVE_URL}/"):  # fmt: skip
        assert text in message, message
    md = _artifact_markdown(prefect_api, "ev-cool-1")
    assert "## smthrs run `ev-cool-1` is parked" in md and "(timer `node:cool-down`)" in md
    assert "| cancel | `smthrs cancel ev-cool-1` |" in md


def test_a_run_parked_on_a_node_approval_emits_approval_requested_with_its_digest_and_exact_commands(
    ws: Path, prefect_api: str
) -> None:
    (ws / "plan.yaml").write_text(
        "plan: gated\nflow: ci/gated\nnodes:\n"
        '  - id: build\n    run: "true"\n'
        '  - id: deploy\n    run: "true"\n    needs: [build]\n'
        '    approval: {request: ship, envelope: {capabilities: ["deploy:prod"]}}\n'
    )
    from smthrs_plugin.cli import app

    runner = CliRunner()
    parked = runner.invoke(app, ["run", "plan.yaml", "--prefect", "--json", "--key", "ev-gated:1"])
    assert parked.exit_code == 75, parked.output
    run_id = json.loads(parked.output.strip().splitlines()[-1])["run_id"]
    with sp.open_runtime(ws) as rt:
        view = rt.control().show(run_id)
    (pending,) = view.pending
    assert view.admission is not None  # launched through the control plane (--key): its card names the plan
    plan_id = view.admission.plan_id

    fr = _flow_run(prefect_api, run_id)["id"]
    events = poll(lambda: _about(prefect_api, "smthrs.", f"smthrs.run.{run_id}"), lambda e: len(e) >= 2,
                  timeout_s=DEADLINE_S)  # fmt: skip
    by_name = {e["event"]: e for e in events}
    ev = by_name["smthrs.approval.requested"]
    assert ev["resource"] == {
        "prefect.resource.id": f"smthrs.run.{run_id}",
        "prefect.resource.name": run_id,
        "smthrs.run-id": run_id,
        "smthrs.plan-id": plan_id,
        "smthrs.request": "ship",
    }
    related = _related(ev)
    assert related["flow-run"] == f"prefect.flow-run.{fr}"
    assert related["smthrs-approval"] == f"smthrs.approval.{pending.token_id}"
    p = ev["payload"]
    assert set(p) == REQUESTED_KEYS
    assert (p["run_id"], p["plan_id"], p["flow"], p["request"], p["token_id"], p["digest"]) == (
        run_id, plan_id, "ci/gated", "ship", pending.token_id, pending.digest,
    )  # fmt: skip
    assert p["envelope"] == pending.envelope and p["review_url"] == f"{SERVE_URL}/"
    assert p["commands"]["approve"] == f"smthrs approve {run_id} --request ship"
    assert p["commands"]["deny"] == f"smthrs deny {run_id} --request ship"

    parked_ev = by_name["smthrs.run.parked"]
    assert (
        parked_ev["payload"]["reason"] == "waiting-approval" and parked_ev["payload"]["deadline_ms"] is None
    )
    assert parked_ev["resource"]["smthrs.reason"] == "waiting-approval"
    md = _artifact_markdown(prefect_api, run_id)
    assert f"| approve | `smthrs approve {run_id} --request ship` |" in md and pending.digest in md

    # The command in the event is the exact command: run as printed, it approves the request.
    argv = shlex.split(p["commands"]["approve"])
    assert argv[0] == "smthrs"
    approved = runner.invoke(app, argv[1:])
    assert approved.exit_code == 0, approved.output
    with sp.open_runtime(ws) as rt:
        assert rt.control().show(run_id).pending == ()


def test_an_approval_decision_outside_any_flow_run_reaches_the_configured_prefect_api(
    prefect_api: str,
) -> None:
    # The approval-decided events have no call site of their own yet (a decision is made by `smthrs approve` or
    # `smthrs serve`, outside Prefect): this pins their shape and the "configured API outside a run" rule.
    assert _events.current_flow_run_id() is None and _events.prefect_in_use()
    ev = _events.approval_decided(
        run_id="ev-decided-1", plan_id="p", flow="ci/x", request="ship", token_id="tok_1", digest="d" * 64,
        envelope={"capabilities": []}, decision="approved", principal="alice/user", scope="run", flow_run_id=None,
    )  # fmt: skip
    assert _events.emit(ev)
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=DEADLINE_S)
    (got,) = poll(lambda: _about(prefect_api, "smthrs.approval.", "smthrs.run.ev-decided-1"), lambda e: len(e) >= 1,
                  timeout_s=DEADLINE_S)  # fmt: skip
    assert got["event"] == "smthrs.approval.approved"
    assert got["resource"]["smthrs.decision"] == "approved" and got["resource"]["smthrs.request"] == "ship"
    assert set(got["payload"]) == REQUESTED_KEYS | {"decision", "principal", "scope"}
    assert (got["payload"]["principal"], got["payload"]["scope"]) == ("alice/user", "run")


def test_outside_a_flow_run_without_a_prefect_api_nothing_is_sent_and_prefect_is_not_even_imported(
    tmp_path: Path,
) -> None:
    code = (
        "import sys\n"
        "from smthrs_plugin.prefect import _events\n"
        "ev = _events.run_parked(run_id='r', flow='f', kind='timer', wait='w', deadline_ms=0, flow_run_id=None)\n"
        "print(_events.emit(ev), 'prefect' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=DEADLINE_S, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]
    assert not (tmp_path / "prefect-home").exists()


def test_a_malformed_serve_url_is_a_typed_settings_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_events.SERVE_URL_ENV, "ci-review:8765")
    with pytest.raises(sp.SettingsError) as err:
        _events.review_url()
    assert err.value.code == "invalid_setting" and "SMTHRS_SERVE_URL" in err.value.message


def _flowrun_announces_parks() -> bool:
    return "announce_parked" in inspect.getsource(_flowrun)


@flow(persist_result=False)
def gated(n: int = 1) -> int:
    sp.require_approval("ship", envelope={"capabilities": ["deploy:prod"]})
    return n


@pytest.mark.skipif(
    not _flowrun_announces_parks(),
    reason="prefect/_flowrun.py does not call _events.announce_parked yet (the wiring is listed in helper E's report)",
)
def test_require_approval_inside_a_flow_emits_approval_requested_related_to_its_flow_run(
    ws: Path, prefect_api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTHRS_WAIT_BUDGET_S", "0")
    out = sp.durable_run(gated, "ev-flow-gated-1", {"n": 1})
    assert out.wait.reason == "waiting-approval"  # type: ignore[union-attr]
    rt = current_spec().open()
    (pending,) = rt.control().show("ev-flow-gated-1").pending
    events = poll(lambda: _about(prefect_api, "smthrs.", "smthrs.run.ev-flow-gated-1"), lambda e: len(e) >= 2,
                  timeout_s=DEADLINE_S)  # fmt: skip
    ev = next(e for e in events if e["event"] == "smthrs.approval.requested")
    assert ev["payload"]["digest"] == pending.digest and ev["payload"]["request"] == "ship"
    assert _related(ev)["flow-run"].startswith("prefect.flow-run.")


def _decisions_are_observed() -> bool:
    from smthrs_plugin.hooks.specs import SmthrsSpecs

    return hasattr(SmthrsSpecs, "smthrs_approval_decided")


@pytest.mark.skipif(
    not _decisions_are_observed(),
    reason="no smthrs_approval_decided observer hook yet (the hookspec and call site are in helper E's report)",
)
def test_smthrs_approve_in_a_cli_process_emits_approval_approved_about_the_run(
    ws: Path, prefect_api: str
) -> None:
    (ws / "plan.yaml").write_text(
        "plan: decided\nflow: ci/decided\nnodes:\n"
        '  - id: deploy\n    run: "true"\n    approval: {request: ship}\n'
    )
    from smthrs_plugin.cli import app

    runner = CliRunner()
    parked = runner.invoke(app, ["run", "plan.yaml", "--prefect", "--json", "--key", "ev-decided:1"])
    assert parked.exit_code == 75, parked.output
    run_id = json.loads(parked.output.strip().splitlines()[-1])["run_id"]
    approved = runner.invoke(app, ["approve", run_id, "--request", "ship"])
    assert approved.exit_code == 0, approved.output
    (ev,) = poll(lambda: _about(prefect_api, "smthrs.approval.approved", f"smthrs.run.{run_id}"),
                 lambda e: len(e) >= 1, timeout_s=DEADLINE_S)  # fmt: skip
    assert ev["resource"]["smthrs.decision"] == "approved" and ev["resource"]["smthrs.request"] == "ship"
    assert set(ev["payload"]) == REQUESTED_KEYS | {"decision", "principal", "scope"}
    assert (ev["payload"]["decision"], ev["payload"]["principal"]) == ("approved", "local/operator")
