"""Shared-tier publication in the background: ``queued`` at return, the final status once drained, failures
surfaced as inline ones are, a bounded queue, per-key order, and a crash that loses only the publication."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _cache_support import Machine, make_machine, upper, upper_node

import smthrs_plugin as sp
from smthrs_plugin.cache._publisher import BackgroundPublisher, Marker, Publication, Spool, recover
from smthrs_plugin.cache.model import VerifiedHit
from smthrs_plugin.cache.requests import node_request
from smthrs_plugin.cache.shared import Candidate
from smthrs_plugin.stores.artifacts import ArtifactStore

HELLO = {"in.txt": "hello\n"}
DEADLINE_S = 120.0


def hold(machine: Machine) -> tuple[threading.Event, threading.Event]:
    """Hold the machine's publisher: ``entered`` is set when its worker starts a publication, which waits for
    ``gate``."""
    publisher = machine.dispatcher._publisher
    assert publisher is not None
    entered, gate = threading.Event(), threading.Event()
    run = publisher._run

    def held(pub: Publication) -> str:
        entered.set()
        assert gate.wait(DEADLINE_S)
        return run(pub)

    publisher._run = held
    return entered, gate


def published_entry(machine: Machine, key: str) -> Candidate | None:
    judged = machine.dispatcher.shared.read(machine.entry_name(key))
    return judged if isinstance(judged, Candidate) else None


def shout(root: Path) -> dict[str, Any]:
    """The same declaration as ``upper``, another result."""
    text = (root / "in.txt").read_text()
    (root / "out.txt").write_text(text.upper() + "!")
    return {"length": len(text) + 1}


def numbered(i: int) -> tuple[Any, Callable[[Path], Any]]:
    draft = sp.plan.node(f"n{i}", body={"cmd": f"n{i}"}, reads=["in.txt"], writes=[f"out{i}.txt"])

    def body(root: Path) -> int:
        (root / f"out{i}.txt").write_text((root / "in.txt").read_text() * i)
        return i

    return draft, body


def test_a_background_publication_answers_queued_then_its_final_status_once_drained(
    machines: Callable[..., Machine],
) -> None:
    a = machines("a", files=HELLO, background=True)
    entered, gate = hold(a)
    res = a.dispatch(upper_node(), upper)
    assert (res.outcome, res.published) == ("built", {"local": "published", "shared": "queued"})
    assert entered.wait(DEADLINE_S)
    assert published_entry(a, res.key) is None  # the local commit is done; the shared entry is not yet
    assert list((a.root / "spool").rglob("*.json"))  # ... and its marker says so
    gate.set()
    a.dispatcher.drain()
    assert res.final_published() == {"local": "published", "shared": "published"}
    candidate = published_entry(a, res.key)
    assert candidate is not None and candidate.entry.result == a.dispatcher.local.lookup(res.key).entry.result
    assert not list((a.root / "spool").rglob("*.json"))
    b = machines("b", files=HELLO)
    served = b.dispatch(upper_node(), upper)
    assert (served.outcome, served.decision, b.calls["upper"]) == ("clean", VerifiedHit("shared"), 0)


def test_close_waits_for_every_queued_publication(tmp_path: Path) -> None:
    shared = ArtifactStore((tmp_path / "shared").as_uri())
    a = make_machine(tmp_path, "a", shared, files=HELLO, background=True)
    _, gate = hold(a)
    results = [a.dispatch(*numbered(i)) for i in range(1, 5)]
    assert {r.published["shared"] for r in results} == {"queued"}
    closing = threading.Thread(target=a.dispatcher.close)
    closing.start()
    gate.set()
    closing.join(DEADLINE_S)
    assert not closing.is_alive()
    assert all(r.publication is not None and r.publication.done() for r in results)
    assert all(published_entry(a, r.key) is not None for r in results)
    # Closed: a later build publishes inline, before it returns.
    late = a.dispatch(*numbered(5))
    assert late.published["shared"] == "published" and published_entry(a, late.key) is not None


def test_a_full_queue_makes_the_producer_publish_inline_and_drops_nothing(tmp_path: Path) -> None:
    shared = ArtifactStore((tmp_path / "shared").as_uri())
    a = make_machine(tmp_path, "a", shared, files=HELLO, background=True)
    publisher = a.dispatcher._publisher
    assert publisher is not None
    publisher.capacity = 0
    res = a.dispatch(upper_node(), upper)
    assert res.published == {"local": "published", "shared": "published"} and res.publication is None
    assert published_entry(a, res.key) is not None
    assert not list((a.root / "spool").rglob("*.json"))


def test_the_publisher_queue_is_bounded_and_runs_in_offer_order() -> None:
    ran: list[str] = []
    started, gate = threading.Event(), threading.Event()

    def run(pub: Publication) -> str:
        started.set()
        assert gate.wait(DEADLINE_S)
        ran.append(pub.key)
        return "published"

    publisher = BackgroundPublisher(run, capacity=1)
    a, b, c = (_publication(k) for k in ("k1", "k2", "k3"))
    assert publisher.offer(a)
    assert started.wait(DEADLINE_S)  # k1 is running: the queue is empty again
    assert publisher.offer(b)
    assert not publisher.offer(c)  # full: its producer publishes it itself
    gate.set()
    publisher.close()
    assert ran == ["k1", "k2"] and a.future.result(0) == b.future.result(0) == "published"
    assert not c.future.done()


def test_drain_raises_what_a_background_publication_met() -> None:
    def run(pub: Publication) -> str:
        raise OSError("the database is gone")

    publisher = BackgroundPublisher(run)
    pub = _publication("k1")
    assert publisher.offer(pub)
    with pytest.raises(OSError, match="database is gone"):
        publisher.drain()
    publisher.close()  # raised once: the next drain has nothing left to report
    with pytest.raises(OSError):
        pub.future.result(0)


def _publication(key: str) -> Publication:
    """A publication the publisher itself never opens (its run does): only its size and name are read."""
    entry: Any = SimpleNamespace(evidence=SimpleNamespace(inline_bytes=0), name=key)
    return Publication("r1", "n", key, entry, {})


def test_a_failed_background_publication_is_journaled_and_warned_once_drained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    (root / "ac").write_text("a file where the entry directory should be")  # publishing an entry fails
    a = make_machine(tmp_path, "a", ArtifactStore(root.as_uri()), files=HELLO, background=True)
    with caplog.at_level(logging.WARNING, logger="smthrs_plugin.cache.dispatch"):
        res = a.dispatch(upper_node(), upper)
        assert res.published["shared"] == "queued"
        a.dispatcher.drain()
    assert res.final_published()["shared"] == "unpublished:entry"
    assert [p["stage"] for p in a.provenance() if p["action"] == "unpublished"] == ["entry"]
    assert any("stage entry" in r.getMessage() for r in caplog.records)
    again = a.dispatch(upper_node(), upper)  # the local tier keeps it
    assert (again.outcome, again.decision) == ("clean", VerifiedHit("local"))


def test_a_rival_published_while_ours_was_queued_makes_this_host_follow_the_rival(
    machines: Callable[..., Machine],
) -> None:
    a = machines("a", files=HELLO, background=True)
    b = machines("b", files=HELLO)
    entered, gate = hold(a)
    ours = a.dispatch(upper_node(), upper)
    assert ours.published["shared"] == "queued" and entered.wait(DEADLINE_S)
    theirs = b.dispatch(upper_node(), shout)  # the same key, another result, published first
    assert theirs.published["shared"] == "published"
    gate.set()
    a.dispatcher.drain()
    assert ours.final_published()["shared"] == "unpublished:result_mismatch"
    prov = a.provenance()
    assert {"action": "invalidated", "reason": "result-mismatch"}.items() <= prov[-2].items()
    assert {"action": "unpublished", "stage": "result_mismatch"}.items() <= prov[-1].items()
    follow = a.dispatch(upper_node(), upper, run_id="r2")
    assert (follow.outcome, follow.decision, follow.value) == ("clean", VerifiedHit("shared"), {"length": 7})


def test_a_same_key_dispatch_waits_for_the_queued_publication_of_that_key(tmp_path: Path) -> None:
    shared = ArtifactStore((tmp_path / "shared").as_uri())
    a = make_machine(tmp_path, "a", shared, files=HELLO, background=True)
    entered, gate = hold(a)
    first = a.dispatch(upper_node(), upper)
    assert entered.wait(DEADLINE_S)
    refreshed: list[Any] = []
    refresh = dataclasses.replace(a.request(upper_node(), "r2"), refresh=True)
    worker = threading.Thread(target=lambda: refreshed.append(a.dispatcher.dispatch(refresh, shout)))
    worker.start()
    gate.set()
    worker.join(DEADLINE_S)
    assert not worker.is_alive()
    a.dispatcher.drain()
    # The refresh saw the first entry published, so it replaced it (never a mismatch with an older build).
    assert first.final_published()["shared"] == "published"
    assert refreshed[0].final_published()["shared"] == "published"
    candidate = published_entry(a, first.key)
    assert candidate is not None and candidate.entry.value == {"length": 7}


# -- a crash after the local commit --------------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import sys, threading
    from pathlib import Path
    import smthrs_plugin as sp
    from smthrs_plugin.cache.requests import node_request

    ws = Path(sys.argv[1])
    rt = sp.open_runtime(ws)
    seam = rt.dispatcher
    entered, never = threading.Event(), threading.Event()

    def held(pub):
        entered.set()
        never.wait()

    seam._publisher._run = held  # the worker stops right before the shared tier is written

    def upper(root):
        text = (root / "in.txt").read_text()
        (root / "out.txt").write_text(text.upper())
        return {"length": len(text)}

    draft = sp.plan.node("upper", body={"cmd": "upper"}, reads=["in.txt"], writes=["out.txt"])
    res = seam.dispatch(node_request(draft, run_id="crash-1", workspace=ws, measurer=seam.measurer), upper)
    assert res.published["shared"] == "queued", res.published
    assert entered.wait(120)
    print("COMMITTED", res.key, flush=True)
    never.wait()
    """
)


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMTHRS_")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(sp.__file__).parents[1]), env.get("PYTHONPATH", "")])
    return env


