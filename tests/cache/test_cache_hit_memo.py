"""The remembered local hit (``CacheDispatcher._remembered``): a key this process served and verified before is
served again without reading its row or re-hashing anything — but only while nothing it verified can have changed.
Every attack below must fall back to the full verification (or to a real execution), never to the memory.

How "served from memory" is observed: the full verification re-measures the read set and the outputs through the
measurer (its ``stats`` count every file served by the stat cache or hashed); the remembered path only stats
files, so the measurer's counters do not move. Files are measured with a clock 10 s ahead of their last change, so
the stat cache trusts them (outside the racy window) — except in the racy-timestamp test, which uses the real
clock."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _cache_support import CountingMetrics, team_trust, upper, upper_node

from smthrs_plugin import plan
from smthrs_plugin.boundary import Measurer
from smthrs_plugin.cache import CacheDispatcher, DispatchRequest, DispatchResult
from smthrs_plugin.cache.requests import node_request
from smthrs_plugin.canonical import key_digest
from smthrs_plugin.stores.artifacts import ArtifactStore
from smthrs_plugin.stores.database import open_database

#: How far ahead of a file's last change the measurer's clock says it was hashed (beyond the 2 s racy window).
AHEAD_NS = 10_000_000_000
#: Deadline of a helper process (far above what it needs on a busy machine).
PROCESS_TIMEOUT_S = 120


class Host:
    """One workspace, its SQLite database, local blobs and a dispatcher over a shared tier."""

    def __init__(
        self, base: Path, name: str, *, ahead_ns: int = AHEAD_NS, revocation_refresh_s: float = 60.0
    ) -> None:
        self.ws = base / name / "ws"
        self.ws.mkdir(parents=True)
        (self.ws / "in.txt").write_text("hello")
        self.db_url = f"sqlite:///{(base / name / 'state.db').as_posix()}"
        self.db = open_database(self.db_url)
        self.measurer = Measurer(self.ws, clock_ns=lambda: time.time_ns() + ahead_ns)
        self.metrics = CountingMetrics()
        self.calls = 0
        self.dispatcher = CacheDispatcher(
            self.db,
            ArtifactStore((base / name / "blobs").as_uri()),
            self.ws,
            shared=ArtifactStore((base / "shared").as_uri()),
            metrics=self.metrics,
            measurer=self.measurer,
            host_id=name,
            trust=team_trust(base),
            revocation_refresh_s=revocation_refresh_s,
        )

    def request(self) -> DispatchRequest:
        # Local tier only: a row refused here must lead to a real execution, not to the shared copy.
        return node_request(
            upper_node(),
            run_id="r1",
            workspace=self.ws,
            measurer=self.measurer,
            consult_shared=False,
            publish_shared=False,
        )

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        def body(root: Path) -> Any:
            self.calls += 1
            return upper(root)

        return self.dispatcher.dispatch(request, body)

    def measured(self) -> int:
        """Files the measurer has measured so far (served by its stat cache or hashed)."""
        return self.measurer.stats.cached + self.measurer.stats.hashed

    def warm(self) -> DispatchRequest:
        """Build once, then hit once (the full verification, which remembers the hit); return the request."""
        req = self.request()
        assert self.dispatch(req).outcome == "built"
        first = self.dispatch(req)
        assert (first.outcome, first.decision.tag if first.decision else None) == ("clean", "VerifiedHit")
        return req

    def hit_from_memory(self, req: DispatchRequest) -> DispatchResult:
        before = self.measured()
        res = self.dispatch(req)
        assert res.outcome == "clean" and self.measured() == before, "expected a hit served from memory"
        return res


def _run_python(code: str) -> None:
    """Run ``code`` in a separate Python process (another process writing to the same database)."""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=PROCESS_TIMEOUT_S)


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path, "a")


def test_a_repeated_local_hit_is_served_from_memory_and_still_counts_one_decision_per_consult(
    host: Host,
) -> None:
    req = host.warm()
    for _ in range(3):
        res = host.hit_from_memory(req)
        assert res.value == {"length": 5} and res.decision is not None and res.decision.tag == "VerifiedHit"
    assert host.calls == 1
    assert host.metrics.decisions == {"Miss": 1, "VerifiedHit": 4}
    assert (host.ws / "out.txt").read_text() == "HELLO"


def test_each_remembered_hit_decodes_a_fresh_value_so_a_caller_mutating_it_cannot_poison_the_next(
    host: Host,
) -> None:
    req = host.warm()
    first = host.hit_from_memory(req)
    first.value["length"] = 999
    assert host.hit_from_memory(req).value == {"length": 5}


def test_a_read_changed_in_place_with_its_size_and_mtime_restored_is_not_served_from_memory(
    host: Host,
) -> None:
    req = host.warm()
    host.hit_from_memory(req)
    path = host.ws / "in.txt"
    st = os.stat(path)
    path.write_text("HELLO")  # same size, other bytes
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime restored: only the ctime tells
    res = host.dispatch(req)
    assert res.decision is not None and res.decision.tag == "StaleReadSet"
    assert res.outcome == "built" and host.calls == 2


def test_a_racily_clean_read_is_hashed_again_on_every_hit_never_trusted_from_memory(tmp_path: Path) -> None:
    # The real clock: the files were written moments ago, inside the 2 s racy window of their hashing.
    host = Host(tmp_path, "racy", ahead_ns=0)
    req = host.request()
    assert host.dispatch(req).outcome == "built"
    for _ in range(2):
        hashed = host.measurer.stats.hashed
        res = host.dispatch(req)
        assert res.outcome == "clean"
        assert host.measurer.stats.hashed > hashed  # re-hashed: a same-tick rewrite cannot be ruled out
    assert host.calls == 1


@pytest.mark.parametrize("damage", ["deleted", "edited", "chmod", "replaced-by-link"])
def test_a_damaged_output_is_replayed_by_the_full_path_never_served_from_memory(
    host: Host, damage: str
) -> None:
    req = host.warm()
    host.hit_from_memory(req)
    out = host.ws / "out.txt"
    if damage == "deleted":
        out.unlink()
    elif damage == "edited":
        st = os.stat(out)
        out.write_text("hello")
        os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif damage == "chmod":
        out.chmod(0o755)
    else:
        (host.ws / "elsewhere.txt").write_text("HELLO")
        out.unlink()
        out.symlink_to("elsewhere.txt")
    before = host.measured()
    res = host.dispatch(req)
    assert res.outcome == "clean" and host.measured() > before  # the full path verified and replayed
    assert out.read_text() == "HELLO" and os.stat(out).st_mode & 0o111 == 0
    # (a link to identical bytes inside the workspace is what the full path accepts as the output present)
    assert host.calls == 1


def test_a_directory_above_a_read_swapped_for_a_link_outside_the_workspace_is_not_served_from_memory(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path, "links")
    (host.ws / "d").mkdir()
    (host.ws / "d/in.txt").write_text("hello")
    draft = plan.node("up", body={"cmd": "up-d"}, reads=["d/in.txt"], writes=["out.txt"])
    req = node_request(
        draft,
        run_id="r1",
        workspace=host.ws,
        measurer=host.measurer,
        consult_shared=False,
        publish_shared=False,
    )

    def body(root: Path) -> Any:
        host.calls += 1
        (root / "out.txt").write_text((root / "d/in.txt").read_text().upper())
        return 1

    assert host.dispatcher.dispatch(req, body).outcome == "built"
    assert host.dispatcher.dispatch(req, body).outcome == "clean"
    before = host.measured()
    assert host.dispatcher.dispatch(req, body).outcome == "clean" and host.measured() == before
    outside = tmp_path / "outside"
    (host.ws / "d").rename(outside)  # the same file (inode, ctime) now lives outside the workspace ...
    (host.ws / "d").symlink_to(outside, target_is_directory=True)  # ... reached through a link
    res = host.dispatcher.dispatch(req, body)
    assert res.outcome != "clean"
    assert res.decision is not None and res.decision.tag == "Unmeasurable"


def test_an_entry_invalidated_by_another_process_is_not_served_from_memory(host: Host) -> None:
    req = host.warm()
    host.hit_from_memory(req)
    _run_python(
        "from smthrs_plugin.stores.database import open_database\n"
        "from smthrs_plugin.cache.local import LocalTier\n"
        f"assert LocalTier(open_database({host.db_url!r})).invalidate({key_digest(req.key)!r})\n"
    )
    res = host.dispatch(req)
    assert res.outcome == "built" and host.calls == 2
    assert res.decision is not None and res.decision.tag == "Miss"


def test_any_write_of_another_process_to_the_database_sends_the_next_hit_through_the_full_path(
    host: Host,
) -> None:
    req = host.warm()
    host.hit_from_memory(req)
    _run_python(
        "from smthrs_plugin.stores.database import open_database\n"
        "from smthrs_plugin.records.journal import Journal\n"
        f"db = open_database({host.db_url!r})\n"
        "db.write(lambda c: Journal(db).append_in(c, 'another-run', 'test-note', {}))\n"
    )
    before = host.measured()
    res = host.dispatch(req)
    assert res.outcome == "clean" and host.measured() > before  # read the row and verified again
    host.hit_from_memory(req)  # and remembered again


def test_a_key_revoked_by_another_machine_is_not_served_from_memory(tmp_path: Path) -> None:
    host = Host(tmp_path, "a", revocation_refresh_s=0.0)  # every local hit re-lists the revocations
    req = host.warm()
    host.hit_from_memory(req)
    other = Host(tmp_path, "b")  # another machine of the same shared tier, with its own database
    other.dispatcher.shared.revocations.revoke(req.key, [], by="test", reason="poisoned")
    res = host.dispatch(req)
    assert res.decision is not None and res.decision.tag == "UnverifiableEvidence"
    assert "revoked" in str(res.decision)
    assert res.outcome == "built" and host.calls == 2


def test_an_entry_replaced_under_the_same_key_by_this_process_is_not_served_from_memory(host: Host) -> None:
    req = host.warm()
    host.hit_from_memory(req)
    assert host.dispatcher.local.invalidate(key_digest(req.key))  # another dispatcher's write, same process
    res = host.dispatch(req)
    assert res.outcome == "built" and host.calls == 2
