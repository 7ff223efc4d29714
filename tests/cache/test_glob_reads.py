"""Glob and tree reads are cached across runs by their expansion: the sorted matched paths with the digest of each.

The key folds the expansion, the entry records it, and a hit expands the declared reads again on the serving
workspace: only an identical expansion (same paths, same digests) is served, from the local or the shared tier.
The hermetic sandbox seeds exactly that expansion — every body below returns the files it could see, to show it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _cache_support import Machine, team_trust
from typer.testing import CliRunner

import smthrs_plugin as sp
from smthrs_plugin.boundary import Measurer
from smthrs_plugin.boundary.evidence import Evidence
from smthrs_plugin.cache import CacheDispatcher, Miss, StaleReadSet, UnverifiableEvidence, VerifiedHit
from smthrs_plugin.cache.admission import NotAdmissible, admit_entry, declared_run_local_reason
from smthrs_plugin.cache.entry import CacheEntry, decode_entry
from smthrs_plugin.cache.explain import explain
from smthrs_plugin.cache.requests import node_request
from smthrs_plugin.cache.shared import sign_document
from smthrs_plugin.plan.compile import compile_plan
from smthrs_plugin.prefect.step import step
from smthrs_plugin.prefect.workspace import Workspace
from smthrs_plugin.runtime import open_runtime
from smthrs_plugin.stores.artifacts import ArtifactStore
from smthrs_plugin.stores.database import open_database

Machines = Callable[..., Machine]

HERE = Path(__file__).resolve().parent
#: The workspace every test starts from: two matching files and one the glob ``data/*.csv`` does not match.
FILES = {"data/a.csv": "1\n", "data/b.csv": "2\n", "data/notes.txt": "not a csv\n"}
#: Where the process test's step appends one line per body call (read from the environment: not in the key).
CALLS_ENV = "SMTHRS_TEST_GLOB_CALLS"
PROCESS_TIMEOUT_S = 180


def _seen_and_total(root: Path) -> dict[str, Any]:
    """Every file the body can see under ``data/`` and the sum of the ``.csv`` ones; writes ``out/total.txt``."""
    seen = sorted(p.relative_to(root).as_posix() for p in (root / "data").rglob("*") if p.is_file())
    total = sum(int((root / p).read_text()) for p in seen if p.endswith(".csv"))
    (root / "out").mkdir(exist_ok=True)
    (root / "out" / "total.txt").write_text(f"{total}\n")
    return {"seen": seen, "total": total}


def _glob_node(reads: str = "data/*.csv") -> sp.plan.NodeDraft:
    return sp.plan.node("totals", body={"cmd": "totals"}, reads=[reads], writes=["out/total.txt"])


def _tag(res: Any) -> str | None:
    return res.decision.tag if res.decision is not None else None


# -- the local tier: two runs over one database ------------------------------------------------------------------


def test_a_glob_read_hits_across_runs_when_nothing_changed(machines: Machines) -> None:
    a = machines("a", files=FILES)
    built = a.dispatch(_glob_node(), _seen_and_total, run_id="r1")
    assert (built.outcome, built.decision) == ("built", Miss())
    assert built.published == {"local": "published", "shared": "published"}
    # the hermetic sandbox held exactly the expansion: notes.txt was invisible to the body
    assert built.value == {"seen": ["data/a.csv", "data/b.csv"], "total": 3}
    assert [p for p, _ in built.evidence.read_set] == ["data/a.csv", "data/b.csv"]

    again = a.dispatch(_glob_node(), _seen_and_total, run_id="r2")
    assert (again.outcome, again.decision, again.value) == ("clean", VerifiedHit("local"), built.value)
    assert a.calls["totals"] == 1 and (a.ws / "out/total.txt").read_text() == "3\n"


def test_a_new_matching_file_rebuilds_with_the_new_value(machines: Machines) -> None:
    a = machines("a", files=FILES)
    first = a.dispatch(_glob_node(), _seen_and_total, run_id="r1")
    a.write("data/c.csv", "4\n")
    second = a.dispatch(_glob_node(), _seen_and_total, run_id="r2")
    assert (second.outcome, second.decision) == ("built", Miss()) and second.key != first.key
    assert second.value == {"seen": ["data/a.csv", "data/b.csv", "data/c.csv"], "total": 7}
    assert (a.ws / "out/total.txt").read_text() == "7\n"
    third = a.dispatch(_glob_node(), _seen_and_total, run_id="r3")
    assert (third.decision, third.value) == (VerifiedHit("local"), second.value)
    assert a.calls["totals"] == 2


def test_a_removed_matching_file_rebuilds(machines: Machines) -> None:
    a = machines("a", files=FILES)
    a.dispatch(_glob_node(), _seen_and_total, run_id="r1")
    (a.ws / "data/b.csv").unlink()
    res = a.dispatch(_glob_node(), _seen_and_total, run_id="r2")
    assert (res.outcome, res.decision, res.value) == ("built", Miss(), {"seen": ["data/a.csv"], "total": 1})
    assert a.calls["totals"] == 2


def test_a_changed_matched_file_rebuilds(machines: Machines) -> None:
    a = machines("a", files=FILES)
    a.dispatch(_glob_node(), _seen_and_total, run_id="r1")
    a.write("data/a.csv", "10\n")
    res = a.dispatch(_glob_node(), _seen_and_total, run_id="r2")
    assert (res.outcome, res.decision) == ("built", Miss()) and res.value["total"] == 12
    assert a.calls["totals"] == 2


def test_a_file_the_glob_does_not_match_changes_nothing(machines: Machines) -> None:
    a = machines("a", files=FILES)
    built = a.dispatch(_glob_node(), _seen_and_total, run_id="r1")
    a.write("data/notes.txt", "edited notes\n")
    a.write("data/more-notes.txt", "new notes\n")
    a.write("data/sub/deep.csv", "100\n")  # `*` is one segment: data/*.csv does not match below data/sub/
    res = a.dispatch(_glob_node(), _seen_and_total, run_id="r2")
    assert (res.outcome, res.decision, res.value) == ("clean", VerifiedHit("local"), built.value)
    assert a.calls["totals"] == 1


def test_a_tree_read_is_cached_by_its_expansion_too(machines: Machines) -> None:
    a = machines("a", files=FILES)
    tree = _glob_node("data/")
    built = a.dispatch(tree, _seen_and_total, run_id="r1")
    assert built.published["shared"] == "published"
    assert built.value == {"seen": ["data/a.csv", "data/b.csv", "data/notes.txt"], "total": 3}
    assert a.dispatch(tree, _seen_and_total, run_id="r2").decision == VerifiedHit("local")

    a.write("data/notes.txt", "edited\n")  # every file below the tree is in its expansion
    edited = a.dispatch(tree, _seen_and_total, run_id="r3")
    assert (edited.outcome, edited.decision) == ("built", Miss())
    a.write("data/sub/c.csv", "4\n")  # so is a new one, however deep
    deeper = a.dispatch(tree, _seen_and_total, run_id="r4")
    assert (deeper.outcome, deeper.value["total"]) == ("built", 7)
    (a.ws / "data/sub/c.csv").unlink()
    removed = a.dispatch(tree, _seen_and_total, run_id="r5")
    assert (removed.decision, removed.value) == (VerifiedHit("local"), edited.value)  # back to r3's expansion
    assert a.calls["totals"] == 3


# -- the shared tier: another database, the same shared artifact root ------------------------------------------


def test_the_shared_tier_serves_a_glob_entry_only_for_an_identical_expansion(machines: Machines) -> None:
    a = machines("a", files=FILES)
    built = a.dispatch(_glob_node(), _seen_and_total, run_id="r1")

    same = machines("same", files={**FILES, "data/notes.txt": "other notes\n"})  # not matched: irrelevant
    hit = same.dispatch(_glob_node(), _seen_and_total, run_id="r2")
    assert (hit.outcome, hit.decision, hit.value) == ("clean", VerifiedHit("shared"), built.value)
    assert (same.ws / "out/total.txt").read_text() == "3\n" and same.calls["totals"] == 0

    for name, files, total in (
        ("more", {**FILES, "data/c.csv": "4\n"}, 7),
        ("fewer", {"data/a.csv": "1\n"}, 1),
        ("changed", {**FILES, "data/b.csv": "20\n"}, 21),
    ):
        m = machines(name, files=files)
        res = m.dispatch(_glob_node(), _seen_and_total, run_id=f"r-{name}")
        assert (res.outcome, res.decision, res.value["total"]) == ("built", Miss(), total), name
        assert m.calls["totals"] == 1


def test_a_request_measured_before_a_new_matching_file_appeared_is_never_served(machines: Machines) -> None:
    """The request's own read set can be older than the hit (a run's source pins are): the serve re-expands the
    glob itself, in the local tier (the remembered fast path included) and in the shared tier."""
    a = machines("a", files=FILES)
    early = a.request(_glob_node(), run_id="r1")
    a.dispatcher.dispatch(early, _seen_and_total)
    assert a.dispatcher.dispatch(early, _seen_and_total).decision == VerifiedHit("local")  # now remembered
    a.write("data/c.csv", "4\n")
    local = a.dispatcher.dispatch(early, _seen_and_total)
    assert isinstance(local.decision, StaleReadSet)
    assert [(p, old) for p, old, _ in local.decision.changed] == [("data/c.csv", "absent")]
    assert local.outcome == "built" and local.value["total"] == 7
    assert local.published["local"] == "run-local"  # built from other files than its key names

    b = machines("b", files=FILES)
    keyed = b.request(_glob_node(), run_id="r2")  # the key a published under
    (b.ws / "data/b.csv").unlink()
    shared = b.dispatcher.dispatch(keyed, _seen_and_total)
    assert isinstance(shared.decision, StaleReadSet)
    assert [(p, new) for p, _, new in shared.decision.changed] == [("data/b.csv", None)]
    assert shared.outcome == "built" and shared.value["total"] == 1


def test_a_remembered_hit_is_not_served_from_memory_once_a_new_file_matches_the_glob(tmp_path: Path) -> None:
    """The remembered fast path re-checks the recorded files by stat, which cannot see a file newly matching: it
    walks the glob too. (The measurer's clock runs ahead so the stat cache trusts the files, as in the hit-memo
    tests: otherwise the racy-timestamp rule alone would send every hit down the full path.)"""
    ws = tmp_path / "ws"
    for rel, text in FILES.items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    measurer = Measurer(ws, clock_ns=lambda: time.time_ns() + 10_000_000_000)
    dispatcher = CacheDispatcher(
        open_database(f"sqlite:///{(tmp_path / 'state.db').as_posix()}"),
        ArtifactStore((tmp_path / "blobs").as_uri()),
        ws,
        measurer=measurer,
        trust=team_trust(tmp_path),
    )
    early = node_request(
        _glob_node(), run_id="r1", workspace=ws, measurer=measurer, consult_shared=False, publish_shared=False
    )
    assert dispatcher.dispatch(early, _seen_and_total).outcome == "built"
    assert dispatcher.dispatch(early, _seen_and_total).decision == VerifiedHit("local")  # verified in full
    measured = measurer.stats.cached + measurer.stats.hashed
    assert dispatcher.dispatch(early, _seen_and_total).decision == VerifiedHit("local")
    assert measurer.stats.cached + measurer.stats.hashed == measured, "expected a hit served from memory"

    (ws / "data/c.csv").write_text("4\n")
    res = dispatcher.dispatch(early, _seen_and_total)
    assert isinstance(res.decision, StaleReadSet) and res.value["total"] == 7


def test_a_forged_shared_entry_whose_expansion_omits_a_file_that_exists_now_is_never_served(
    machines: Machines,
) -> None:
    a = machines("a", files=FILES)
    honest = a.dispatch(_glob_node(), _seen_and_total, run_id="r1")
    b = machines("b", files={**FILES, "data/c.csv": "4\n"})
    wanted = b.request(_glob_node(), run_id="r2").key  # folds data/c.csv
    # A trusted publisher files a's entry (total 3, expansion without c.csv) under b's key, claims intact.
    doc = json.loads(a.shared.get_entry(a.entry_name(honest.key)) or b"")
    doc = {k: v for k, v in doc.items() if k != "signature"}
    doc["key"] = wanted
    forged = decode_entry(json.dumps(doc))
    assert isinstance(forged, CacheEntry) and forged.admission["readsExpanded"] is True
    a.shared.put_entry(b.entry_name(wanted), sign_document(forged, a.dispatcher.trust))

    res = b.dispatch(_glob_node(), _seen_and_total, run_id="r2")
    assert isinstance(res.decision, UnverifiableEvidence) and "read set" in res.decision.reason
    assert (res.outcome, res.value["total"], b.calls["totals"]) == ("built", 7, 1)
    assert (b.ws / "out/total.txt").read_text() == "7\n"


# -- what stays run-local, and says so ---------------------------------------------------------------------------


def test_a_glob_read_whose_body_saw_the_whole_tree_stays_run_local(machines: Machines) -> None:
    a = machines("a", files=FILES)
    res = a.dispatch(_glob_node(), _seen_and_total, run_id="r1", sandbox="whole-tree")
    assert res.value["seen"] == ["data/a.csv", "data/b.csv", "data/notes.txt"]  # it could see beyond the glob
    assert res.published == {"local": "run-local", "shared": "unpublished:reads_expanded"}
    assert a.shared.list_entries() == []
    other = a.dispatch(_glob_node(), _seen_and_total, run_id="r2", sandbox="whole-tree")
    assert other.decision == Miss() and a.calls["totals"] == 2


def test_an_entry_without_the_expansion_claim_is_not_admitted_for_a_glob_read() -> None:
    ev = Evidence((), (), "d", (), True, True, (("data/a.csv", "a" * 64),), "hard")
    claims = {"tier": "sealed", "allReadsExact": False, "readSetVerified": True, "nondeterministic": False}
    refused = admit_entry(claims, ev)
    assert isinstance(refused, NotAdmissible) and refused.conjunct == "reads_expanded"
    assert not isinstance(admit_entry({**claims, "readsExpanded": True}, ev), NotAdmissible)


def test_cache_explain_names_the_reason_an_entry_was_kept_run_local(machines: Machines) -> None:
    a = machines("a", files=FILES)
    for run in ("r1", "r2"):
        a.dispatch(_glob_node(), _seen_and_total, run_id=run, sandbox="whole-tree")
    explained = explain(a.dispatcher.local, "totals")
    assert explained.run_local is not None and explained.run_local.conjunct == "reads_expanded"
    text = "\n".join(explained.lines())
    assert "kept run-local" in text and "glob or a tree" in text and "first entry" not in text

    runner = CliRunner()
    from smthrs_plugin.cli import app

    opts = ["--db", a.db.url, "--workspace", str(a.ws)]
    shown = runner.invoke(app, ["cache", "explain", "totals", *opts])
    assert shown.exit_code == 0, shown.output
    assert "kept run-local" in shown.output and "hermetic sandbox" in shown.output
    as_json = runner.invoke(app, ["cache", "explain", "totals", *opts, "--json"])
    assert json.loads(as_json.output)["run_local"]["conjunct"] == "reads_expanded"

    b = machines("b", files=FILES)
    b.dispatch(_glob_node(), _seen_and_total, run_id="r1")  # admitted: nothing to say but "first entry"
    shared = explain(b.dispatcher.local, "totals")
    assert shared.run_local is None and shared.status == "first-entry"


def test_a_step_declared_run_local_warns_once_at_decoration(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="smthrs_plugin.prefect.step"):

        @step(reads=["data/*.csv"], writes=["out/x.txt"], tier="compensable")
        def compensable(ws: Workspace) -> int:
            return 1

        @step(reads=["data/*.csv"], writes=["out/x.txt"], boundary="expected")
        def expected(ws: Workspace) -> int:
            return 1

        @step(reads=["data/*.csv", "data/"], writes=["out/x.txt"])
        def shareable(ws: Workspace) -> int:
            return 1

    warned = [r.getMessage() for r in caplog.records if r.name == "smthrs_plugin.prefect.step"]
    assert len(warned) == 2, warned
    assert "compensable" in warned[0] and "tier 'compensable' is not sealed" in warned[0]
    assert "expected" in warned[1] and "boundary mode 'expected'" in warned[1]
    assert declared_run_local_reason(shareable.step_spec.draft({})) is None  # globs and trees are shareable


# -- real callers: the scheduler's plan nodes and @step in separate processes ------------------------------------


def _plan_totals(ni: Any) -> Any:
    return _seen_and_total(ni.root)


def test_a_plan_node_with_a_glob_read_hits_in_the_next_run_and_rebuilds_on_a_new_file(tmp_path: Path) -> None:
    for rel, text in FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    plan = compile_plan("p", "f", [_glob_node()])
    with open_runtime(workspace=tmp_path) as rt:
        outcomes = []
        for run_id in ("r1", "r2"):
            outcomes += [s.outcome for s in rt.scheduler(run_id).run(plan, _plan_totals).settlements]
        (tmp_path / "data/c.csv").write_text("4\n")
        outcomes += [s.outcome for s in rt.scheduler("r3").run(plan, _plan_totals).settlements]
    assert outcomes == ["built", "clean", "built"]
    assert (tmp_path / "out/total.txt").read_text() == "7\n"


@step(reads=["data/*.csv"], writes=["out/total.txt"])
def csv_total(ws: Workspace) -> dict[str, Any]:
    """The process test's step: one line in the calls file per body call."""
    calls = os.environ.get(CALLS_ENV)
    if calls:
        with open(calls, "a") as f:
            f.write("call\n")
    return _seen_and_total(Path(ws))