def test_a_process_killed_after_the_local_commit_loses_only_the_publication_the_next_runtime_republishes(
    tmp_path: Path,
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "in.txt").write_text("hello\n")
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(ws)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(),
    )
    try:
        line = child.stdout.readline() if child.stdout is not None else ""
        assert line.startswith("COMMITTED "), (line, child.stderr.read() if child.stderr else "")
        key = line.split()[1]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(DEADLINE_S)
    with sp.open_runtime(ws) as rt:
        tiers = rt.cache_tiers()
        # The local commit survived the kill; the publication did not; its marker did.
        assert [r.key for r in tiers.local.rows()] == [key]
        assert tiers.shared.names() == []
        assert len(list((ws / ".smthrs/publishing").rglob("*.json"))) == 1
        seam = rt.dispatcher  # built: it republishes what the killed process left
        rt.drain_publications()
        [name] = tiers.shared.names()
        signer = seam.trust.signer
        assert signer is not None and isinstance(seam.shared.read(name), Candidate)
        assert name.startswith(tiers.local.rows()[0].key_digest) and signer.key_id in name
        assert not list((ws / ".smthrs/publishing").rglob("*.json"))
        request = node_request(upper_node(), run_id="after", workspace=ws, measurer=seam.measurer)
        again = seam.dispatch(request, upper)
        assert (again.outcome, again.decision) == ("clean", VerifiedHit("local"))


