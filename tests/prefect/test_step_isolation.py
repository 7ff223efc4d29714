"""A realistic Prefect ETL flow, ported by swapping ``@task`` for ``@sp.step(reads=..., writes=...)`` and nothing
else: plain paths (cwd-relative and absolute), pandas, a helper module, ``.map``, retries, an HTTP fetch against a
local server. Each run is a fresh ``python etl.py`` process, the way a flow author runs it. Every hit must equal
what the body would produce now."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _prefect_support import run_py

pytestmark = pytest.mark.prefect

ETL = textwrap.dedent(
    """
    import glob
    import json
    import os
    import sys
    import urllib.request
    from datetime import timedelta
    from pathlib import Path

    import pandas as pd
    from prefect import flow

    import etl_helpers
    import smthrs_plugin as sp

    FLAKY_MARKER = Path(sys.argv[2])


    @sp.step(cache_expiration=timedelta(hours=1))
    def fetch_page(url: str, page: int) -> list:
        with urllib.request.urlopen(f"{url}/page/{page}") as r:
            return json.loads(r.read())


    @sp.step(writes=["out/pages.csv"], retries=1, retry_delay_seconds=0)
    def to_csv(pages: list) -> int:
        if not FLAKY_MARKER.exists():  # the first attempt ever fails once: a retry is an attempt
            FLAKY_MARKER.write_text("failed once")
            raise RuntimeError("transient")
        df = pd.DataFrame([row for page in pages for row in page])
        os.makedirs("out", exist_ok=True)
        df.to_csv("out/pages.csv", index=False)
        return len(df)


    @sp.step(reads=["out/pages.csv", "data/weights.csv"], writes=["out/summary.txt"])
    def summarize() -> dict:
        pages = pd.read_csv("out/pages.csv")
        weights = pd.read_csv(os.path.join(os.getcwd(), "data", "weights.csv"))  # an absolute workspace path
        total = etl_helpers.score(int((pages["value"] * weights["w"].iloc[0]).sum()))
        Path(os.path.abspath("out/summary.txt")).write_text(f"total={total}\\n")
        return {"total": total}


    @sp.step(reads=["data/*.csv"])
    def count_rows() -> int:
        return sum(len(open(p).read().splitlines()) for p in sorted(glob.glob("data/*.csv")))


    @flow(persist_result=False)
    def etl(url: str) -> dict:
        from prefect.runtime import flow_run

        pages = fetch_page.map(url, [1, 2, 3])
        n = to_csv([p.result() for p in pages])
        return {"rows": n, "summary": summarize(), "inputs": count_rows(), "flow_run_id": str(flow_run.id)}


    if __name__ == "__main__":
        from smthrs_plugin.prefect.steprun import current_spec

        with sp.step_settings(workspace="."):
            out = etl(sys.argv[1])
            rt = current_spec().open()
            settled = [
                e.payload for e in rt.journal.read("prefect-" + out["flow_run_id"]) if e.type == "step-settled"
            ]
        out["outcomes"] = sorted((p["node"], p["outcome"]) for p in settled)
        out["isolation"] = sorted({p.get("isolation") for p in settled if p.get("isolation")})
    print("RESULT " + json.dumps(out))
    """
)


class _Pages(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        page = int(self.path.rsplit("/", 1)[1])
        _Pages.hits.append(self.path)
        body = json.dumps([{"page": page, "value": page * 10 + i} for i in range(2)]).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def pages_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pages)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Pages.hits.clear()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    ws = tmp_path / "etl"
    (ws / "data").mkdir(parents=True)
    (ws / "data/weights.csv").write_text("w\n2\n")
    (ws / "data/regions.csv").write_text("region\nnorth\nsouth\n")
    (ws / "etl_helpers.py").write_text("FACTOR = 2\n\n\ndef score(n):\n    return n * FACTOR\n")
    (ws / "etl.py").write_text(ETL)
    return ws


def _run(ws: Path, url: str, marker: Path) -> dict[str, Any]:
    proc = run_py(["etl.py", url, str(marker)], cwd=ws, env={"PYTHONPATH": str(ws)}, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def _outcomes(result: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for node, outcome in result["outcomes"]:
        out.setdefault(node, []).append(outcome)
    return out


def test_an_etl_flow_written_with_plain_paths_hits_only_when_the_hit_equals_a_fresh_run(
    project: Path, pages_server: str, tmp_path: Path
) -> None:
    ws, marker = (
        project,
        tmp_path / "flaky-marker",
    )  # the marker is outside the workspace: a body may write there

    first = _run(ws, pages_server, marker)
    assert first["rows"] == 6 and first["summary"] == {"total": 2 * 2 * (10 + 11 + 20 + 21 + 30 + 31)}
    assert first["inputs"] == 5
    assert _outcomes(first) == {
        "fetch_page": ["built"] * 3,
        "to_csv": ["built", "failed"],  # the first attempt failed, the retry built
        "summarize": ["built"],
        "count_rows": ["built"],
    }
    assert first["isolation"] == ["namespace"]
    assert (
        ws / "out/summary.txt"
    ).read_text() == "total=492\n"  # cwd-relative and absolute writes copied back
    assert len(_Pages.hits) == 3

    # 1. Run again: every step is a verified hit (no HTTP fetch, no body).
    second = _run(ws, pages_server, marker)
    assert {n: set(o) for n, o in _outcomes(second).items()} == {
        n: {"clean"} for n in ("fetch_page", "to_csv", "summarize", "count_rows")
    }
    assert second["summary"] == first["summary"] and len(_Pages.hits) == 3

    # 2. A deleted output is restored by the hit that replays it.
    (ws / "out/pages.csv").unlink()
    third = _run(ws, pages_server, marker)
    assert set(_outcomes(third)["to_csv"]) == {"clean"}
    assert (ws / "out/pages.csv").read_text().splitlines()[0] == "page,value"

    # 3. A changed input rebuilds exactly the steps that read it, with the new value.
    (ws / "data/weights.csv").write_text("w\n3\n")
    fourth = _run(ws, pages_server, marker)
    o = _outcomes(fourth)
    assert o["summarize"] == ["built"] and o["count_rows"] == ["built"]
    assert set(o["fetch_page"]) == {"clean"} and o["to_csv"] == ["clean"]
    assert fourth["summary"] == {"total": 2 * 3 * 123}
    assert (ws / "out/summary.txt").read_text() == f"total={2 * 3 * 123}\n"

    # 4. An edited helper module rebuilds the steps that reach it, and only those.
    (ws / "etl_helpers.py").write_text("FACTOR = 3\n\n\ndef score(n):\n    return n * FACTOR\n")
    shutil.rmtree(ws / "__pycache__", ignore_errors=True)
    fifth = _run(ws, pages_server, marker)
    o = _outcomes(fifth)
    assert o["summarize"] == ["built"] and fifth["summary"] == {"total": 3 * 3 * 123}
    assert set(o["fetch_page"]) == {"clean"} and o["to_csv"] == ["clean"] and o["count_rows"] == ["clean"]

    # 5. A glob read hits across runs; a new matching file rebuilds it.
    (ws / "data/extra.csv").write_text("a\n1\n2\n")
    sixth = _run(ws, pages_server, marker)
    o = _outcomes(sixth)
    assert o["count_rows"] == ["built"] and sixth["inputs"] == 8
    assert o["summarize"] == ["clean"]


def test_a_body_that_reads_an_undeclared_file_is_refused_and_the_workspace_is_untouched(
    tmp_path: Path,
) -> None:
    ws = tmp_path / "ws"
    (ws / "data").mkdir(parents=True)
    (ws / "data/raw.csv").write_text("1\n")
    (ws / "data/secret.csv").write_text("2\n")
    (ws / "flow.py").write_text(
        textwrap.dedent(
            """
            import sys
            from prefect import flow
            import smthrs_plugin as sp

            @sp.step(reads=["data/raw.csv"], writes=["out.txt"])
            def peek() -> str:
                open("out.txt", "w").write("partial")
                return open("data/secret.csv").read()

            @flow(persist_result=False)
            def f():
                return peek()

            with sp.step_settings(workspace="."):
                try:
                    f()
                except Exception as exc:
                    print("ERROR", type(exc).__name__, getattr(exc, "code", None))
            """
        )
    )
    proc = run_py(["flow.py"], cwd=ws, timeout=600)
    assert "ERROR UndeclaredPath undeclared_read" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    assert proc.stderr.count("undeclared_read") + proc.stdout.count("undeclared_read") >= 1
    assert not (ws / "out.txt").exists()  # the refused body's write never left its sandbox


@pytest.mark.parametrize("isolation", ["process", "namespace"])
def test_the_journal_says_which_isolation_ran(tmp_path: Path, isolation: str) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "flow.py").write_text(
        textwrap.dedent(
            """
            import json
            from prefect import flow
            import smthrs_plugin as sp
            @sp.step(writes=["out.txt"])
            def write() -> int:
                open("out.txt", "w").write("x")
                return 1

            @flow(persist_result=False)
            def f():
                return write()

            with sp.step_settings(workspace="."):
                f()
            """
        )
    )
    proc = run_py(["flow.py"], cwd=ws, env={"SMTHRS_ISOLATION": isolation}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import smthrs_plugin as sp

    with sp.open_runtime(ws) as rt:
        kinds = [
            e.payload.get("isolation")
            for r in rt.runs.list()
            for e in rt.journal.read(r.run_id)
            if e.type == "step-settled"
        ]
    assert kinds == [isolation]
    assert (ws / "out.txt").read_text() == "x"
    explained = run_py(["-m", "smthrs_plugin", "cache", "explain", "write", "--json"], cwd=ws)
    assert explained.returncode == 0, explained.stdout + explained.stderr
    assert json.loads(explained.stdout)["isolation"] == isolation


# -- in-process flows: the flow author's own process forks each building body --------------------------------------

import asyncio  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

from prefect import flow  # noqa: E402

import smthrs_plugin as sp  # noqa: E402
from smthrs_plugin.errors import BoundaryError, BoundaryRefusal  # noqa: E402


@sp.step(writes=["out/part.txt"])
def shout(ws: sp.Workspace, word: str) -> dict:
    from prefect import get_run_logger

    get_run_logger().info("shouting %s in %s", word, os.getpid())
    os.makedirs("out", exist_ok=True)
    Path("out/part.txt").write_text(word.upper())
    return {"pid": os.getpid(), "cwd": os.getcwd()}


@sp.step(writes=["out/part.txt"])
def killed(word: str) -> None:
    os.makedirs("out", exist_ok=True)
    Path("out/part.txt").write_text(word)
    os.kill(os.getpid(), signal.SIGKILL)


@sp.step(reads=["data/in.txt"], writes=["out.txt"])
def absolute_reader() -> str:
    return open(os.path.join(os.environ["SMTHRS_TEST_WS"], "data", "in.txt")).read()


@sp.step
async def waits_forever(marker: str) -> None:
    Path(marker).write_text(str(os.getpid()))
    await asyncio.sleep(3600)  # the body itself blocks; the test waits on the marker, never on time


@flow(persist_result=False)
def shout_flow(word: str) -> dict:
    return shout(word)


@flow(persist_result=False)
def killed_flow() -> None:
    killed("partial")


@flow(persist_result=False)
def reader_flow() -> str:
    return absolute_reader()


@sp.step(boundary="expected")  # its undeclared marker is a recorded deviation, never copied back
def each(i: int) -> dict:
    Path("marker").write_text(str(i))
    return {"i": i, "pid": os.getpid(), "seen": sorted(os.listdir("."))}


@flow(persist_result=False)
def eight_flow() -> list:
    return [f.result() for f in each.map(list(range(8)))]


@pytest.fixture
def flow_ws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    ws = tmp_path / "ws"
    (ws / "data").mkdir(parents=True)
    (ws / "data/in.txt").write_text("in")
    monkeypatch.setenv("SMTHRS_TEST_WS", str(ws))
    with sp.step_settings(workspace=ws):
        yield ws


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_child_s_run_logger_reaches_the_task_run_logger(flow_ws: Path) -> None:
    collect = _Collect()
    task_logger = logging.getLogger("prefect.task_runs")
    level = task_logger.level
    task_logger.setLevel(
        logging.INFO
    )  # the forked child inherits the level: its INFO record is made and relayed
    task_logger.addHandler(collect)
    try:
        out = shout_flow("hi")
    finally:
        task_logger.removeHandler(collect)
        task_logger.setLevel(level)
    assert out["pid"] != os.getpid() and out["cwd"] == str(flow_ws)
    assert f"shouting hi in {out['pid']}" in collect.messages
    assert (flow_ws / "out/part.txt").read_text() == "HI"


def test_a_child_killed_by_sigkill_is_a_typed_failed_build_with_nothing_copied_back(flow_ws: Path) -> None:
    with pytest.raises(BoundaryError) as err:
        killed_flow()
    assert err.value.code == "body_died"
    assert not (flow_ws / "out").exists()


def test_with_namespaces_switched_off_an_absolute_workspace_read_is_refused(
    flow_ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTHRS_ISOLATION", "process")
    with sp.step_settings(workspace=flow_ws), pytest.raises(BoundaryRefusal) as err:
        reader_flow()
    assert err.value.code == "undeclared_read" and "data/in.txt" in err.value.message


def test_eight_mapped_bodies_building_at_once_each_run_isolated(flow_ws: Path) -> None:
    got = eight_flow()
    assert sorted(r["i"] for r in got) == list(range(8))
    assert len({r["pid"] for r in got}) == 8 and os.getpid() not in {r["pid"] for r in got}
    for r in got:
        assert r["seen"] == ["marker"]  # each saw only its own sandbox, never a sibling's marker
    assert not (flow_ws / "marker").exists()  # an undeclared write stays in its sandbox


def test_cancelling_an_async_step_kills_its_child(flow_ws: Path, tmp_path: Path) -> None:
    marker = tmp_path / "started"

    @flow(persist_result=False)
    async def cancelled() -> None:
        task = asyncio.ensure_future(waits_forever(str(marker)))
        end = time.monotonic() + 120
        while not (marker.exists() and marker.read_text()):
            assert time.monotonic() < end, "the isolated body never started"
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    child = int(marker.read_text())
    end = time.monotonic() + 60
    while (
        os.path.exists(f"/proc/{child}") and Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] != "Z"
    ):
        assert time.monotonic() < end, "the cancelled body's child is still running"
        time.sleep(0.01)


def test_an_unknown_isolation_is_refused_at_decoration_and_with_options_takes_a_known_one() -> None:
    from smthrs_plugin.errors import CacheError

    with pytest.raises(CacheError) as err:
        sp.step(isolation="sandbox")(lambda x: x)
    assert err.value.code == "invalid_declaration" and "namespace" in err.value.message
    assert shout.with_options(isolation="thread").step_spec.isolation == "thread"


@sp.step(timeout_seconds=3)
def hangs(marker: str) -> None:
    Path(marker).write_text(str(os.getpid()))
    time.sleep(3600)  # the body blocks; Prefect's timeout ends the task run


def test_a_timed_out_sync_step_kills_its_child(flow_ws: Path, tmp_path: Path) -> None:
    marker = tmp_path / "hang-started"

    @flow(persist_result=False)
    def timed_out() -> None:
        hangs(str(marker))

    with pytest.raises(TimeoutError):
        timed_out()
    child = int(marker.read_text())
    end = time.monotonic() + 60
    while (
        os.path.exists(f"/proc/{child}") and Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] != "Z"
    ):
        assert time.monotonic() < end, "the timed-out body's child is still running"
        time.sleep(0.01)
