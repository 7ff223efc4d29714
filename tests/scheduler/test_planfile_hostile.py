"""Hostile plan files: refused at load with ``invalid_plan_file`` naming line and field, exit 2,
in bounded memory, before any idempotency key is spent.

The CLI cases run the real ``smthrs`` entry point in a subprocess under an address-space limit (``RLIMIT_AS``, set
in the child before exec), and the child reports its own peak RSS (``VmHWM`` of its post-exec address space) as it
exits. Not ``wait4``'s ``ru_maxrss``: Linux folds the pre-exec high-water mark into it, so a child forked from a
large test process (the whole suite's pytest grows to hundreds of MB) reports the parent's size. The limit: a normal ``smthrs plan`` /
``smthrs run --key`` of a small file peaks at ~65 MB RSS and still runs under a 256 MiB address-space limit on
the development machine; 1 GiB leaves room for other platforms' thread stacks and malloc arenas while still
stopping a runaway long before it hurts the machine (the alias bomb used to reach 12 GB). The assertion that
matters is the peak RSS: under 200 MB for every refusal.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from smthrs_plugin.errors import PlanError
from smthrs_plugin.plan.compile import DEFAULT_MAXIMUM_PLAN_NODES
from smthrs_plugin.scheduler import _safe_yaml
from smthrs_plugin.scheduler._safe_yaml import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_NODES,
    load_bounded,
    read_bounded,
)
from smthrs_plugin.scheduler.planfile import MAX_ID_CHARS, read_plan_file

ADDRESS_SPACE = 1 << 30
PEAK_RSS_KB = 200 * 1024

BILLION_LAUGHS = (
    "plan: bomb\n"
    "nodes:\n"
    "  - id: a\n"
    "    run: 'true'\n"
    "    with:\n"
    "      a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + "".join(
        f"      {c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
)


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str
    peak_rss_kb: int

    def error(self) -> dict[str, Any]:
        doc = json.loads(self.stdout)
        assert isinstance(doc, dict) and "error" in doc, self.stdout
        return dict(doc["error"])


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


# The console script's own code path (``smthrs_plugin.cli:main``), plus an exit hook that reports the process's
# peak RSS of THIS address space (VmHWM is per address space and starts afresh at exec).
_HWM_MARK = "smthrs-test-vmhwm-kb="
_SMTHRS_REPORTING_PEAK = f"""
import atexit, sys

def _report_peak():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                sys.stderr.write("\\n{_HWM_MARK}" + line.split()[1] + "\\n")

atexit.register(_report_peak)
from smthrs_plugin.cli import main
sys.argv[0] = "smthrs"
sys.exit(main())
"""


def _smthrs(*args: str, cwd: Path) -> Ran:
    """Run the ``smthrs`` entry point under the address-space limit; its peak RSS is what it reports at exit."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SMTHRS_REPORTING_PEAK, *args],
            cwd=cwd,
            stdout=out,
            stderr=err,
            preexec_fn=_limit_address_space,
        )
        try:
            # A deadline far above any command's duration, only so a regression cannot hang the suite.
            proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        out.seek(0)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
        stderr, mark, peak = stderr.rpartition(_HWM_MARK)
        assert mark, f"the child did not report its peak RSS: {stderr}"
        return Ran(proc.returncode, out.read().decode(), stderr.rstrip("\n"), int(peak.split()[0]))


COMMANDS = {
    "plan": lambda f: ("plan", f, "--json"),
    "run --key": lambda f: ("run", f, "--key", "ci-key", "--json"),
}


def _line_of(text: str, prefix: str) -> int:
    return next(i for i, ln in enumerate(text.splitlines(), 1) if ln.startswith(prefix))


def _refused(ws: Path, name: str, text: str, command: str) -> dict[str, Any]:
    (ws / name).write_text(text)
    ran = _smthrs(*COMMANDS[command](name), cwd=ws)
    assert "Traceback" not in ran.stderr, ran.stderr
    assert ran.code == 2, (ran.code, ran.stdout, ran.stderr)
    assert ran.peak_rss_kb < PEAK_RSS_KB, f"peak RSS {ran.peak_rss_kb} KB"
    error = ran.error()
    assert error["code"] == "invalid_plan_file", error
    assert isinstance(error["line"], int) and error["line"] >= 1
    assert f"{name}:{error['line']}:" in error["message"] and error["field"]
    return error


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    d = tmp_path / "ws"
    d.mkdir()
    return d


