"""Isolated bodies with real processes: every workspace path a body uses means its sandbox, or is refused typed."""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _procs import alive

from smthrs_plugin.boundary import (
    Declaration,
    IsolatedCall,
    UndeclaredPath,
    namespace_available,
    resolve_isolation,
)
from smthrs_plugin.errors import BoundaryError, BoundaryRefusal

NAMESPACE = namespace_available()
needs_namespace = pytest.mark.skipif(
    not NAMESPACE and os.environ.get("CI") != "true", reason="this kernel refuses private mount namespaces"
)
DEADLINE_S = 60.0


def read(path: Any) -> str:
    """A plain ``open`` as a flow author writes it (what the isolation must see)."""
    with open(path) as f:
        return f.read()


def write(path: Any, text: str) -> int:
    with open(path, "w") as f:
        return f.write(text)


def wait_until(cond: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """A workspace with a declared read and a secret, and a sandbox root seeded with the declared read only."""
    ws = tmp_path / "ws"
    (ws / "data").mkdir(parents=True)
    (ws / "data/raw.csv").write_text("1\n2\n")
    (ws / "secret.txt").write_text("not declared")
    root = tmp_path / "sandbox" / "root"
    (root / "data").mkdir(parents=True)
    (root / "data/raw.csv").write_text("1\n2\n")
    return ws, root


DECL = Declaration.of(reads=["data/raw.csv"], writes=["out/x.csv", "out/abs.csv", "out/sub.csv"])


def _call(tree: tuple[Path, Path], kind: str, decl: Declaration = DECL) -> IsolatedCall:
    ws, root = tree
    return IsolatedCall(ws, root, decl, kind, subject="demo")  # type: ignore[arg-type]


def _ws_files(ws: Path) -> list[str]:
    return sorted(str(p.relative_to(ws)) for p in ws.rglob("*") if p.is_file())


@needs_namespace
def test_relative_absolute_and_subprocess_writes_land_in_the_sandbox_in_a_namespace(
    tree: tuple[Path, Path],
) -> None:
    ws, root = tree

    def body() -> str:
        os.makedirs("out", exist_ok=True)
        with open("out/x.csv", "w") as f:
            f.write(read("data/raw.csv") + "3\n")
        with open(ws / "out" / "abs.csv", "w") as f:  # an absolute path under the workspace
            f.write("abs")
        subprocess.run(["sh", "-c", f"cat {ws}/data/raw.csv > {ws}/out/sub.csv"], check=True)
        return os.getcwd()

    assert _call(tree, "namespace").run(body) == str(ws)
    assert _ws_files(ws) == ["data/raw.csv", "secret.txt"]  # the live workspace is untouched
    assert (root / "out/x.csv").read_text() == "1\n2\n3\n"
    assert (root / "out/abs.csv").read_text() == "abs"
    assert (root / "out/sub.csv").read_text() == "1\n2\n"


@needs_namespace
@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_an_undeclared_read_is_a_typed_refusal_naming_the_path(tree: tuple[Path, Path], how: str) -> None:
    ws, _ = tree
    path = "secret.txt" if how == "relative" else str(ws / "secret.txt")
    with pytest.raises(BoundaryRefusal) as err:
        _call(tree, "namespace").run(lambda: read(path))
    assert err.value.code == "undeclared_read"
    assert err.value.details["path"] == "secret.txt"
    assert "reads=['secret.txt']" in err.value.message


@needs_namespace
def test_code_below_python_sees_only_the_sandbox(tree: tuple[Path, Path]) -> None:
    ws, _ = tree

    def body() -> int:
        return subprocess.run(["cat", str(ws / "secret.txt")], capture_output=True).returncode

    assert _call(tree, "namespace").run(body) != 0  # no such file in the sandbox: never the live secret


@needs_namespace
def test_a_body_may_read_back_what_it_wrote(tree: tuple[Path, Path]) -> None:
    def body() -> str:
        os.makedirs("out", exist_ok=True)
        Path("out/x.csv").write_text("mine")
        return Path("out/x.csv").read_text()

    assert _call(tree, "namespace").run(body) == "mine"


@needs_namespace
def test_the_workspace_venv_stays_readable_and_read_only(tree: tuple[Path, Path]) -> None:
    ws, root = tree
    (ws / ".venv").mkdir()
    (ws / ".venv/marker").write_text("env")

    def body() -> tuple[str, str]:
        text = Path(".venv/marker").read_text()
        try:
            Path(".venv/new").write_text("x")
        except OSError as exc:
            return text, type(exc).__name__
        return text, "written"

    text, write = _call(tree, "namespace").run(body)
    assert text == "env"
    assert write == "OSError"  # EROFS
    assert not (ws / ".venv/new").exists()
    assert not (root / ".venv").exists()  # the mount point is not left in the sandbox


@needs_namespace
def test_a_project_module_imported_lazily_by_the_body_is_still_found(tree: tuple[Path, Path]) -> None:
    ws, _ = tree
    (ws / "lazyhelper_iso.py").write_text("VALUE = 41\n")
    sys.path.insert(0, str(ws))
    try:

        def body() -> int:
            import lazyhelper_iso  # type: ignore[import-not-found]

            return int(lazyhelper_iso.VALUE) + 1

        assert _call(tree, "namespace").run(body) == 42
    finally:
        sys.path.remove(str(ws))
        sys.modules.pop("lazyhelper_iso", None)


def test_process_isolation_runs_in_the_sandbox_and_refuses_live_workspace_paths(
    tree: tuple[Path, Path],
) -> None:
    ws, root = tree

    def body() -> str:
        os.makedirs("out", exist_ok=True)
        Path("out/x.csv").write_text(Path("data/raw.csv").read_text())
        return os.getcwd()

    assert _call(tree, "process").run(body) == str(root)
    assert (root / "out/x.csv").read_text() == "1\n2\n"
    # A declared read named by its live absolute path: refused, with how to reach it instead.
    with pytest.raises(UndeclaredPath) as err:
        _call(tree, "process").run(lambda: read(ws / "data/raw.csv"))
    assert err.value.code == "undeclared_read" and "relative to the working directory" in err.value.message
    with pytest.raises(UndeclaredPath) as err:
        _call(tree, "process").run(lambda: write(ws / "out/x.csv", "x"))
    assert err.value.code == "undeclared_write"
    with pytest.raises(UndeclaredPath) as err:
        _call(tree, "process").run(lambda: read("secret.txt"))
    assert err.value.code == "undeclared_read"
    assert _ws_files(ws) == ["data/raw.csv", "secret.txt"]


def test_thread_isolation_refuses_plain_workspace_paths_and_serves_ws(
    tree: tuple[Path, Path], monkeypatch: Any
) -> None:
    ws, root = tree
    monkeypatch.chdir(ws)  # a flow author's usual working directory: the workspace
    with pytest.raises(UndeclaredPath) as err:
        _call(tree, "thread").run(lambda: read("data/raw.csv"))
    assert "through `ws` only" in err.value.message
    assert _call(tree, "thread").run(lambda: (root / "data/raw.csv").read_text()) == "1\n2\n"
    # Outside a guarded body the same thread opens freely.
    assert Path("secret.txt").read_text() == "not declared"


@pytest.mark.parametrize("kind", ["process", pytest.param("namespace", marks=needs_namespace)])
def test_an_exception_keeps_its_type_and_the_child_traceback(tree: tuple[Path, Path], kind: str) -> None:
    def failing_body_function() -> None:
        raise KeyError("missing column")

    with pytest.raises(KeyError) as err:
        _call(tree, kind).run(failing_body_function)
    notes = "".join(getattr(err.value, "__notes__", []))
    assert "failing_body_function" in notes and f"{kind} isolation" in notes


def test_a_value_that_cannot_cross_is_a_typed_error(tree: tuple[Path, Path]) -> None:
    with pytest.raises(BoundaryError) as err:
        _call(tree, "process").run(lambda: threading.Lock())
    assert err.value.code == "value_not_transferable"


def test_log_records_of_the_child_reach_the_parent_logger(tree: tuple[Path, Path], caplog: Any) -> None:
    def body() -> int:
        logging.getLogger("smthrs.test.isolated").warning("from the child %s", "pid")
        return os.getpid()

    with caplog.at_level(logging.INFO, logger="smthrs.test.isolated"):
        child = _call(tree, "process").run(body)
    assert child != os.getpid()
    assert [r.getMessage() for r in caplog.records if r.name == "smthrs.test.isolated"] == [
        "from the child pid"
    ]


def test_a_child_killed_by_sigkill_is_a_typed_failure(tree: tuple[Path, Path]) -> None:
    with pytest.raises(BoundaryError) as err:
        _call(tree, "process").run(lambda: os.kill(os.getpid(), signal.SIGKILL))
    assert err.value.code == "body_died" and "SIGKILL" in err.value.message


def test_kill_from_another_thread_ends_a_running_body(tree: tuple[Path, Path], tmp_path: Path) -> None:
    started = tmp_path / "started"
    call = _call(tree, "process")

    def body() -> None:
        started.write_text(str(os.getpid()))
        time.sleep(3600)  # the body itself blocks; the test waits on the marker, never on time

    killer = threading.Thread(target=lambda: (wait_until(started.exists, "the body to start"), call.kill()))
    killer.start()
    with pytest.raises(BoundaryError) as err:
        call.run(body)
    killer.join()
    assert err.value.code == "body_died" and "cancelled" in err.value.message


def test_what_the_body_left_running_is_killed_with_it(tree: tuple[Path, Path], tmp_path: Path) -> None:
    pidfile = tmp_path / "bg.pid"

    def body() -> None:
        proc = subprocess.Popen(["sleep", "3600"])
        pidfile.write_text(str(proc.pid))

    _call(tree, "process").run(body)
    pid = int(pidfile.read_text())
    wait_until(lambda: not alive(pid), "the left-behind process to be killed")


@pytest.mark.parametrize("kind", ["process", pytest.param("namespace", marks=needs_namespace)])
def test_eight_bodies_building_at_once_each_see_only_their_own_sandbox(tmp_path: Path, kind: str) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "data.txt").write_text("live")
    results: dict[int, Any] = {}

    def one(i: int) -> None:
        root = tmp_path / f"sb{i}" / "root"
        root.mkdir(parents=True)
        (root / "data.txt").write_text(f"sandbox {i}")
        call = IsolatedCall(ws, root, Declaration.of(reads=["data.txt"], writes=["out.txt"]), kind)  # type: ignore[arg-type]

        def body() -> str:
            text = Path("data.txt").read_text()
            Path("out.txt").write_text(text.upper())
            return text

        try:
            results[i] = call.run(body)
        except BaseException as exc:  # reported below, with the others
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"sandbox {i}" for i in range(8)}
    for i in range(8):
        assert (tmp_path / f"sb{i}/root/out.txt").read_text() == f"SANDBOX {i}"
    assert sorted(p.name for p in ws.iterdir()) == ["data.txt"]


