"""``/projections`` of a REAL ``smthrs serve`` process, over HTTP (ndjson) and WebSocket: a stream read in part,
dropped, and resumed with its last cursor delivers the rest with no gap and no duplicate — for the snapshot and for
the live tail — and refused input is refused before anything streams."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from smthrs_plugin.records.journal import Journal
from smthrs_plugin.runtime import Runtime

DEADLINE_S = 120.0


@pytest.fixture
def ticking_run(rt: Runtime) -> str:
    """A run with 30 journal entries of its own."""
    rt.runs.create("ticks", "ci/ticks")
    journal = Journal(rt.db)
    for i in range(30):
        journal.append("ticks", "test.tick", {"i": i})
    return "ticks"


def _append(rt: Runtime, run_id: str, start: int, n: int) -> None:
    journal = Journal(rt.db)
    for i in range(start, start + n):
        journal.append(run_id, "test.tick", {"i": i})


def _snapshot(server: Any, run_id: str, **params: str) -> list[dict[str, Any]]:
    with httpx.Client(base_url=server.local_url(), timeout=DEADLINE_S) as c:
        r = c.get("/projections", params={"run_id": run_id, **params})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in r.text.splitlines()]


def _read_lines(server: Any, run_id: str, n: int, **params: str) -> list[dict[str, Any]]:
    """The first ``n`` events of a streamed GET, then disconnect (the rest is left unread)."""
    out: list[dict[str, Any]] = []
    with (
        httpx.Client(base_url=server.local_url(), timeout=DEADLINE_S) as c,
        c.stream("GET", "/projections", params={"run_id": run_id, **params}) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            out.append(json.loads(line))
            if len(out) == n:
                break
    return out


def _ticks(events: list[dict[str, Any]]) -> list[int]:
    return [e["payload"]["i"] for e in events if e["kind"] == "test.tick"]


def test_a_snapshot_is_what_smthrs_watch_prints(server: Any, ticking_run: str, workspace: Any) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "SMTHRS_WORKSPACE": str(workspace)}
    cli = subprocess.run(
        [sys.executable, "-m", "smthrs_plugin", "watch", ticking_run, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=DEADLINE_S,
    )
    assert json.loads(cli.stdout)["events"] == _snapshot(server, ticking_run)


def test_an_ndjson_snapshot_resumes_after_a_disconnect_with_no_gap_and_no_duplicate(
    server: Any, ticking_run: str
) -> None:
    whole = _snapshot(server, ticking_run)
    assert _ticks(whole) == list(range(30))
    first = _read_lines(server, ticking_run, 11)
    rest = _snapshot(server, ticking_run, after_cursor=first[-1]["cursor"])
    assert first + rest == whole


def test_a_followed_ndjson_stream_resumes_with_its_cursor_across_new_events(
    server: Any, ticking_run: str, rt: Runtime
) -> None:
    total = len(_snapshot(server, ticking_run))
    first = _read_lines(server, ticking_run, 12, follow="true")
    _append(rt, ticking_run, 30, 10)  # written while nobody is connected
    wanted = total + 10 - 12
    got: list[dict[str, Any]] = []
    done = threading.Event()

    def more() -> None:
        done.wait(DEADLINE_S)
        _append(rt, ticking_run, 40, 5)  # written while the resumed stream follows

    writer = threading.Thread(target=more, daemon=True)
    writer.start()
    with (
        httpx.Client(base_url=server.local_url(), timeout=DEADLINE_S) as c,
        c.stream(
            "GET",
            "/projections",
            params={"run_id": ticking_run, "after_cursor": first[-1]["cursor"], "follow": "true"},
        ) as r,
    ):
        for line in r.iter_lines():
            got.append(json.loads(line))
            if len(got) == wanted:
                done.set()
            if len(got) == wanted + 5:
                break
    writer.join(DEADLINE_S)
    everything = first + got
    assert _ticks(everything) == list(range(45))
    seqs = [e["sequence"] for e in everything]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # contiguous: no gap, no duplicate


def _ws_url(server: Any, run_id: str, after: str | None = None) -> str:
    url = f"ws://127.0.0.1:{server.port}/projections?run_id={run_id}"
    return url if after is None else f"{url}&after_cursor={after}"


def _ws_read(url: str, n: int, **kw: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with connect(url, open_timeout=DEADLINE_S, **kw) as ws:
        while len(out) < n:
            out.append(json.loads(ws.recv(timeout=DEADLINE_S)))
    return out


def test_a_websocket_projection_resumes_with_its_cursor_with_no_gap_and_no_duplicate(
    server: Any, ticking_run: str, rt: Runtime
) -> None:
    whole = _snapshot(server, ticking_run)
    first = _ws_read(_ws_url(server, ticking_run), 9)
    _append(rt, ticking_run, 30, 6)
    rest = _ws_read(_ws_url(server, ticking_run, first[-1]["cursor"]), len(whole) + 6 - 9)
    everything = first + rest
    assert _ticks(everything) == list(range(36))
    seqs = [e["sequence"] for e in everything]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert everything[: len(whole)] == whole


def test_a_websocket_follows_a_signal_delivered_over_rpc(server: Any, waiting_run: str) -> None:
    so_far = len(_snapshot(server, waiting_run))
    with connect(_ws_url(server, waiting_run), open_timeout=DEADLINE_S) as ws:
        for _ in range(so_far):
            ws.recv(timeout=DEADLINE_S)  # the snapshot; what follows is live
        assert (
            server.result("signal", {"run_id": waiting_run, "name": "approval", "value": 1})["status"]
            == "pending"
        )
        events = [json.loads(ws.recv(timeout=DEADLINE_S)) for _ in range(3)]
    assert [e["kind"] for e in events] == ["deferred-completed", "control.signal.delivered", "run-woken"]
    # The envelope speaks the CLI's vocabulary (`smthrs watch --json`); the payload is the record as written.
    assert all(type(e["occurred_at_ms"]) is int and "occurred_at" not in e for e in events)
    assert set(events[0]) == {
        "sequence",
        "kind",
        "run_id",
        "occurred_at_ms",
        "payload",
        "cursor",
        "partition",
    }


#: (what is wrong, the query, the status, the error code)
_BAD_QUERIES = [
    ("no-run", {}, 400, "invalid_input"),
    ("unknown-run", {"run_id": "no-such-run"}, 404, "run_not_found"),
    ("bad-cursor", {"run_id": "ticks", "after_cursor": "garbage"}, 400, "invalid_cursor"),
    ("bad-follow", {"run_id": "ticks", "follow": "maybe"}, 400, "invalid_options"),
    ("unknown-param", {"run_id": "ticks", "since": "1"}, 400, "invalid_options"),
]


def test_a_projection_refuses_bad_input_before_streaming(server: Any, ticking_run: str) -> None:
    with httpx.Client(base_url=server.local_url(), timeout=DEADLINE_S) as c:
        for what, params, status, code in _BAD_QUERIES:
            r = c.get("/projections", params=params)
            assert r.status_code == status and r.json()["error"]["code"] == code, (what, r.text)


def test_a_cursor_of_another_run_is_refused(server: Any, ticking_run: str, rt: Runtime) -> None:
    rt.runs.create("other", "ci/ticks")
    _append(rt, "other", 0, 1)
    cursor = _snapshot(server, "other")[-1]["cursor"]
    with httpx.Client(base_url=server.local_url(), timeout=DEADLINE_S) as c:
        r = c.get("/projections", params={"run_id": ticking_run, "after_cursor": cursor})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_cursor"
    with connect(_ws_url(server, ticking_run, cursor), open_timeout=DEADLINE_S) as ws:
        assert json.loads(ws.recv(timeout=DEADLINE_S))["error"]["code"] == "invalid_cursor"
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=DEADLINE_S)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


def test_a_cross_origin_websocket_is_refused_and_a_same_origin_one_is_served(
    server: Any, ticking_run: str
) -> None:
    with pytest.raises(InvalidStatus) as refused:
        connect(_ws_url(server, ticking_run), origin="http://evil.example", open_timeout=DEADLINE_S).close()  # type: ignore[arg-type]
    assert refused.value.response.status_code == 403
    same = f"http://127.0.0.1:{server.port}"
    assert len(_ws_read(_ws_url(server, ticking_run), 1, origin=same)) == 1


@pytest.fixture(autouse=True)
def _quiet_websockets_logs() -> Iterator[None]:
    import logging

    logger = logging.getLogger("websockets")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def test_streams_dropped_by_their_clients_give_their_slot_back(server: Any, ticking_run: str) -> None:
    from smthrs_plugin.serve._projections import MAX_STREAMS

    def one_event() -> bool:
        try:
            return len(_read_lines(server, ticking_run, 1, follow="true")) == 1
        except AssertionError:  # 503 while a dropped stream is still being noticed; asked again below
            return False

    for _ in range(MAX_STREAMS + 8):
        deadline = time.monotonic() + DEADLINE_S
        while not one_event():
            assert time.monotonic() < deadline, "a dropped stream kept its slot"
            time.sleep(0.05)


def test_streams_beyond_the_cap_are_refused_until_one_closes(server: Any, ticking_run: str) -> None:
    from smthrs_plugin.serve._projections import MAX_STREAMS

    # max_queue=None: a client that stops reading (its queue full) could not process the closing handshake.
    held = [
        connect(_ws_url(server, ticking_run), open_timeout=DEADLINE_S, max_queue=None)
        for _ in range(MAX_STREAMS)
    ]
    try:
        for ws in held:
            ws.recv(timeout=DEADLINE_S)  # every one of them is streaming
        with httpx.Client(base_url=server.local_url(), timeout=DEADLINE_S) as c:
            busy = c.get("/projections", params={"run_id": ticking_run})
        assert busy.status_code == 503 and busy.headers["retry-after"]
        with (
            connect(_ws_url(server, ticking_run), open_timeout=DEADLINE_S) as extra,
            pytest.raises(ConnectionClosed) as closed,
        ):
            extra.recv(timeout=DEADLINE_S)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013
    finally:
        for ws in held:
            ws.close()
    assert len(_snapshot_eventually(server, ticking_run)) > 0


def _snapshot_eventually(server: Any, run_id: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        with httpx.Client(base_url=server.local_url(), timeout=DEADLINE_S) as c:
            r = c.get("/projections", params={"run_id": run_id})
        if r.status_code == 200:
            return [json.loads(line) for line in r.text.splitlines()]
        assert r.status_code == 503 and time.monotonic() < deadline, r.text
        time.sleep(0.05)