# ------------------------------------------------------------------------------- the real CLI, bounded


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_alias_bomb_is_refused_at_the_alias_that_crosses_the_budget_in_bounded_memory(
    ws: Path, command: str
) -> None:
    assert len(BILLION_LAUGHS) < 1024
    error = _refused(ws, "bomb.yaml", BILLION_LAUGHS, command)
    assert error["limit"] == MAX_NODES and "alias *e" in error["message"]
    # a..e fit (e is 66,430 nodes); f would be nine copies of e, and the budget runs out inside it.
    assert (error["line"], error["field"]) == (_line_of(BILLION_LAUGHS, "      f:"), "f")


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
def test_five_thousand_open_brackets_are_refused_as_too_deep_not_a_recursion_error(
    ws: Path, command: str
) -> None:
    error = _refused(ws, "deep.yaml", "[" * 5000 + "\n", command)
    assert "nested deeper than 128 levels" in error["message"] and error["line"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_duplicate_approval_key_is_refused_so_a_later_line_cannot_drop_the_gate(
    ws: Path, command: str
) -> None:
    text = "plan: gated\napproval: required\nnodes:\n  - id: deploy\n    run: 'true'\napproval: none\n"
    error = _refused(ws, "dup.yaml", text, command)
    assert (error["line"], error["field"]) == (6, "approval")
    assert "first on line 2" in error["message"]


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_plan_file_may_lower_maximum_plan_nodes_but_never_raise_it(ws: Path, command: str) -> None:
    nodes = "nodes:\n  - id: a\n    run: 'true'\n  - id: b\n    run: 'true'\n"
    error = _refused(
        ws,
        "raise.yaml",
        f"plan: big\nmaximum_plan_nodes: {DEFAULT_MAXIMUM_PLAN_NODES + 1}\n" + nodes,
        command,
    )
    assert (error["line"], error["field"]) == (2, "maximum_plan_nodes")
    error = _refused(ws, "lower.yaml", "plan: small\nmaximum_plan_nodes: 1\n" + nodes, command)
    assert (error["line"], error["field"]) == (6, "nodes")  # the node past the lowered cap


@pytest.mark.slow
@pytest.mark.parametrize("command", [*COMMANDS, "run (no key)"])
def test_a_hundred_thousand_character_node_id_is_refused(ws: Path, command: str) -> None:
    text = f"plan: long\nnodes:\n  - id: {'x' * 100_000}\n    run: 'true'\n"
    if command == "run (no key)":
        (ws / "long.yaml").write_text(text)
        ran = _smthrs("run", "long.yaml", "--json", cwd=ws)
        assert ran.code == 2 and ran.peak_rss_kb < PEAK_RSS_KB, (ran.code, ran.stderr)
        error = ran.error()
    else:
        error = _refused(ws, "long.yaml", text, command)
    assert (error["code"], error["line"], error["field"]) == ("invalid_plan_file", 3, "id")


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_file_over_one_mebibyte_is_refused_before_it_is_parsed(ws: Path, command: str) -> None:
    text = "plan: huge\nnodes:\n  - id: a\n    run: 'true'\n    with: {pad: '" + "x" * MAX_FILE_BYTES + "'}\n"
    error = _refused(ws, "huge.yaml", text, command)
    assert error["limit"] == MAX_FILE_BYTES and error["line"] == 1


@pytest.mark.slow
def test_a_glob_removal_is_refused_at_load_and_the_key_is_not_spent(ws: Path) -> None:
    text = "plan: clean\nnodes:\n  - id: wipe\n    run: 'true'\n    removes: ['*.txt']\n"
    error = _refused(ws, "clean.yaml", text, "run --key")
    assert (error["line"], error["field"]) == (5, "removes") and "glob" in error["message"]
    # The same key with the corrected file is a first use (Accepted), not a Conflict with a spent key.
    (ws / "clean.yaml").write_text(text.replace("'*.txt'", "'old.txt'"))
    ran = _smthrs("run", "clean.yaml", "--key", "ci-key", "--json", cwd=ws)
    assert ran.code == 0, (ran.stdout, ran.stderr)
    doc = json.loads(ran.stdout)
    assert doc["receipt"]["_tag"] == "Accepted" and doc["status"] == "completed"


# ---------------------------------------------------------------------------------- the loader, in process


@pytest.fixture(params=["libyaml", "python"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both event sources: libyaml's parser when installed, and PyYAML's pure-Python one."""
    if request.param == "libyaml":
        if not getattr(yaml, "__with_libyaml__", False):
            pytest.skip("PyYAML built without libyaml")
        monkeypatch.setattr(_safe_yaml, "_Loader", yaml.CSafeLoader)
    else:
        monkeypatch.setattr(_safe_yaml, "_Loader", yaml.SafeLoader)
    return str(request.param)


@pytest.fixture
def small_budget(monkeypatch: pytest.MonkeyPatch) -> int:
    """The same counting with a budget small enough that the pure-Python parser is quick (the real budget is
    exercised by the billion laughs)."""
    monkeypatch.setattr(_safe_yaml, "MAX_NODES", 1_000)
    return 1_000


def _refusal(text: str) -> PlanError:
    with pytest.raises(PlanError) as info:
        load_bounded(text, source="t.yaml")
    assert info.value.code == "invalid_plan_file"
    return info.value


@pytest.mark.parametrize("style", ["flow", "block"])
def test_nesting_of_128_levels_is_accepted_and_129_refused(backend: str, style: str) -> None:
    def nested(depth: int) -> str:
        if style == "flow":
            return "[" * depth + "]" * depth
        return "".join("  " * i + "-\n" for i in range(depth - 1)) + "  " * (depth - 1) + "- x\n"

    ok = load_bounded(nested(MAX_DEPTH), source="t.yaml")
    assert ok is not None
    depth, v = 0, ok.value
    while isinstance(v, list):
        depth, v = depth + 1, (v[0] if v else None)
    assert depth == MAX_DEPTH
    err = _refusal(nested(MAX_DEPTH + 1))
    assert err.details["limit"] == MAX_DEPTH and "nested deeper than 128" in err.message


def test_thousands_of_open_brackets_never_reach_python_recursion(backend: str) -> None:
    for text in ("[" * 5000, "{a: " * 5000, "- " * 5000 + "x"):
        err = _refusal(text)
        assert "nested deeper than 128" in err.message


def test_an_alias_within_the_budget_is_a_copy_equal_to_what_yaml_would_build(backend: str) -> None:
    text = "shared: &src [src/a.py, {deep: [1, 2]}]\nuse:\n  reads: *src\n"
    loaded = load_bounded(text, source="t.yaml")
    assert loaded is not None and loaded.value == yaml.safe_load(text)
    shared, used = loaded.value["shared"], loaded.value["use"]["reads"]
    assert used is not shared and used[1] is not shared[1]  # a tree: no two places share one mutable value
    assert loaded.marks.line(("use", "reads")) == 3


def test_an_alias_that_would_cross_the_node_budget_is_refused_before_it_is_copied(
    backend: str, small_budget: int
) -> None:
    big = small_budget // 2  # the anchored list alone: 1 + big nodes; a second copy crosses the budget
    text = "a: &a [" + ",".join(["x"] * big) + "]\nb: *a\n"
    err = _refusal(text)
    assert (err.details["line"], err.details["field"], err.details["limit"]) == (2, "b", small_budget)
    assert "alias *a" in err.message
    fits = "a: &a [" + ",".join(["x"] * (big - 10)) + "]\nb: *a\n"
    assert load_bounded(fits, source="t.yaml") is not None


def test_the_billion_laughs_is_refused_by_the_budget(backend: str) -> None:
    err = _refusal(BILLION_LAUGHS)
    assert err.details["field"] == "f" and err.details["limit"] == MAX_NODES


def test_a_document_over_the_node_budget_is_refused_even_without_aliases(
    backend: str, small_budget: int
) -> None:
    err = _refusal("a: [" + ",".join(["1"] * small_budget) + "]\n")
    assert err.details["limit"] == small_budget


@pytest.mark.parametrize(
    ("text", "line", "field", "words"),
    [
        ("a: 1\nb: 2\na: 3\n", 3, "a", "duplicate key 'a' (first on line 1)"),
        ("n:\n  - id: x\n    id: y\n", 3, "id", "duplicate key 'id'"),
        ("'a': 1\na: 2\n", 2, "a", "duplicate key"),  # quoting does not make another key
        ("1: x\n", 1, "(document)", "must be a string"),
        ("n:\n  ~: x\n", 2, "n", "must be a string"),
        ("n:\n  true: x\n", 2, "n", "must be a string"),
        ("? [a]\n: b\n", 1, "(document)", "plain string"),
        ("k: &k x\nm:\n  *k : 1\n", 3, "m", "cannot be a mapping key"),
        ("a: &a {x: 1}\nb:\n  <<: *a\n", 3, "b", "merge keys"),
        ("a: &a [*a]\n", 1, "a", "recursive alias"),
        ("a: *nowhere\n", 1, "a", "names no anchor"),
        ("a: &x 1\nb: &x 2\n", 2, "b", "defined twice"),
        ("a: !!python/object:os.system x\n", 1, "a", "not allowed"),
        ("a: !!binary aGk=\n", 1, "a", "not allowed"),
        ("a: !!set {x}\n", 1, "a", "not allowed"),
        ("a: " + "9" * 5000 + "\n", 1, "a", "not a valid int"),
        ("a: 1\n---\nb: 2\n", 2, "(document)", "one YAML document"),
        ("a: [1, 2\nb: 3\n", 2, "(document)", "not valid YAML"),
    ],
)
def test_a_malformed_document_is_refused_naming_line_and_field(
    backend: str, text: str, line: int, field: str, words: str
) -> None:
    err = _refusal(text)
    assert (err.details["line"], err.details["field"]) == (line, field), err.message
    assert words in err.message and err.message.startswith(f"t.yaml:{line}:")


def test_an_accepted_document_is_what_safe_load_builds_with_lines_by_path(backend: str) -> None:
    text = (
        "plan: p\n"
        "nodes:\n"
        "  - id: a\n"
        "    run: 'true'\n"
        "    with: {n: 1, f: 1.5, b: yes, z: null, s: '2', t: 2024-01-01}\n"
        "  - id: b\n"
        "    reads:\n"
        "      - x\n"
        "      - y\n"
    )
    loaded = load_bounded(text, source="t.yaml")
    assert loaded is not None and loaded.value == yaml.safe_load(text)
    line = loaded.marks.line
    assert line(("nodes", 1, "reads", 1)) == 9 and line(("nodes", 0, "with", "f")) == 5
    assert line(("nodes", 1)) == 6 and line(("nodes", 1, "missing", 3)) == 6 and line(()) == 1
    assert load_bounded("", source="t.yaml") is None


def test_a_file_is_read_up_to_the_limit_and_no_further(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_bytes(b"#" * 10)
    assert read_bounded(f, limit=10) == "#" * 10
    f.write_bytes(b"#" * 11)
    with pytest.raises(PlanError) as info:
        read_bounded(f, limit=10)
    assert info.value.code == "invalid_plan_file" and info.value.details["limit"] == 10
    f.write_bytes(b"a: 1\nb: \xff\n")
    with pytest.raises(PlanError) as info:
        read_bounded(f)
    assert info.value.details["line"] == 2 and "UTF-8" in info.value.message


# ------------------------------------------------------------------------------ read_plan_file, in process


def _plan(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "plan.yaml"
    p.write_text(text)
    return p


def test_an_id_of_the_bound_is_accepted_and_one_more_character_refused(tmp_path: Path) -> None:
    body = "plan: p\nnodes:\n  - id: {}\n    run: 'true'\n"
    pf = read_plan_file(_plan(tmp_path, body.format("n" * MAX_ID_CHARS)))
    assert pf.plan.node("n" * MAX_ID_CHARS) is not None
    with pytest.raises(PlanError) as info:
        read_plan_file(_plan(tmp_path, body.format("n" * (MAX_ID_CHARS + 1))))
    assert (info.value.details["line"], info.value.details["field"]) == (3, "id")
    with pytest.raises(PlanError) as info:
        read_plan_file(
            _plan(tmp_path, f"plan: {'p' * (MAX_ID_CHARS + 1)}\nnodes:\n  - id: a\n    run: 'true'\n")
        )
    assert (info.value.details["line"], info.value.details["field"]) == (1, "plan")


def test_a_lowered_maximum_is_kept_and_an_unknown_approval_is_refused_at_load(tmp_path: Path) -> None:
    pf = read_plan_file(
        _plan(tmp_path, "plan: p\nmaximum_plan_nodes: 5\nnodes:\n  - id: a\n    run: 'true'\n")
    )
    assert pf.plan.maximum_plan_nodes == 5
    with pytest.raises(PlanError) as info:
        read_plan_file(_plan(tmp_path, "plan: p\napproval: maybe\nnodes:\n  - id: a\n    run: 'true'\n"))
    assert (info.value.code, info.value.details["line"], info.value.details["field"]) == (
        "invalid_plan_file",
        2,
        "approval",
    )


def test_a_glob_removal_is_located_at_its_item(tmp_path: Path) -> None:
    text = "plan: p\nnodes:\n  - id: a\n    run: 'true'\n    removes:\n      - old.txt\n      - 'build/*.o'\n"
    with pytest.raises(PlanError) as info:
        read_plan_file(_plan(tmp_path, text))
    assert (info.value.details["line"], info.value.details["field"]) == (7, "removes")