def _step_in_a_new_process(ws: Path, state: Path, calls: Path) -> dict[str, Any]:
    """Call ``csv_total`` in a fresh Python process: its own runtime over the given database and artifact store."""
    code = "\n".join(
        [
            "import json, sys",
            f"sys.path.insert(0, {str(HERE)!r})",
            "import test_glob_reads as t",
            "from smthrs_plugin.prefect.steprun import step_settings",
            f"with step_settings(workspace={str(ws)!r}, db={'sqlite:///' + (state / 'state.db').as_posix()!r},"
            f" artifacts={(state / 'blobs').as_uri()!r}):",
            "    print(json.dumps(t.csv_total.fn()))",
        ]
    )
    env = {**os.environ, CALLS_ENV: str(calls)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_glob_step_hits_in_a_second_process_sharing_the_database_and_artifact_store(tmp_path: Path) -> None:
    ws, state, calls = tmp_path / "ws", tmp_path / "state", tmp_path / "calls.log"
    for rel, text in FILES.items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    state.mkdir()

    def n_calls() -> int:
        return len(calls.read_text().splitlines()) if calls.exists() else 0

    first = _step_in_a_new_process(ws, state, calls)
    assert first == {"seen": ["data/a.csv", "data/b.csv"], "total": 3} and n_calls() == 1
    (ws / "data/notes.txt").write_text("edited, not matched\n")
    assert _step_in_a_new_process(ws, state, calls) == first and n_calls() == 1  # served, not run
    (ws / "data/c.csv").write_text("4\n")
    assert _step_in_a_new_process(ws, state, calls)["total"] == 7 and n_calls() == 2
