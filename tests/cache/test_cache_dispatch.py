"""The dispatch seam end to end over real stores: the shared tier on file://, memory:// and s3:// (moto), the
local tier in SQLite, real sandboxes. Every test names the behaviour it pins."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _cache_support import Machine, tamper, upper, upper_node

from smthrs_plugin.boundary import referenced_digests
from smthrs_plugin.cache import CacheDispatcher, Miss, ReplayFailed, StaleReadSet, VerifiedHit
from smthrs_plugin.canonical import key_digest
from smthrs_plugin.errors import BoundaryRefusal, CacheError, MaterializationConflict
from smthrs_plugin.stores.artifacts import ArtifactStore

Machines = Callable[..., Machine]


def test_miss_builds_then_a_fresh_workspace_gets_a_clean_hit_with_identical_bytes(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    built = a.dispatch(upper_node(), upper)
    assert (built.outcome, built.decision, built.value) == ("built", Miss(), {"length": 6})
    assert built.published == {"local": "published", "shared": "published"}
    assert referenced_digests(built.evidence)  # the output was spilled: blobs travel through the shared tier

    again = a.dispatch(upper_node(), upper)
    assert (again.outcome, again.decision) == ("clean", VerifiedHit("local"))

    b = machines("b", files={"in.txt": "hello\n"})
    hit = b.dispatch(upper_node(), upper, run_id="r2")
    assert (hit.outcome, hit.decision, hit.value) == ("clean", VerifiedHit("shared"), {"length": 6})
    assert (b.ws / "out.txt").read_bytes() == (a.ws / "out.txt").read_bytes() == b"HELLO\n"
    assert (a.calls["upper"], b.calls["upper"]) == (1, 0)
    # the shared hit was copied into b's local tier: the next one is local
    assert b.dispatch(upper_node(), upper, run_id="r3").decision == VerifiedHit("local")
    assert b.metrics.decisions == {"VerifiedHit": 2}


def test_a_tampered_blob_is_boundary_corruption_never_served_and_the_step_re_executes(
    machines: Machines,
) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    built = a.dispatch(upper_node(), upper)
    (digest,) = referenced_digests(built.evidence)
    tamper(a.shared, digest)

    b = machines("b", files={"in.txt": "hello\n"})
    res = b.dispatch(upper_node(), upper, run_id="r2")
    assert res.outcome == "built" and b.calls["upper"] == 1
    assert isinstance(res.decision, ReplayFailed) and res.decision.code == "boundary_corruption"
    assert (b.ws / "out.txt").read_text() == "HELLO\n"  # the executor's bytes, not the tampered ones
    assert b.metrics.decisions == {"ReplayFailed": 1}
    # the corrupt blob was dropped and re-published by the re-execution: a third machine is served intact bytes
    c = machines("c", files={"in.txt": "hello\n"})
    assert c.dispatch(upper_node(), upper, run_id="r3").decision == VerifiedHit("shared")
    assert (c.ws / "out.txt").read_text() == "HELLO\n"


def test_a_tampered_local_blob_invalidates_the_local_entry(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    built = a.dispatch(upper_node(), upper, publish_shared=False, consult_shared=False)
    (digest,) = referenced_digests(built.evidence)
    tamper(a.artifacts, digest)
    (a.ws / "out.txt").unlink()  # force a replay from the blob
    res = a.dispatch(upper_node(), upper, publish_shared=False, consult_shared=False)
    assert isinstance(res.decision, ReplayFailed) and res.decision.code == "boundary_corruption"
    assert res.outcome == "built" and a.calls["upper"] == 2
    actions = [p["action"] for p in a.provenance()]
    assert "invalidated" in actions
    (a.ws / "out.txt").unlink()
    assert a.dispatch(upper_node(), upper, consult_shared=False).decision == VerifiedHit("local")
    assert a.artifacts.get_bytes(digest) == b"HELLO\n"  # re-stored intact


def test_a_missing_local_blob_is_hydrated_from_the_shared_tier(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    built = a.dispatch(upper_node(), upper)
    (digest,) = referenced_digests(built.evidence)
    a.artifacts.delete_blob(digest)
    (a.ws / "out.txt").unlink()
    res = a.dispatch(upper_node(), upper)
    assert (res.outcome, res.decision) == ("clean", VerifiedHit("local"))
    assert a.calls["upper"] == 1 and (a.ws / "out.txt").read_text() == "HELLO\n"
    assert a.artifacts.has(digest)


def test_a_blob_missing_everywhere_re_executes(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    built = a.dispatch(upper_node(), upper)
    (digest,) = referenced_digests(built.evidence)
    a.artifacts.delete_blob(digest)
    a.shared.delete_blob(digest)
    (a.ws / "out.txt").unlink()
    res = a.dispatch(upper_node(), upper)
    assert isinstance(res.decision, ReplayFailed) and res.decision.code == "missing_artifact"
    assert res.outcome == "built" and a.calls["upper"] == 2
    assert a.artifacts.has(digest) and a.shared.has(digest)  # re-stored by the re-execution


def test_an_edited_declared_read_is_a_stale_read_set_and_the_old_entry_is_no_longer_served(
    machines: Machines,
) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    a.dispatch(upper_node(), upper, consult_shared=False, publish_shared=False)
    keyed = a.request(upper_node(), consult_shared=False, publish_shared=False)  # keyed on "hello\n"
    a.write("in.txt", "changed!\n")
    res = a.dispatcher.dispatch(keyed, upper)
    assert isinstance(res.decision, StaleReadSet)
    ((path, old, new),) = res.decision.changed
    assert path == "in.txt" and old != new and new is not None
    assert res.outcome == "built" and (a.ws / "out.txt").read_text() == "CHANGED!\n"
    # built against other bytes than its key names: run-local, never recorded under the old key
    assert res.published["local"] == "run-local"
    a.write("in.txt", "hello\n")
    again = a.dispatcher.dispatch(a.request(upper_node(), consult_shared=False), upper)
    assert again.decision == Miss() and again.outcome == "built"
    assert a.metrics.decisions == {"Miss": 2, "StaleReadSet": 1}


def test_hard_mode_undeclared_write_fails_and_nothing_is_admitted(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "hello\n"})

    def sneaky(root: Path) -> int:
        upper(root)
        (root / "elsewhere.txt").write_text("undeclared")
        return 1

    res = a.dispatch(upper_node(), sneaky)
    assert res.outcome == "failed" and isinstance(res.error, BoundaryRefusal)
    assert res.error.code == "undeclared_write"
    assert not (a.ws / "out.txt").exists() and not (a.ws / "elsewhere.txt").exists()
    assert a.dispatcher.local.rows() == [] and a.shared.list_entries() == []
    assert a.metrics.settlements == {"Refused": 1}


def test_expected_mode_deviation_is_built_and_stays_run_local(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    draft = upper_node(boundary="expected")

    def sneaky(root: Path) -> int:
        upper(root)
        (root / "elsewhere.txt").write_text("undeclared")
        return 1

    res = a.dispatch(draft, sneaky)
    assert res.outcome == "built" and [d.kind for d in res.deviations] == ["expected-set-deviation"]
    assert res.published == {"local": "run-local", "shared": "unpublished:boundary_hard"}
    assert a.shared.list_entries() == []
    assert [r.scope for r in a.dispatcher.local.rows()] == ["run-local"]
    assert any(p["action"] == "run-local" for p in a.provenance())
    # another run (same database, same key) misses
    other = a.dispatch(draft, sneaky, run_id="r2")
    assert other.decision == Miss() and a.calls["upper"] == 2


def test_a_non_sealed_tier_never_consults_nor_publishes(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    draft = upper_node(tier="compensable")
    res = a.dispatch(draft, upper, plan_id="p1")
    assert res.outcome == "built" and res.decision is None
    assert res.published["shared"] == "unpublished:tier_sealed"
    assert a.shared.list_entries() == [] and a.metrics.decisions == {}
    again = a.dispatch(draft, upper, plan_id="p1")
    assert again.outcome == "built" and a.calls["upper"] == 2


def _flaky_value() -> Callable[[Path], Any]:
    n = {"i": 0}

    def body(root: Path) -> int:
        n["i"] += 1
        (root / "out.txt").write_text("same output")
        return n["i"]

    return body


def test_same_key_different_result_fails_strictly(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "x"})
    b = machines("b", files={"in.txt": "x"})
    body = _flaky_value()
    assert a.dispatch(upper_node(), body).value == 1
    res = b.dispatch(upper_node(), body, consult_shared=False)  # b misses, builds 2: a different result
    assert res.outcome == "failed" and isinstance(res.error, CacheError)
    assert res.error.code == "result_mismatch"
    assert b.dispatcher.local.rows() == []
    assert any(p.get("stage") == "result_mismatch" for p in b.provenance())


def test_same_key_different_result_keeps_the_first_writer_when_nondeterministic(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "x"})
    b = machines("b", files={"in.txt": "x"})
    body = _flaky_value()
    draft = upper_node(nondeterministic=True)
    assert a.dispatch(draft, body).value == 1
    res = b.dispatch(draft, body, consult_shared=False)
    assert (res.outcome, res.value) == ("built", 2)
    c = machines("c", files={"in.txt": "x"})
    assert c.dispatch(draft, body).value == 1  # the first writer's result is what the shared tier serves


def test_a_value_that_is_not_json_is_built_but_never_cached(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "x"})

    def body(root: Path) -> Any:
        upper(root)
        return complex(1, 2)  # no value codec stores it: not cached rather than weakened (e.g. to a string)

    res = a.dispatch(upper_node(), body)
    assert res.outcome == "built" and res.value == complex(1, 2)
    assert res.published == {"local": "unpublished:value", "shared": "unpublished:value"}
    assert [p["stage"] for p in a.provenance()] == ["value"]
    assert a.dispatch(upper_node(), body).decision == Miss()


def test_an_executor_exception_is_a_failed_outcome(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "x"})

    def boom(root: Path) -> None:
        raise RuntimeError("the step itself failed")

    res = a.dispatch(upper_node(), boom)
    assert res.outcome == "failed" and isinstance(res.error, RuntimeError)
    assert a.dispatcher.local.rows() == []


def test_a_workspace_changed_underneath_is_a_failed_materialization_conflict(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "x"})

    def racing(root: Path) -> int:
        upper(root)
        (a.ws / "out.txt").write_text("someone else wrote this meanwhile")
        return 1

    res = a.dispatch(upper_node(), racing)
    assert res.outcome == "failed" and isinstance(res.error, MaterializationConflict)
    assert (a.ws / "out.txt").read_text() == "someone else wrote this meanwhile"


def test_on_settled_commits_with_the_local_row_and_a_failing_hook_leaves_no_row(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "x"})
    seen: list[tuple[str, bool]] = []

    def hook(conn: Any, result: Any) -> None:
        seen.append((result.outcome, a.db.in_write()))

    res = a.dispatch(upper_node(), upper, on_settled=hook)
    assert res.outcome == "built" and seen == [("built", True)]
    a.dispatch(upper_node(), upper, on_settled=hook)
    assert seen[-1] == ("clean", True)

    b = machines("b", files={"in.txt": "y"})

    def broken(conn: Any, result: Any) -> None:
        raise ValueError("the caller's attempt row could not be written")

    with pytest.raises(ValueError):
        b.dispatch(upper_node(), upper, on_settled=broken)
    assert b.dispatcher.local.rows() == []  # rolled back with the hook: the row never outlives its attempt


def test_bad_requests_are_refused_before_anything_is_written(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "x"})
    good = a.request(upper_node())
    import dataclasses

    for bad, code in (
        (dataclasses.replace(good, key="not-a-key"), "key_uncomputable"),
        (dataclasses.replace(good, tier="eternal"), "invalid_declaration"),  # type: ignore[arg-type]
        (dataclasses.replace(good, components={"x": float("nan")}), "invalid_declaration"),
        (dataclasses.replace(good, workspace=a.root), "invalid_declaration"),
    ):
        with pytest.raises(CacheError) as err:
            a.dispatcher.dispatch(bad, upper)
        assert err.value.code == code
    assert a.calls["upper"] == 0 and a.dispatcher.local.rows() == []


def test_a_reused_request_is_served_without_walking_its_components_again(
    machines: Machines, monkeypatch: pytest.MonkeyPatch
) -> None:
    import smthrs_plugin.cache._request_check as check_module

    a = machines("a", files={"in.txt": "x"})
    request = a.request(upper_node(), consult_shared=False)
    walked: list[object] = []
    real = check_module.canonical_bytes
    monkeypatch.setattr(check_module, "canonical_bytes", lambda v: walked.append(v) or real(v))
    assert a.dispatcher.dispatch(request, upper).outcome == "built"
    assert len(walked) == 1  # checked once, not again by the build
    for _ in range(3):
        assert a.dispatcher.dispatch(request, upper).outcome == "clean"
    assert len(walked) == 1  # the same mapping: a hit never stores it, nothing to walk
    copy = dataclasses.replace(request, components=dict(request.components))
    assert a.dispatcher.dispatch(copy, upper).outcome == "clean"
    assert len(walked) == 2  # another mapping is walked


def test_components_changed_in_place_after_a_hit_are_refused_before_the_build_runs(
    machines: Machines,
) -> None:
    a = machines("a", files={"in.txt": "x"})
    request = a.request(upper_node(), consult_shared=False)
    ran: list[Path] = []

    def counted(root: Path) -> Any:
        ran.append(root)
        return upper(root)

    assert a.dispatcher.dispatch(request, counted).outcome == "built"
    assert a.dispatcher.dispatch(request, counted).outcome == "clean"
    request.components["environment"] = {"x": float("nan")}  # type: ignore[index]
    rows = a.dispatcher.local.rows()
    # A refresh builds at once: walked before its refresh invalidates the row.
    with pytest.raises(CacheError) as err:
        a.dispatcher.dispatch(dataclasses.replace(request, refresh=True), counted)
    assert err.value.code == "invalid_declaration"
    assert len(ran) == 1 and a.dispatcher.local.rows() == rows
    # A consult that ends in a build (its input changed since: a stale read set) walks the mapping it
    # remembered as checked.
    (a.ws / "in.txt").write_text("changed")
    with pytest.raises(CacheError) as err:
        a.dispatcher.dispatch(request, counted)
    assert err.value.code == "invalid_declaration"
    assert len(ran) == 1


def test_the_run_local_row_is_keyed_by_run_so_another_run_never_finds_it(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "x"})
    draft = upper_node(boundary="expected")
    res = a.dispatch(draft, upper)
    (row,) = a.dispatcher.local.rows()
    assert row.key == res.key and row.key_digest != key_digest(res.key) and row.run_id == "r1"


def test_the_public_export_is_the_dispatcher() -> None:
    assert CacheDispatcher.__module__ == "smthrs_plugin.cache.dispatch"


def test_a_read_that_cannot_be_re_measured_is_unmeasurable_and_the_failure_is_an_outcome(
    machines: Machines, tmp_path: Path
) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    a.dispatch(upper_node(), upper, consult_shared=False)
    keyed = a.request(upper_node(), consult_shared=False)
    outside = tmp_path / "outside.txt"
    outside.write_text("not in the workspace")
    (a.ws / "in.txt").unlink()
    (a.ws / "in.txt").symlink_to(outside)  # now resolves outside the workspace: refused by the measurer
    res = a.dispatcher.dispatch(keyed, upper)
    assert res.decision is not None and res.decision.tag == "Unmeasurable"
    assert res.outcome == "failed" and getattr(res.error, "code", None) == "invalid_path"
    assert a.metrics.decisions == {"Miss": 1, "Unmeasurable": 1}


def test_a_broken_local_artifact_store_is_a_storage_failure_not_a_node_failure(machines: Machines) -> None:
    from smthrs_plugin.errors import ArtifactError

    a = machines("a", files={"in.txt": "hello\n"})
    broken = a.root / "broken-blobs"
    broken.write_text("a file where the local blob directory should be")
    a.dispatcher.artifacts = ArtifactStore(broken.as_uri())
    with pytest.raises(ArtifactError) as err:
        a.dispatch(upper_node(), upper)
    assert err.value.code == "unavailable"
    assert a.dispatcher.local.rows() == []
