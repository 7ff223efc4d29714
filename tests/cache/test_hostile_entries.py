"""A hostile writer of the shared bucket costs a reader at most a re-run: whatever it plants at a trusted
publisher's entry name (a deeply nested array, an oversize document, a FIFO, a directory, duplicate member names,
a huge integer) is refused as absent — journaled ``cache-provenance {action: "refused"}`` and counted as an
``UnverifiableEvidence`` decision — and the step runs. The publisher never publishes what readers would refuse,
and ``smthrs cache verify --with-shared`` lists every planted document. On file://, memory:// and s3:// (moto)
where the attack applies."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import resource
import shutil
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from _cache_support import Machine, make_machine, team_trust, upper, upper_node
from typer.testing import CliRunner

import smthrs_plugin as sp
from smthrs_plugin.cache import UnverifiableEvidence, VerifiedHit
from smthrs_plugin.cache.dispatch import PROVENANCE_EVENT
from smthrs_plugin.cache.maintenance import gc, list_entries, revoke, verify
from smthrs_plugin.cache.model import Miss
from smthrs_plugin.cache.shared import SharedTier, entry_name
from smthrs_plugin.canonical import key_digest
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.stores.artifacts import MAX_ENTRY_BYTES, ArtifactStore
from smthrs_plugin.stores.database import open_database

Machines = Callable[..., Machine]
T = TypeVar("T")

#: 200 KB of nested arrays: past any parser's recursion limit.
DEEP = b"[" * 100_000 + b"]" * 100_000
#: Generous: only so that a regression (a reader blocked on a FIFO) cannot hang the suite.
DEADLINE_S = 120.0
HELLO = {"in.txt": "hello\n"}


def plant(store: ArtifactStore, name: str, data: bytes) -> None:
    """Replace whatever is at the entry's name with ``data``, behind the store's back (as a bucket writer would)."""
    path = store.entry_path(name)
    store.delete_entry(name)
    if store.kind == "local":
        os.makedirs(os.path.dirname(path), exist_ok=True)
    store.fs.pipe_file(path, data)


def plant_oversize(store: ArtifactStore, name: str) -> None:
    """One byte over the cap; on local disk a sparse 800 MB file (what once exhausted a reader's memory)."""
    if store.kind != "local":
        plant(store, name, b" " * (MAX_ENTRY_BYTES + 1))
        return
    store.delete_entry(name)
    os.makedirs(os.path.dirname(store.entry_path(name)), exist_ok=True)
    with open(store.entry_path(name), "wb") as f:
        f.truncate(800 * 2**20)


def refusals(m: Machine, run_id: str) -> list[dict[str, Any]]:
    return [p for p in m.provenance(run_id) if p.get("action") == "refused"]


def within_deadline(fn: Callable[[], T], fifo: Path | None = None) -> T:
    """``fn()`` on a worker thread; a call still running at the deadline fails the test (a FIFO it may block on
    gets a writer end first, so the thread can finish)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        pending = pool.submit(fn)
        try:
            return pending.result(timeout=DEADLINE_S)
        except concurrent.futures.TimeoutError:
            if fifo is not None:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            pytest.fail(f"{fn} was still blocked after {DEADLINE_S} s")
    finally:
        pool.shutdown(wait=True)


def honest_then_planted(machines: Machines, data: bytes | None = None) -> tuple[Machine, str]:
    """Machine "a" builds and publishes ``upper``; ``data`` then replaces its entry. Returns (a, entry name)."""
    a = machines("a", files=HELLO)
    built = a.dispatch(upper_node(), upper)
    assert built.published["shared"] == "published"
    name = a.entry_name(built.key)
    if data is not None:
        plant(a.shared, name, data)
    return a, name


def assert_runs_and_journals(m: Machine, run_id: str, name: str, reason: str, detail: str) -> None:
    """``m`` (a fresh database) ran the step past the refused document, journaled and counted the refusal, and
    its honest entry took the planted document's place."""
    res = m.dispatch(upper_node(), upper, run_id=run_id)
    assert (res.outcome, res.value, m.calls["upper"]) == ("built", {"length": 6}, 1)
    assert isinstance(res.decision, UnverifiableEvidence) and reason in res.decision.reason
    [refused] = refusals(m, run_id)
    assert (refused["tier"], refused["entry"], refused["reason"]) == ("shared", name, reason)
    assert detail in refused["detail"]
    assert m.metrics.decisions == {"UnverifiableEvidence": 1}
    assert res.published["shared"] == "published"
    assert any(p.get("action") == "replaced" for p in m.provenance(run_id))


def assert_clean_hit(m: Machine, run_id: str) -> None:
    hit = m.dispatch(upper_node(), upper, run_id=run_id)
    assert (hit.outcome, hit.decision, hit.value, m.calls["upper"]) == (
        "clean",
        VerifiedHit("shared"),
        {"length": 6},
        0,
    )


# ------------------------------------------------------------------------------------- what a reader does


def test_a_planted_deep_array_at_a_trusted_name_is_refused_and_the_step_runs(machines: Machines) -> None:
    a, name = honest_then_planted(machines, DEEP)
    # A local hit never reads the shared document.
    again = a.dispatch(upper_node(), upper, run_id="r2")
    assert (again.outcome, again.decision, a.calls["upper"]) == ("clean", VerifiedHit("local"), 1)
    assert (
        SharedTier(a.shared, a.dispatcher.trust).lookup(a.request(upper_node()).key) is not None
    )  # no raise

    b = machines("b", files=HELLO)
    assert_runs_and_journals(b, "r3", name, "undecodable", "'depth'")
    assert_clean_hit(machines("c", files=HELLO), "r4")


def test_an_oversize_document_is_refused_by_its_size_and_the_step_runs(machines: Machines) -> None:
    a, name = honest_then_planted(machines)
    plant_oversize(a.shared, name)
    b = machines("b", files=HELLO)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        assert_runs_and_journals(b, "r2", name, "too_large", str(MAX_ENTRY_BYTES))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if a.shared.kind == "local":  # refused by its size alone: the 800 MB file is never read
        assert peak < 16 * 2**20, f"a run past an 800 MB planted entry allocated {peak} bytes"
    assert_clean_hit(machines("c", files=HELLO), "r3")


@pytest.mark.parametrize(
    "attack, bound",
    [
        # Two "value" members: this parser would keep the last, another the first — one document, two meanings.
        ("duplicate_member", "'duplicate_member'"),
        # 4,000 digits: under int()'s digit limit, so an unbounded parser would spend quadratic time on it.
        ("huge_integer", "'number'"),
    ],
)
def test_duplicate_members_and_huge_integers_are_refused_before_the_signature_is_looked_at(
    machines: Machines, attack: str, bound: str
) -> None:
    a, name = honest_then_planted(machines)
    honest = a.shared.get_entry(name) or b""
    if attack == "duplicate_member":
        assert honest.startswith(b'{"admission":')  # sorted keys: "value" comes last and would win
        forged = b'{"value":{"length":999},' + honest[1:]
    else:
        forged, n = re.subn(rb'"created_at_ms":\d+', b'"created_at_ms":' + b"9" * 4000, honest)
        assert n == 1
    plant(a.shared, name, forged)
    assert_runs_and_journals(machines("b", files=HELLO), "r2", name, "undecodable", bound)
    assert_clean_hit(machines("c", files=HELLO), "r3")


def file_machines(tmp_path: Path) -> tuple[ArtifactStore, Machines]:
    shared = ArtifactStore((tmp_path / "shared").as_uri())
    return shared, lambda name, **kw: make_machine(tmp_path, name, shared, **kw)


def test_a_planted_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    shared, machines = file_machines(tmp_path)
    a, name = honest_then_planted(machines)
    fifo = Path(shared.entry_path(name))
    fifo.unlink()
    os.mkfifo(fifo)
    b = machines("b", files=HELLO)
    within_deadline(lambda: assert_runs_and_journals(b, "r2", name, "not_a_file", "not a regular file"), fifo)
    assert fifo.is_file()  # the publisher replaced the FIFO at its own name with its honest entry
    assert_clean_hit(machines("c", files=HELLO), "r3")


def test_a_directory_at_the_entry_name_is_refused_and_every_run_still_builds(tmp_path: Path) -> None:
    shared, machines = file_machines(tmp_path)
    a, name = honest_then_planted(machines)
    path = Path(shared.entry_path(name))
    path.unlink()
    (path / "inside").mkdir(parents=True)
    for i, host in enumerate(("b", "c")):
        m = machines(host, files=HELLO)
        res = m.dispatch(upper_node(), upper, run_id=f"r{i}")
        assert (res.outcome, m.calls["upper"]) == ("built", 1)
        assert [p["reason"] for p in refusals(m, f"r{i}")] == ["not_a_file"]
        # A directory is not deleted (it is not a document): publication fails, journaled, never silently.
        assert res.published["shared"] == "unpublished:entry"
        [unpublished] = [p for p in m.provenance(f"r{i}") if p.get("action") == "unpublished"]
        assert unpublished["stage"] == "entry" and f"delete entry {name}" in unpublished["reason"]
    assert path.is_dir()


@pytest.mark.s3
def test_an_s3_key_below_the_entry_name_is_not_an_entry(
    tmp_path: Path, s3_bucket: str, s3_options: dict[str, str]
) -> None:
    shared = ArtifactStore(f"s3://{s3_bucket}/artifacts", s3_options)

    def machines(name: str, **kw: Any) -> Machine:
        return make_machine(tmp_path, name, shared, **kw)

    a, name = honest_then_planted(machines)
    shared.delete_entry(name)
    shared.fs.pipe_file(shared.entry_path(name) + "/planted", DEEP)  # "ac/<name>.json/" as a directory
    b = machines("b", files=HELLO)
    res = b.dispatch(upper_node(), upper, run_id="r2")
    assert (res.outcome, res.decision, res.published["shared"]) == ("built", Miss(), "published")
    assert_clean_hit(machines("c", files=HELLO), "r3")


# ------------------------------------------------------------------------------------- what a publisher does


def _oversize_value(root: Path) -> dict[str, Any]:
    (root / "out.txt").write_text("big\n")
    return {"blob": "x" * MAX_ENTRY_BYTES}


def _deep_value(root: Path) -> Any:
    (root / "out.txt").write_text("deep\n")
    value: Any = 0
    for _ in range(200):  # canonical JSON accepts it (256 levels); a shared-tier reader would not (128)
        value = [value]
    return value


@pytest.mark.parametrize(
    "body, bound", [(_oversize_value, "canonical_bytes"), (_deep_value, "depth")], ids=["oversize", "deep"]
)
def test_the_publisher_refuses_an_entry_every_reader_would_refuse(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, body: Callable[[Path], Any], bound: str
) -> None:
    shared, machines = file_machines(tmp_path)
    a = machines("a", files=HELLO)
    with caplog.at_level(logging.WARNING, logger="smthrs_plugin.cache.dispatch"):
        res = a.dispatch(upper_node(), body)
    assert res.outcome == "built"
    assert res.published == {"local": "published", "shared": "unpublished:bounds"}
    [unpublished] = [p for p in a.provenance() if p.get("action") == "unpublished"]
    assert unpublished["stage"] == "bounds" and "[entry_out_of_bounds]" in unpublished["reason"]
    assert "local tier" in unpublished["reason"]
    assert any("stage bounds" in r.getMessage() for r in caplog.records)
    # Nothing of it reached the shared tier: no entry, and no blob uploaded for an entry that is not published.
    assert shared.list_entries() == [] and list(shared.iter_blobs()) == []
    assert a.dispatch(upper_node(), body, run_id="r2").decision == VerifiedHit("local")
    b = machines("b", files=HELLO)
    assert b.dispatch(upper_node(), body, run_id="r3").decision == Miss()


# ------------------------------------------------------------------------------------- maintenance


def test_verify_ls_gc_and_revoke_refuse_planted_documents_on_every_backend(machines: Machines) -> None:
    a, name = honest_then_planted(machines)
    kid = name.split(".")[1]
    deep, huge = entry_name("1" * 64, kid), entry_name("2" * 64, kid)
    foreign = entry_name(
        key_digest(a.request(upper_node()).key), "e" * 16
    )  # another publisher's name, same key
    plant(a.shared, deep, DEEP)
    plant_oversize(a.shared, huge)
    plant(a.shared, foreign, DEEP)
    report = verify(a.dispatcher.local, a.artifacts, SharedTier(a.shared, a.dispatcher.trust))
    assert sorted((p.entry, p.kind) for p in report.problems) == sorted(
        [(deep, "undecodable"), (huge, "too_large"), (foreign, "undecodable")]
    )
    listed = {e.name: e.problem for e in list_entries(a.dispatcher.local, SharedTier(a.shared))}
    assert "'depth'" in (listed[deep] or "") and "too_large" in (listed[huge] or "")
    assert listed[name] is None
    assert gc(a.dispatcher.local, a.artifacts, SharedTier(a.shared), dry_run=True).deleted_blobs == ()
    revoked = revoke(a.dispatcher.local, SharedTier(a.shared), a.request(upper_node()).key, by="test")
    assert (
        len(revoked.entries) == 1
    )  # the honest copy; the planted one at another publisher's name is refused


@pytest.fixture
def cli() -> Any:
    from smthrs_plugin.cli import app

    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def test_cache_verify_lists_planted_documents_as_refused(
    tmp_path: Path, cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore((tmp_path / "a" / "blobs").as_uri())
    a = make_machine(tmp_path, "a", store, files=HELLO, one_store=True)
    monkeypatch.setenv("SMTHRS_CACHE_SIGNING_KEY", str(tmp_path / "team/.smthrs/keys/cache-signing.key"))
    monkeypatch.delenv("SMTHRS_CACHE_TRUSTED_KEYS", raising=False)
    built = a.dispatch(upper_node(), upper)
    kid = team_trust(tmp_path).publishers[0]
    names = {
        what: entry_name(c * 64, kid)
        for what, c in (("huge", "1"), ("fifo", "2"), ("dir", "3"), ("deep", "4"))
    }
    plant_oversize(store, names["huge"])
    os.mkfifo(store.entry_path(names["fifo"]))
    os.makedirs(os.path.join(store.entry_path(names["dir"]), "inside"))
    plant(store, names["deep"], DEEP)
    os.mkfifo(store.entry_path(entry_name(key_digest(built.key), "f" * 16)))  # where revoke looks
    opts = ["--db", a.db.url, "--artifacts", store.url, "--workspace", str(a.ws), "--json"]
    fifo = Path(store.entry_path(names["fifo"]))

    out = within_deadline(lambda: cli("cache", "verify", "--with-shared", *opts), fifo)
    assert out.exit_code == 1, out.output
    problems = {p["entry"]: p for p in json.loads(out.output)["problems"]}
    assert {what: problems[n]["kind"] for what, n in names.items()} == {
        "huge": "too_large",
        "fifo": "not_a_file",
        "dir": "not_a_file",
        "deep": "undecodable",
    }
    assert "'depth'" in problems[names["deep"]]["detail"]
    assert problems[entry_name(key_digest(built.key), "f" * 16)]["kind"] == "not_a_file"

    listed = within_deadline(lambda: cli("cache", "ls", "--with-shared", *opts), fifo)
    assert listed.exit_code == 0, listed.output
    gced = within_deadline(lambda: cli("cache", "gc", "--dry-run", *opts), fifo)
    assert gced.exit_code == 0, gced.output
    revoked = within_deadline(lambda: cli("cache", "revoke", built.key, *opts), fifo)
    assert revoked.exit_code == 0, revoked.output


# ------------------------------------------------------------------------ the real CLI and the Python API

PLAN = """\
plan: demo
nodes:
  - id: build
    run: "mkdir -p out && cat src/a.txt > out/built.txt && printf built"
    reads: ["src/a.txt"]
    writes: ["out/built.txt"]
"""
#: What a reader may be limited to and must still run under with an 800 MB document planted (it used to die).
ADDRESS_SPACE = 1536 * 2**20


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SMTHRS_")}


def _smthrs_run(ws: Path) -> dict[str, Any]:
    ran = subprocess.run(
        [str(Path(sys.executable).with_name("smthrs")), "run", "plan.yaml", "--json"],
        cwd=ws,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=_clean_env(),
        preexec_fn=_limit_address_space,
    )
    assert "Traceback" not in ran.stderr, ran.stderr
    assert ran.returncode == 0, (ran.returncode, ran.stdout, ran.stderr)
    doc: dict[str, Any] = json.loads(ran.stdout)
    return doc


def _fresh_database(ws: Path) -> None:
    for p in (ws / ".smthrs").glob("state.db*"):
        p.unlink()


def _journaled_refusals(ws: Path, run_id: str) -> list[str]:
    db = open_database(f"sqlite:///{ws / '.smthrs' / 'state.db'}")
    try:
        events = Journal(db).read(run_id, limit=1000)
    finally:
        db.close()
    return [
        e.payload["reason"]
        for e in events
        if e.type == PROVENANCE_EVENT and e.payload.get("action") == "refused"
    ]


@pytest.mark.slow
def test_smthrs_run_and_the_python_api_run_the_step_past_planted_documents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src" / "a.txt").write_text("hello")
    (ws / "plan.yaml").write_text(PLAN)
    first = _smthrs_run(ws)
    assert first["settlements"][0]["outcome"] == "built"
    [entry] = (ws / ".smthrs" / "artifacts" / "ac").glob("*.json")

    entry.write_bytes(DEEP)  # a local hit: this database holds the entry
    hit = _smthrs_run(ws)
    assert (hit["settlements"][0]["outcome"], hit["settlements"][0]["cache_decision"]) == (
        "clean",
        "VerifiedHit",
    )

    for planted, reason in ((DEEP, "undecodable"), (None, "too_large")):
        entry.unlink()
        if planted is None:
            with open(entry, "wb") as f:
                f.truncate(800 * 2**20)  # read whole, this exhausted the address space above
        else:
            entry.write_bytes(planted)
        _fresh_database(ws)
        ran = _smthrs_run(ws)
        settled = ran["settlements"][0]
        assert (settled["outcome"], settled["cache_decision"]) == ("built", "UnverifiableEvidence")
        assert _journaled_refusals(ws, ran["run_id"]) == [reason]

    entry.write_bytes(DEEP)  # the Python API, a fresh database again
    _fresh_database(ws)
    shutil.rmtree(ws / "out")
    for k in [k for k in os.environ if k.startswith("SMTHRS_")]:
        monkeypatch.delenv(k)
    plan, executor = sp.load_plan(ws / "plan.yaml")
    with sp.open_runtime(workspace=ws) as rt:
        report = rt.scheduler("api-1").run(plan, executor)
    assert [(s.outcome, s.cache_decision) for s in report.settlements] == [("built", "UnverifiableEvidence")]
    assert _journaled_refusals(ws, "api-1") == ["undecodable"]
    assert (ws / "out" / "built.txt").read_text() == "hello"