@needs_namespace
def test_a_non_root_user_gets_the_namespace_view_or_a_typed_refusal_and_process() -> None:
    """Whether a kernel lets an unprivileged user mount inside its own user namespace is the machine's choice
    (security modules and sysctls refuse it). Either way the promise holds: where the probe allows it the body
    sees the namespace view; where not, an explicit ``namespace`` is a typed refusal and ``auto`` runs the body
    as ``process`` with the same refusals — never a failure at the first step."""
    if os.getuid() != 0:
        pytest.skip("already not root: the other tests cover this user")
    nobody = pwd.getpwnam("nobody")
    # Outside pytest's own temporary tree, whose parents only root may enter.
    tmp_path = Path(tempfile.mkdtemp(prefix="smthrs-nonroot-", dir="/tmp"))
    tmp_path.chmod(0o777)
    ws = tmp_path / "ws"
    (ws / "data").mkdir(parents=True)
    (ws / "data/raw.csv").write_text("x")
    (ws / "secret.txt").write_text("s")
    root = tmp_path / "sb" / "root"
    (root / "data").mkdir(parents=True)
    (root / "data/raw.csv").write_text("x")
    for p in (ws, ws / "data", tmp_path / "sb", root, root / "data"):
        p.chmod(0o777)
    # A fresh interpreter forks the non-root child, not this test worker: libraries an earlier test loaded here may
    # restart threads in every forked child (os.register_at_fork), and a user namespace needs a single thread.
    script = textwrap.dedent(
        f"""
        import ctypes, os, sys, tempfile, traceback
        from pathlib import Path
        from smthrs_plugin.boundary import Declaration, IsolatedCall, resolve_isolation
        from smthrs_plugin.errors import BoundaryError, BoundaryRefusal

        ws, root = Path({str(ws)!r}), Path({str(root)!r})
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(r)
                os.setgroups([])
                os.setresgid({nobody.pw_gid}, {nobody.pw_gid}, {nobody.pw_gid})
                os.setresuid({nobody.pw_uid}, {nobody.pw_uid}, {nobody.pw_uid})
                ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: /proc/self/uid_map is writable again
                tempfile.tempdir = {str(tmp_path)!r}  # the suite's own temporary directory is root's alone
                try:
                    kind = resolve_isolation("namespace", workspace=ws)
                except BoundaryError as exc:
                    assert exc.code == "isolation_unavailable", exc
                    kind = resolve_isolation("auto", workspace=ws)
                call = IsolatedCall(ws, root, Declaration.of(reads=["data/raw.csv"], writes=["out.txt"]), kind)
                # In a namespace even the absolute workspace path lands in the sandbox; in a process, the relative.
                target = ws / "out.txt" if kind == "namespace" else Path("out.txt")

                def body():
                    target.write_text(Path("data/raw.csv").read_text() + str(os.getuid()))
                    try:
                        with open(ws / "secret.txt") as f:  # a plain open, as a flow author writes it
                            f.read()
                    except BoundaryRefusal as exc:
                        return exc.code
                    return "read the secret"

                os.write(w, f"{{kind}} {{call.run(body)}}".encode())
                code = 0
            except BaseException as exc:
                os.write(w, "".join(traceback.format_exception(exc)).encode())
            finally:
                os._exit(code)
        os.close(w)
        out = b""
        while chunk := os.read(r, 4096):
            out += chunk
        _, status = os.waitpid(pid, 0)
        sys.stdout.write(out.decode(errors="replace"))
        sys.exit(os.waitstatus_to_exitcode(status))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(done.stdout + done.stderr, pytrace=False)  # the whole traceback, untruncated
    out = done.stdout.encode()
    assert out.decode() in ("namespace undeclared_read", "process undeclared_read")
    assert (root / "out.txt").read_text() == f"x{nobody.pw_uid}"
    assert (root / "out.txt").stat().st_uid == nobody.pw_uid  # owned by the user, not a mapped root
    assert not (ws / "out.txt").exists()
    shutil.rmtree(tmp_path)


def test_the_child_dies_with_its_parent(tmp_path: Path) -> None:
    ws, root = tmp_path / "ws", tmp_path / "sb" / "root"
    ws.mkdir()
    root.mkdir(parents=True)
    pidfile = tmp_path / "child.pid"
    script = textwrap.dedent(
        f"""
        import os, time
        from smthrs_plugin.boundary import Declaration, IsolatedCall
        def body():
            open({str(pidfile)!r}, "w").write(str(os.getpid()))
            time.sleep(3600)
        IsolatedCall({str(ws)!r}, {str(root)!r}, Declaration.of(), "process").run(body)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        wait_until(lambda: pidfile.exists() and pidfile.read_text() != "", "the isolated body to start")
        child = int(pidfile.read_text())
        parent.kill()
        parent.wait()
        wait_until(lambda: not alive(child), "the orphaned child to die")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_an_unknown_isolation_is_refused() -> None:
    with pytest.raises(BoundaryError) as err:
        resolve_isolation("sandbox-please")
    assert err.value.code == "unsupported_boundary"


def test_namespace_where_the_kernel_refuses_it_is_typed_never_downgraded(monkeypatch: Any) -> None:
    import smthrs_plugin.boundary._isolate as iso

    monkeypatch.setitem(iso._PROBE, "", False)
    with pytest.raises(BoundaryError) as err:
        resolve_isolation("namespace", subject="s")
    assert err.value.code == "isolation_unavailable"
    assert resolve_isolation("auto") == "process"  # auto says so in the log and on the journal record


def test_the_probe_is_per_workspace_so_one_refusing_mount_does_not_decide_for_another(
    tmp_path: Path, monkeypatch: Any
) -> None:
    import smthrs_plugin.boundary._isolate as iso

    refusing, other = tmp_path / "on-a-refusing-mount", tmp_path / "elsewhere"
    refusing.mkdir()
    other.mkdir()
    monkeypatch.setitem(iso._PROBE, str(refusing), False)
    assert resolve_isolation("auto", workspace=refusing) == "process"
    with pytest.raises(BoundaryError) as err:
        resolve_isolation("namespace", workspace=refusing)
    assert err.value.code == "isolation_unavailable"
    assert resolve_isolation("auto", workspace=other) == ("namespace" if NAMESPACE else "process")


@needs_namespace
def test_the_probe_sets_up_the_whole_view_not_only_the_namespace(tmp_path: Path) -> None:
    # A workspace with a Python environment in it: the probe binds the sandbox over it and rebinds .venv
    # read-only, exactly as a body's child does, and leaves nothing behind.
    ws = tmp_path / "ws"
    (ws / ".venv").mkdir(parents=True)
    assert namespace_available(ws)
    assert sorted(p.name for p in ws.iterdir()) == [".venv"]


def test_a_process_holding_many_descriptors_still_waits_on_its_child(tree: tuple[Path, Path]) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("this process may not open 1,200 descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # the child's pipe is numbered past 1024
    try:
        assert _call(tree, "process").run(lambda: 42) == 42
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
