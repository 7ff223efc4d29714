"""The control-plane contract, on SQLite and PostgreSQL: every receipt (Accepted, AlreadyApplied, Parked, Conflict,
Terminal) and every refusal (Unauthorized, PlanNotFound, PlanDenied, PlanDigestMismatch, EnvelopeMismatch,
AlreadyResolved, RunNotFound, InvalidInput) of ``Control``."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from _control_support import RecordingLauncher, count, journal_types, release_plan

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.control import Envelope
from smthrs_plugin.control.approvals import Approved, Denied, PendingApproval
from smthrs_plugin.control.authority import (
    AuthorityRequest,
    Authorized,
    DelegatedAuthority,
    Delegation,
    NodeTarget,
    PlanTarget,
    Unauthorized,
)
from smthrs_plugin.control.facade import Control, Launch
from smthrs_plugin.control.identity import LOCAL_OPERATOR, Principal
from smthrs_plugin.control.receipts import Accepted, AlreadyApplied, Conflict, Parked, Terminal
from smthrs_plugin.engine.ownership.arbiter import Activated, Ownership
from smthrs_plugin.errors import ControlError, InvalidInput
from smthrs_plugin.records.waits import WaitStore
from smthrs_plugin.settings import Settings
from smthrs_plugin.stores.database import Database, open_database

BOB = Principal("bob", "human")
ENV = {"capabilities": ["deploy:prod"]}


def _gated_card(control: Control, **kw: Any) -> Any:
    return control.plan(release_plan(), input={"version": "1.4.0"}, envelope=ENV, approval=True, **kw)


def _ungated_run(control: Control, launcher: RecordingLauncher, key: str = "k") -> str:
    card = control.plan(release_plan(), envelope=ENV)
    receipt = control.run(card, idempotency_key=key, launcher=launcher)
    assert isinstance(receipt, Accepted) and receipt.run_id is not None
    return receipt.run_id


def _parked_on_ship(control: Control, db: Database, settings: Settings, run_id: str) -> PendingApproval:
    """Drive the run like a step would: claim it, register the node request, park it ``waiting-approval``."""
    own = Ownership(db, settings=settings)
    assert isinstance(own.claim(run_id), Activated)
    state = control.approvals.register(
        run_id, "ship", digest="ci/release:ship", envelope=ENV, owner=own.owner
    )
    assert isinstance(state, PendingApproval)
    WaitStore(db).park(run_id, own.owner, reason="waiting-approval", token=state.token_id)
    return state


def _ship(run_id: str, **kw: Any) -> NodeTarget:
    return NodeTarget(
        run_id, "ship", kw.pop("digest", "ci/release:ship"), Envelope.from_json(kw.pop("env", ENV))
    )


# -- plan ---------------------------------------------------------------------------------------------------------


def test_plan_is_idempotent_per_content_and_any_change_is_a_new_card(control: Control, db: Database) -> None:
    card = _gated_card(control)
    assert _gated_card(control).plan_id == card.plan_id  # same content: the same undecided card
    changed = control.plan(
        release_plan("./deploy.sh"), input={"version": "1.4.0"}, envelope=ENV, approval=True
    )
    other_input = _gated_card(control, principal=LOCAL_OPERATOR).plan_id
    assert other_input == card.plan_id
    assert changed.digest != card.digest and changed.plan_id != card.plan_id
    assert card.deploy_class and isinstance(control.plan_state(card.plan_id), PendingApproval)
    assert count(db, "control_plans") == 2 and count(db, "control_tokens") == 2
    assert "control.plan.created" in journal_types(db, f"plan:{card.plan_id}")


# -- run: Parked, Accepted, AlreadyApplied, Conflict -----------------------------------------------------------------


def test_run_parks_while_undecided_records_nothing_and_the_key_launches_after_approval(
    control: Control, db: Database, launcher: RecordingLauncher
) -> None:
    card = _gated_card(control)
    assert control.run(card, idempotency_key="deploy:v1.4.0", launcher=launcher) == Parked(card.plan_id)
    assert count(db, "control_receipts") == 0 and count(db, "runs") == 0 and launcher.calls == []
    assert isinstance(control.approve(card.approval), Accepted)
    receipt = control.run(card, idempotency_key="deploy:v1.4.0", launcher=launcher)
    assert isinstance(receipt, Accepted) and [r.run_id for r in launcher.calls] == [receipt.run_id]


def test_run_admission_commits_before_the_launcher_is_called(
    control: Control, db: Database, db_url: str, launcher: RecordingLauncher
) -> None:
    other = open_database(db_url)  # another connection: it sees only committed state

    def probe(run: Any) -> tuple[Any, ...]:
        return other.read(
            lambda c: (
                c.execute(sa.text("SELECT status FROM runs WHERE run_id = :r"), {"r": run.run_id}).scalar(),
                c.execute(
                    sa.text("SELECT count(*) FROM control_receipts WHERE run_id = :r"), {"r": run.run_id}
                ).scalar(),
                c.execute(
                    sa.text("SELECT plan_id FROM control_runs WHERE run_id = :r"), {"r": run.run_id}
                ).scalar(),
            )
        )

    launcher.probe = probe
    card = control.plan(release_plan(), envelope=ENV)  # no plan approval: launches directly
    receipt = control.run(card, idempotency_key="k", launcher=launcher)
    assert isinstance(receipt, Accepted)
    assert launcher.seen == [("pending", 1, card.plan_id)]
    assert "control.run.accepted" in journal_types(db, str(receipt.run_id))


def test_same_key_replays_already_applied_and_another_intent_is_a_conflict(
    control: Control, db: Database, launcher: RecordingLauncher
) -> None:
    card = _gated_card(control)
    control.approve(card.approval)
    first = control.run(card, idempotency_key="deploy:v1.4.0", launcher=launcher)
    again = control.run(card, idempotency_key="deploy:v1.4.0", launcher=launcher)
    assert isinstance(first, Accepted) and again == first.replayed()
    other = control.plan(release_plan(), input={"version": "1.5.0"}, envelope=ENV, approval=True)
    control.approve(other.approval)
    assert isinstance(control.run(other, idempotency_key="deploy:v1.4.0"), Conflict)
    # Another principal's key is another durable key: not a replay of the operator's run.
    assert isinstance(control.run(card, idempotency_key="deploy:v1.4.0", principal=BOB), Accepted)
    assert count(db, "control_receipts") == 4  # two plan approvals, the operator's run and BOB's


def test_refused_launch_records_the_run_failed_and_keeps_the_receipt(
    control: Control, db: Database, launcher: RecordingLauncher
) -> None:
    launcher.refuse = RuntimeError("no capacity")
    card = control.plan(release_plan(), envelope=ENV)
    receipt = control.run(card, idempotency_key="k", launcher=launcher)
    assert isinstance(receipt, Accepted) and receipt.run_id is not None
    view = control.show(receipt.run_id)
    assert view.status == "failed" and view.error["message"] == "no capacity"
    assert "control.run.failed" in journal_types(db, receipt.run_id)
    assert control.run(card, idempotency_key="k", launcher=launcher) == receipt.replayed()
    assert len(launcher.calls) == 1  # a settled run is not launched again


def test_once_grant_authorises_one_launch_and_a_second_key_parks_on_a_fresh_card(
    control: Control, launcher: RecordingLauncher
) -> None:
    card = _gated_card(control)
    control.approve(card.approval, scope="once")
    assert isinstance(control.run(card, idempotency_key="k1", launcher=launcher), Accepted)
    assert isinstance(control.run(card, idempotency_key="k1", launcher=launcher), AlreadyApplied)
    parked = control.run(card, idempotency_key="k2", launcher=launcher)
    assert isinstance(parked, Parked) and parked.plan_id != card.plan_id
    assert _gated_card(control).plan_id == parked.plan_id  # the successor card is what `plan` now answers


# -- decisions: Unauthorized, AlreadyResolved, digest and envelope mismatches -----------------------------------------


def test_unauthorized_principal_is_refused_before_anything_is_written(control: Control, db: Database) -> None:
    card = _gated_card(control)
    before = (count(db, "journal_events"), count(db, "control_receipts"), count(db, "control_decisions"))
    with pytest.raises(ControlError) as info:
        control.approve(card.approval, principal=BOB)
    assert info.value.code == "unauthorized"
    with pytest.raises(ControlError, match="unauthorized"):
        control.deny(card.approval, principal=BOB)
    assert (
        count(db, "journal_events"),
        count(db, "control_receipts"),
        count(db, "control_decisions"),
    ) == before


def test_delegations_bind_principal_scope_and_target_kind_exactly(
    db: Database, settings: Settings, launcher: RecordingLauncher
) -> None:
    bot = Principal("release-bot", "agent")
    authority = DelegatedAuthority(
        [Delegation(LOCAL_OPERATOR), Delegation(bot, frozenset({"once"}), frozenset({"Node"}))]
    )
    control = Control(db, settings=settings, authority=authority)
    card = _gated_card(control)
    with pytest.raises(ControlError, match="unauthorized"):
        control.approve(card.approval, scope="once", principal=bot)  # Plan is not a delegated target kind
    with pytest.raises(ControlError, match="unauthorized"):
        control.approve(
            card.approval, principal=Principal("release-bot", "operator")
        )  # a kind alone never delegates
    run_id = _ungated_run(control, launcher)
    _parked_on_ship(control, db, settings, run_id)
    with pytest.raises(ControlError, match="unauthorized"):
        control.approve(_ship(run_id), scope="run", principal=bot)  # scopes are not hierarchical
    assert isinstance(control.approve(_ship(run_id), scope="once", principal=bot), Accepted)
    assert authority.authorize_request(AuthorityRequest(bot, "deny", "Node", "r/x")).tag == "Authorized"


class _ThreeArgumentAuthority:
    """A plugin-shaped authority: only the hook's ``authorize(principal, action, target)``, no request form."""

    def authorize(self, principal: Principal, action: str, target: str) -> Authorized | Unauthorized:
        if principal == LOCAL_OPERATOR:
            return Authorized(principal)
        return Unauthorized(principal, f"{principal} may not {action} {target}")


