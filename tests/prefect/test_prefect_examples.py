"""Every example, run as its own process against the session's Prefect server: the quickstart demo, the shared
S3 cache (a second process with a fresh workspace gets verified shared hits, byte-identical files), Dask scale-out
(PostgreSQL when configured) and the installable third-party plugin (discovered through its entry point)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _prefect_support import REPO, run_py

pytestmark = pytest.mark.prefect

EXAMPLES = REPO / "examples"
POSTGRES_URL = os.environ.get("SMTHRS_TEST_POSTGRES_URL")


def test_the_quickstart_demo_builds_then_serves_everything_clean(tmp_path: Path) -> None:
    qs = [str(EXAMPLES / "quickstart.py"), "--workspace", str(tmp_path / "qs"), "--rows", "3000"]
    proc = run_py([*qs, "--json"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, second = json.loads(proc.stdout.strip().splitlines()[-1])["runs"]
    names = ["clean", "aggregate", "summarize", "histogram", "checksums"]
    assert [(r["name"], r["kind"], r["outcome"]) for r in first] == [
        (n, "step" if i < 3 else "plan node", "built") for i, n in enumerate(names)
    ]
    assert [r["outcome"] for r in second] == ["clean"] * 5
    assert (tmp_path / "qs/reports/SHA256SUMS").exists()  # replayed by run 2 after the demo deleted reports/
    table = run_py([*qs, "--keep"], cwd=tmp_path)  # the human form: a rich table (run 1 is clean too: --keep)
    assert table.returncode == 0 and "smthrs quickstart" in table.stdout and "time saved" in table.stdout


def test_shared_s3_cache_a_second_process_with_a_fresh_workspace_gets_verified_shared_hits(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str
) -> None:
    proc = run_py(
        [
            str(EXAMPLES / "shared_s3_cache.py"),
            "--endpoint",
            s3_endpoint,
            "--bucket",
            s3_bucket,
            "--workdir",
            str(tmp_path),
            "--json",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"] is True and out["artifacts"] == f"s3://{s3_bucket}/cache"
    assert [s["outcome"] for s in out["machine_a"]["steps"]] == ["built"] * 3
    assert [(s["outcome"], s["decision"], s["tier"]) for s in out["machine_b"]["steps"]] == [
        ("clean", "VerifiedHit", "shared")
    ] * 3
    a, b = tmp_path / "machine-a", tmp_path / "machine-b"
    for name in ("out/words.json", "out/top.json", "out/report.txt"):
        assert (b / name).read_bytes() == (a / name).read_bytes()
    assert (b / ".smthrs/state.db").exists() and (a / ".smthrs/state.db").exists()  # two separate databases


def test_dask_scale_out_runs_the_plan_on_workers_that_cannot_see_the_workspace_then_all_clean(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str, request: pytest.FixtureRequest
) -> None:
    args = [str(EXAMPLES / "dask_scale_out.py"), "--endpoint", s3_endpoint, "--bucket", s3_bucket]
    args += [
        "--workspace",
        str(tmp_path / "ws"),
        "--parts",
        "4",
        "--rounds",
        "2000",
        "--workers",
        "2",
        "--json",
    ]
    if POSTGRES_URL:
        args += ["--db", request.getfixturevalue("postgres_url")]
    else:
        args += [
            "--sqlite"
        ]  # the example's explicit single-machine fallback (PostgreSQL not configured here)
    proc = run_py(args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    first, second = out["runs"]
    assert set(first["outcomes"].values()) == {"built"} and len(first["outcomes"]) == 5
    assert set(second["outcomes"].values()) == {"clean"}
    assert out["flow_pid"] not in out["worker_pids"] and len(out["worker_pids"]) >= 1
    assert ("postgresql" in args[-1]) == (POSTGRES_URL is not None)
    # Run as root (as CI is), the workers get an empty tmpfs over the workspace: the outputs still arrive.
    assert out["workspace_hidden"] == (os.geteuid() == 0)
    assert not any(r["sees_workspace"] for r in first["results"].values()) or not out["workspace_hidden"]
    assert (tmp_path / "ws/out/all.txt").read_text().count("in/part-") == 4


def test_dask_scale_out_refuses_to_guess_a_database() -> None:
    proc = run_py([str(EXAMPLES / "dask_scale_out.py")], cwd=REPO, env={"SMTHRS_DB_URL": ""})
    assert proc.returncode == 2 and "PostgreSQL URL" in proc.stderr


@pytest.fixture(scope="session")
def installed_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The example plugin, pip-installed ONCE into a private target directory (never into the shared venv)."""
    src = tmp_path_factory.mktemp("plugin-src") / "third_party_plugin"
    shutil.copytree(EXAMPLES / "third_party_plugin", src)
    target = tmp_path_factory.mktemp("plugin-site")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(target.glob("smthrs_example_plugin-*.dist-info"))
    yield target


def test_an_installed_plugin_is_discovered_without_code_change_and_its_hooks_are_called(
    installed_plugin: Path, tmp_path: Path
) -> None:
    work = tmp_path / "proj"
    shutil.copytree(
        EXAMPLES / "third_party_plugin", work, ignore=shutil.ignore_patterns("smthrs_example_plugin")
    )
    env = {"PYTHONPATH": str(installed_plugin), "SMTHRS_EXAMPLE_LOG": str(tmp_path / "observed.jsonl")}
    smthrs = [str(Path(sys.executable).with_name("smthrs"))]
    listed = subprocess.run(
        [*smthrs, "plugins", "--json"],
        cwd=work,
        env={**_env(), **env},
        capture_output=True,
        text=True,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    info = json.loads(listed.stdout)
    example = next(p for p in info["plugins"] if p["name"] == "example")
    assert example["distribution"] == "smthrs-example-plugin" and example["source"] == "entry-point"
    assert set(example["hooks"]) == {"smthrs_plan_actions", "smthrs_node_settled", "smthrs_value_codecs"}
    assert info["actions"] == {"shout": "example"}

    ran = subprocess.run(
        [*smthrs, "run", "plan.yaml", "--json"],
        cwd=work,
        env={**_env(), **env},
        capture_output=True,
        text=True,
        check=False,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert json.loads(ran.stdout)["settlements"][0]["outcome"] == "built"
    assert (work / "greeting.txt").read_text() == "HELLO FROM A PLUGIN!\n"  # the plugin's action ran
    (line,) = [json.loads(x) for x in (tmp_path / "observed.jsonl").read_text().splitlines()]
    assert line["node"] == "greet" and line["outcome"] == "built" and line["plan_id"] == "plugin-demo"

    # The same installation also observes @step calls (plan_id null) — still no code change anywhere.
    snippet = (
        "import smthrs_plugin as sp\n"
        "@sp.step\n"
        "def double(x: int) -> int:\n"
        "    return 2 * x\n"
        "assert double(4) == 8\n"
    )
    (work / "use_step.py").write_text(snippet)
    stepped = run_py([str(work / "use_step.py")], cwd=work, env={**env, "SMTHRS_WORKSPACE": str(work)})
    assert stepped.returncode == 0, stepped.stderr
    lines = [json.loads(x) for x in (tmp_path / "observed.jsonl").read_text().splitlines()]
    assert lines[-1]["node"] == "double" and lines[-1]["plan_id"] is None and lines[-1]["outcome"] == "built"


def _env() -> dict[str, str]:
    return dict(os.environ)