def test_a_marker_whose_build_never_committed_is_dropped_and_a_live_process_marker_is_left(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(DEADLINE_S)
    spool = Spool(tmp_path / "spool", "host-a")
    mine = spool.write(Marker("key1_" + "0" * 64, "r1", "n", 1, {}))
    assert mine is not None
    orphan = mine.with_name(f"{gone.pid}-0.json")
    orphan.write_bytes(mine.read_bytes())
    a = make_machine(tmp_path, "a", ArtifactStore((tmp_path / "shared").as_uri()), files=HELLO)
    publisher = BackgroundPublisher(a.dispatcher._publish_queued, spool=spool)
    assert recover(spool, publisher, a.dispatcher.local.lookup, a.dispatcher._publish_queued) == 0
    assert not orphan.exists()  # no local row: nothing of that build to publish
    assert mine.exists()  # this (live) process's own marker is its publisher's business
    publisher.close()


def test_a_runtime_closed_after_a_plan_run_has_published_every_built_node(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    nodes = [sp.plan.node(f"n{i}", body={"i": i}) for i in range(6)]
    plan = sp.plan.compile_plan("bg", "bg/plan", nodes)
    with sp.open_runtime(ws) as rt:
        report = rt.scheduler("bg-1").run(plan, lambda ni: 0)
        assert {s.outcome for s in report.settlements} == {"built"}
    with sp.open_runtime(ws) as rt:
        assert len(rt.cache_tiers().shared.names()) == 6
    assert not list((ws / ".smthrs/publishing").rglob("*.json"))


def test_a_queued_publications_records_are_fenced_by_its_runs_owner(tmp_path: Path) -> None:
    """A publication still queued when its run is no longer its owner's (settled here; a takeover alike) writes
    nothing into that run's journal: its record is refused by the fence and the refusal reaches whoever drains."""
    from smthrs_plugin.engine.ownership.arbiter import Ownership
    from smthrs_plugin.errors import FenceLost
    from smthrs_plugin.records.runs import OwnerId, RunStore
    from smthrs_plugin.settings import load_settings

    root = tmp_path / "shared"
    root.mkdir()
    (root / "ac").write_text("a file where the entry directory should be")  # the publication fails: a record
    a = make_machine(tmp_path, "a", ArtifactStore(root.as_uri()), files=HELLO, background=True)
    runs = RunStore(a.db, journal=a.journal)
    runs.create("r1", "flow")
    me = OwnerId("host-a", 1, "nonce-me")
    Ownership(a.db, owner=me, settings=load_settings(host_id="host-a")).claim("r1")
    entered, gate = hold(a)
    res = a.dispatch(upper_node(), upper, owner=me)
    assert res.published["shared"] == "queued" and entered.wait(DEADLINE_S)
    runs.finish("r1", me, "completed")
    before = a.journal.read("r1", limit=1000)
    gate.set()
    with pytest.raises(FenceLost):
        a.dispatcher.drain()
    assert a.journal.read("r1", limit=1000) == before


def test_a_plan_run_returns_after_the_publications_its_builds_queued(tmp_path: Path) -> None:
    """A pass waits for its queued publications before it returns (their records are fenced by its owner): the
    shared tier holds every built node as soon as ``run`` returns, with the runtime still open."""
    ws = tmp_path / "ws"
    ws.mkdir()
    nodes = [sp.plan.node(f"n{i}", body={"i": i}) for i in range(6)]
    plan = sp.plan.compile_plan("bg", "bg/plan", nodes)
    with sp.open_runtime(ws) as rt:
        rt.scheduler("bg-1").run(plan, lambda ni: 0)
        assert len(rt.cache_tiers().shared.names()) == 6