def test_a_plugin_authority_with_the_three_argument_hook_shape_is_honoured(
    db: Database, settings: Settings
) -> None:
    control = Control(db, settings=settings, authority=_ThreeArgumentAuthority())
    card = _gated_card(control)
    with pytest.raises(ControlError, match="unauthorized"):
        control.approve(card.approval, principal=BOB)
    assert isinstance(control.approve(card.approval), Accepted)


def test_decision_replays_under_its_key_conflicts_on_another_scope_and_a_second_decision_is_already_resolved(
    control: Control, db: Database
) -> None:
    card = _gated_card(control)
    first = control.approve(card.approval)
    assert isinstance(first, Accepted) and control.approve(card.approval) == first.replayed()
    assert isinstance(control.approve(card.approval, scope="remembered"), Conflict)
    with pytest.raises(ControlError) as info:
        control.deny(card.approval)
    assert info.value.code == "already_resolved"
    assert isinstance(control.plan_state(card.plan_id), Approved)
    assert journal_types(db, f"plan:{card.plan_id}").count("control.approval.approved") == 1


def test_plan_digest_mismatch_carries_expected_and_actual(control: Control) -> None:
    card = _gated_card(control)
    stale = PlanTarget(card.plan_id, "0" * 64, card.envelope)
    with pytest.raises(ControlError) as info:
        control.approve(stale)
    assert info.value.code == "plan_digest_mismatch"
    assert info.value.details == {"expected": card.digest, "actual": "0" * 64}
    with pytest.raises(ControlError, match="plan_digest_mismatch"):
        control.run(Launch(card.plan_id, "0" * 64, card.envelope), idempotency_key="k")


def test_envelope_mismatch_compares_canonical_bytes_not_key_order(control: Control) -> None:
    card = control.plan(release_plan(), envelope={"capabilities": ["deploy:prod"], "budget": {"usd": 5, "cpu": 1}},
                        approval=True)  # fmt: skip
    reordered = {"budget": {"cpu": 1, "usd": 5}, "flows": [], "capabilities": ["deploy:prod"]}
    widened = {"capabilities": ["deploy:prod", "deploy:staging"], "budget": {"usd": 5, "cpu": 1}}
    with pytest.raises(ControlError) as info:
        control.approve(PlanTarget(card.plan_id, card.digest, Envelope.from_json(widened)))
    assert info.value.code == "envelope_mismatch"
    assert isinstance(
        control.approve(PlanTarget(card.plan_id, card.digest, Envelope.from_json(reordered))), Accepted
    )


def test_plan_not_found_and_run_not_found(control: Control) -> None:
    for call in (
        lambda: control.approve(PlanTarget("nope", "0" * 64)),
        lambda: control.run(Launch("nope", "0" * 64, Envelope()), idempotency_key="k"),
        lambda: control.card("nope"),
    ):
        with pytest.raises(ControlError) as info:
            call()
        assert info.value.code == "plan_not_found"
    ungated = control.plan(release_plan())
    with pytest.raises(ControlError, match="does not require an approval"):
        control.approve(PlanTarget(ungated.plan_id, ungated.digest))
    for call in (
        lambda: control.approve(NodeTarget("no-such-run", "ship", "d")),
        lambda: control.cancel("no-such-run"),
        lambda: control.resume("no-such-run", idempotency_key="k"),
        lambda: control.show("no-such-run"),
    ):
        with pytest.raises(ControlError) as info:
            call()
        assert info.value.code == "run_not_found"


def test_a_denied_plan_never_launches_and_planning_again_makes_a_new_card(
    control: Control, launcher: RecordingLauncher
) -> None:
    card = _gated_card(control)
    assert isinstance(control.deny(card.approval), Accepted)
    with pytest.raises(ControlError) as info:
        control.run(card, idempotency_key="k", launcher=launcher)
    assert info.value.code == "plan_denied" and launcher.calls == []
    # The launch path keeps the denied card (a CI retry refuses); an explicit plan asks anew.
    assert _gated_card(control, renew=False).plan_id == card.plan_id
    fresh = _gated_card(control)
    assert fresh.plan_id == card.plan_id + ".1" and fresh.digest == card.digest
    assert isinstance(control.run(fresh, idempotency_key="k"), Parked)


# -- node approvals: registration, the atomic decision, Terminal ------------------------------------------------------


def test_node_registration_is_idempotent_and_refuses_a_reaimed_request(
    control: Control, db: Database, settings: Settings, launcher: RecordingLauncher
) -> None:
    run_id = _ungated_run(control, launcher)
    first = _parked_on_ship(control, db, settings, run_id)
    again = control.approvals.register(run_id, "ship", digest="ci/release:ship", envelope=ENV)
    assert again == first and count(db, "control_tokens") == 1
    with pytest.raises(ControlError, match="plan_digest_mismatch"):
        control.approvals.register(run_id, "ship", digest="something-else", envelope=ENV)
    with pytest.raises(ControlError, match="envelope_mismatch"):
        control.approvals.register(
            run_id, "ship", digest="ci/release:ship", envelope={"capabilities": ["root"]}
        )


def test_node_decision_commits_decision_grant_journal_receipt_and_resume_delegation_together(
    control: Control, db: Database, settings: Settings, launcher: RecordingLauncher
) -> None:
    run_id = _ungated_run(control, launcher)
    _parked_on_ship(control, db, settings, run_id)
    assert control.show(run_id).waiting_approval
    receipt = control.approve(_ship(run_id))
    assert isinstance(receipt, Accepted) and receipt.run_id == run_id
    assert control.show(run_id).status == "pending"  # woken: a driver (or `smthrs resume`) picks it up
    assert [count(db, t) for t in ("control_decisions", "control_grants", "control_resumes")] == [1, 1, 1]
    types = journal_types(db, run_id)
    assert types.index("control.approval.approved") < types.index("control.run.resumed")
    assert isinstance(control.approvals.node_state(run_id, "ship"), Approved)


def test_an_authority_refusing_at_the_recheck_leaves_nothing_behind(
    db: Database, settings: Settings, launcher: RecordingLauncher
) -> None:
    class ChangesItsMind:
        asked = 0

        def authorize_request(self, request: AuthorityRequest) -> Any:
            self.asked += 1
            return DelegatedAuthority([Delegation(LOCAL_OPERATOR)]).authorize_request(request) if self.asked == 1 \
                else DelegatedAuthority([]).authorize_request(request)  # fmt: skip

    control = Control(db, settings=settings)
    run_id = _ungated_run(control, launcher)
    _parked_on_ship(control, db, settings, run_id)
    control.approvals.authority = ChangesItsMind()
    before = count(db, "journal_events")
    with pytest.raises(ControlError, match="unauthorized"):
        control.approve(_ship(run_id))
    assert [
        count(db, t) for t in ("control_decisions", "control_grants", "control_resumes", "control_receipts")
    ] == [
        0,
        0,
        0,
        1,
    ]  # fmt: skip  (the one receipt is the run's admission)
    assert count(db, "journal_events") == before and control.show(run_id).waiting_approval


def test_a_denied_node_request_wakes_the_run_to_learn_the_denial(
    control: Control, db: Database, settings: Settings, launcher: RecordingLauncher
) -> None:
    run_id = _ungated_run(control, launcher)
    _parked_on_ship(control, db, settings, run_id)
    assert isinstance(control.deny(_ship(run_id)), Accepted)
    assert control.show(run_id).status == "pending"
    assert isinstance(control.approvals.node_state(run_id, "ship"), Denied)
    assert count(db, "control_grants") == 0  # a denial installs no grant
    with pytest.raises(ControlError, match="already_resolved"):
        control.approve(_ship(run_id))


def test_a_decision_or_a_resume_on_a_settled_run_answers_terminal_before_any_replay(
    control: Control, db: Database, settings: Settings, launcher: RecordingLauncher
) -> None:
    run_id = _ungated_run(control, launcher)
    _parked_on_ship(control, db, settings, run_id)
    assert isinstance(control.resume(run_id, idempotency_key="r1"), Parked)  # waits for its node approval
    control.approve(_ship(run_id))
    assert isinstance(control.resume(run_id, idempotency_key="r1"), Accepted)
    assert isinstance(control.resume(run_id, idempotency_key="r1"), AlreadyApplied)
    assert isinstance(control.cancel(run_id), Accepted)
    assert control.resume(run_id, idempotency_key="r1") == Terminal(run_id, "cancelled")
    assert control.approve(_ship(run_id)) == Terminal(run_id, "cancelled")


def test_cancel_never_replays_it_reads_the_run(
    control: Control, db: Database, launcher: RecordingLauncher
) -> None:
    run_id = _ungated_run(control, launcher)
    first = control.cancel(run_id, reason="wrong tag")
    assert isinstance(first, Accepted) and control.show(run_id).status == "cancelled"
    assert control.cancel(run_id) == Terminal(run_id, "cancelled")
    assert [r.run_id for r in control.list(status="cancelled").runs] == [run_id]
    assert count(db, "control_receipts") == 1  # only the run's admission: a cancel is never recorded
    assert "control.run.cancel-requested" in journal_types(db, run_id)


def test_remembered_node_grant_decides_the_same_request_in_a_later_run(
    control: Control, db: Database, settings: Settings, launcher: RecordingLauncher
) -> None:
    first = _ungated_run(control, launcher, key="k1")
    _parked_on_ship(control, db, settings, first)
    control.approve(_ship(first), scope="remembered")
    second = _ungated_run(control, launcher, key="k2")
    own = Ownership(db, settings=settings)
    assert isinstance(own.claim(second), Activated)
    state = control.approvals.register(
        second, "ship", digest="ci/release:ship", envelope=ENV, owner=own.owner
    )
    assert isinstance(state, Approved) and state.principal == LOCAL_OPERATOR
    # A different envelope is a different request: asked again.
    other = control.approvals.register(
        second, "ship-wide", digest="ci/release:ship", envelope={"capabilities": ["*"]}
    )
    assert isinstance(other, PendingApproval)


# -- the identity boundary ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"idempotency_key": ""},
        {"idempotency_key": "k" * 1025},
        {"idempotency_key": "a\x00b"},
        {"idempotency_key": "\ud800"},
    ],
)
def test_invalid_keys_are_refused_before_anything_is_written(
    control: Control, db: Database, bad: dict[str, str]
) -> None:
    card = control.plan(release_plan())
    before = count(db, "journal_events")
    with pytest.raises(InvalidInput) as info:
        control.run(card, **bad)
    assert info.value.details["bound"] == "idempotency_key"
    with pytest.raises(InvalidInput):
        control.approve(PlanTarget(card.plan_id, card.digest), **bad)
    assert count(db, "journal_events") == before and count(db, "runs") == 0


@pytest.mark.parametrize(
    ("value", "bound"),
    [("deep", "depth"), ("wide", "entries"), ("nan", "number"), ("surrogate", "well_formed_text"),
     ("tuple", "plain_data")],
)  # fmt: skip
def test_plan_input_over_a_bound_is_refused_naming_the_bound(
    control: Control, db: Database, value: str, bound: str
) -> None:
    inputs: dict[str, Any] = {
        "deep": _deep(129),
        "wide": list(range(100_001)),
        "nan": float("nan"),
        "surrogate": "\udc00",
        "tuple": (1, 2),
    }
    with pytest.raises(InvalidInput) as info:
        control.plan(release_plan(), input={"v": inputs[value]})
    assert info.value.details["bound"] == bound
    assert count(db, "control_plans") == 0 and count(db, "journal_events") == 0


def _deep(n: int) -> Any:
    v: Any = "leaf"
    for _ in range(n):
        v = [v]
    return v


def test_an_orphaned_admission_is_kept_by_a_live_admitter_and_reclaimed_once_its_lease_lapses(
    db: Database, settings: Settings, launcher: RecordingLauncher
) -> None:
    from smthrs_plugin.records.runs import OwnerId

    clock = ManualClock()  # one clock for both: the claim's age is exactly what the test advances
    admitter = Control(db, settings=settings, owner=OwnerId("ctl-host", 999_999, "gone"), clock=clock)
    card = admitter.plan(release_plan())
    receipt = admitter.run(card, idempotency_key="k")  # admitted, never launched (its process "died")
    assert isinstance(receipt, Accepted) and receipt.run_id is not None
    retry = Control(db, settings=settings, clock=clock)
    assert retry.run(card, idempotency_key="k", launcher=launcher) == receipt.replayed()
    assert launcher.calls == []  # the claim is fresh: a live admitter keeps its run
    clock.advance(settings.stale_after_s)
    assert retry.run(card, idempotency_key="k", launcher=launcher) == receipt.replayed()
    assert launcher.calls == []  # exactly 30,000 ms of claim age: still a fresh lease, still the admitter's
    clock.advance(0.001)  # 30,001 ms: the lease expired (no skew added)
    assert retry.run(card, idempotency_key="k", launcher=launcher) == receipt.replayed()
    assert [r.run_id for r in launcher.calls] == [receipt.run_id]
    assert "control.run.reclaimed" in journal_types(db, receipt.run_id)


def test_racing_deciders_resolve_a_token_exactly_once(
    control: Control, db: Database, settings: Settings, launcher: RecordingLauncher
) -> None:
    import threading

    run_id = _ungated_run(control, launcher)
    _parked_on_ship(control, db, settings, run_id)
    answers: list[Any] = []
    barrier = threading.Barrier(4)

    def decide(i: int) -> None:
        barrier.wait()
        try:
            call = control.approve if i % 2 == 0 else control.deny
            answers.append(call(_ship(run_id), idempotency_key=f"decider-{i}"))
        except ControlError as exc:
            answers.append(exc.code)

    threads = [threading.Thread(target=decide, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(a if isinstance(a, str) else a.type for a in answers) == [
        "Accepted", "already_resolved", "already_resolved", "already_resolved",
    ]  # fmt: skip
    assert count(db, "control_decisions") == 1 and count(db, "control_resumes") == 1


def test_racing_same_key_runs_admit_one_run(control: Control, db: Database) -> None:
    import threading

    card = control.plan(release_plan())
    answers: list[Any] = []
    barrier = threading.Barrier(4)

    def run() -> None:
        barrier.wait()
        answers.append(control.run(card, idempotency_key="deploy:v1.4.0"))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(a.type for a in answers) == [
        "Accepted",
        "AlreadyApplied",
        "AlreadyApplied",
        "AlreadyApplied",
    ]
    assert len({a.run_id for a in answers}) == 1 and count(db, "runs") == 1


def test_resuming_a_run_the_plane_did_not_launch_is_refused_before_writing_and_names_the_worker(
    control: Control, db: Database, launcher: RecordingLauncher
) -> None:
    from smthrs_plugin.records.runs import RunStore

    RunStore(db).create("flow-run-1", "prefect/nightly")
    before = journal_types(db, "flow-run-1")
    with pytest.raises(ControlError) as info:
        control.resume("flow-run-1", idempotency_key="k", launcher=launcher)
    assert info.value.code == "run_not_found" and "smthrs worker --flow" in info.value.message
    assert journal_types(db, "flow-run-1") == before and launcher.calls == []
    assert count(db, "control_receipts") == 0  # no receipt: the key stays unspent
