"""A ``@sp.step``'s identity is complete and stable: it folds every project module the step reaches (a helper's
edit rebuilds exactly the steps that reach it), the versions of the installed distributions it reaches, and names
a ``__main__`` script's step by its import name (``python pipe.py`` and ``import pipe`` share entries). A bare step
name is enough for ``smthrs cache explain``, which names the changed module."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _prefect_support import run_py
from typer.testing import CliRunner

import smthrs_plugin as sp
from smthrs_plugin.cache.explain import diff_components
from smthrs_plugin.cli import app
from smthrs_plugin.errors import CacheError
from smthrs_plugin.prefect import _reach
from smthrs_plugin.prefect._reach import module_name_of, name_from_path, step_identity
from smthrs_plugin.prefect.steprun import current_spec

pytestmark = pytest.mark.prefect

HELPERS = """\
FACTOR = 2


def scale(x: int) -> int:
    return x * FACTOR
"""
#: Steps in modules of their own: two reach the helper (a module reference, a `from` import), one does not.
STEP_MODULES = {
    "shop_pipe": """\
import shop_helpers

import smthrs_plugin as sp


@sp.step
def total(x: int) -> int:
    return x * shop_helpers.FACTOR
""",
    "shop_scaling": """\
from shop_helpers import scale

import smthrs_plugin as sp


@sp.step
def scaled(x: int) -> int:
    return scale(x)
""",
    "shop_other": """\
import smthrs_plugin as sp


@sp.step(name="tally")
def count(x: int) -> int:
    return x + 1
""",
    "shop_twin": """\
import smthrs_plugin as sp


@sp.step
def total(x: int) -> int:
    return x + 100
""",
}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A project directory on ``sys.path``; every module imported from it is dropped again afterwards."""
    root = tmp_path / "proj"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    # An edit keeping a file's size within one second of its bytecode would be served from a stale .pyc.
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    before = set(sys.modules)
    yield root
    for name in set(sys.modules) - before:
        if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.fixture
def shop(project: Path) -> Path:
    _write(project / "shop_helpers.py", HELPERS)
    _write(project / "shop_notes.py", 'NOTE = "draft"\n')
    for name, text in STEP_MODULES.items():
        _write(project / f"{name}.py", text)
    return project


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    root = tmp_path / "ws"
    root.mkdir()
    with sp.step_settings(workspace=root) as spec:
        yield root, spec.db_url


def _fresh(*names: str) -> list[types.ModuleType]:
    """Import the project modules again, as a new process would: their steps are decorated anew."""
    for name in [*STEP_MODULES, "shop_helpers", "shop_notes"]:
        sys.modules.pop(name, None)
    importlib.invalidate_caches()
    return [importlib.import_module(n) for n in names]


def _new_outcomes(seen: set[str]) -> dict[str, str]:
    """``{step identity: outcome}`` of the step calls settled since the last look (each call is a run)."""
    rt = current_spec().open()
    out: dict[str, str] = {}
    for run in rt.runs.list():
        if run.run_id in seen:
            continue
        seen.add(run.run_id)
        for e in rt.journal.read(run.run_id):
            if e.type == "step-settled":
                out[e.payload["step"]] = e.payload["outcome"]
    return out


def _call_all() -> dict[str, int]:
    pipe, scaling, other = _fresh("shop_pipe", "shop_scaling", "shop_other")
    return {"total": pipe.total(5), "scaled": scaling.scaled(5), "count": other.count(5)}


def test_editing_a_helper_module_rebuilds_exactly_the_steps_that_reach_it(
    shop: Path, ws: tuple[Path, str]
) -> None:
    seen: set[str] = set()
    assert _call_all() == {"total": 10, "scaled": 10, "count": 6}
    assert set(_new_outcomes(seen).values()) == {"built"}

    (shop / "shop_helpers.py").write_text(HELPERS.replace("FACTOR = 2", "FACTOR = 30"))
    assert _call_all() == {"total": 150, "scaled": 150, "count": 6}  # never the stale 10
    assert _new_outcomes(seen) == {
        "shop_pipe:total": "built",  # reaches it through a module reference
        "shop_scaling:scaled": "built",  # through `from shop_helpers import scale`
        "shop_other:count": "clean",  # does not reach it
    }
    pipe, other = _fresh("shop_pipe", "shop_other")
    assert set(pipe.total.step_spec.body["step"]["modules"]) == {"shop_pipe", "shop_helpers"}
    assert set(other.count.step_spec.body["step"]["modules"]) == {"shop_other"}


def test_editing_a_project_file_no_step_reaches_rebuilds_nothing(shop: Path, ws: tuple[Path, str]) -> None:
    seen: set[str] = set()
    _call_all()
    assert set(_new_outcomes(seen).values()) == {"built"}
    (shop / "shop_notes.py").write_text('NOTE = "final, and longer"\n')
    _write(shop / "shop_new.py", "import shop_helpers\n")  # a new module importing the helper changes nothing
    assert _call_all() == {"total": 10, "scaled": 10, "count": 6}
    assert set(_new_outcomes(seen).values()) == {"clean"}


PIPE_SCRIPT = """\
import json
import sys

import helpers

import smthrs_plugin as sp


@sp.step
def total(x: int) -> int:
    return x * helpers.FACTOR


def main(workspace: str) -> None:
    with sp.step_settings(workspace=workspace):
        value = total(21)
    print(json.dumps({"identity": total.step_spec.identity, "value": value}))


if __name__ == "__main__":
    main(sys.argv[1])
"""


def test_a_script_and_its_import_key_a_step_alike_so_the_import_hits(tmp_path: Path) -> None:
    project, workspace = tmp_path / "proj", tmp_path / "ws"
    _write(project / "helpers.py", HELPERS)
    _write(project / "pipe.py", PIPE_SCRIPT)
    workspace.mkdir()
    as_script = run_py(["pipe.py", str(workspace)], cwd=project)
    assert as_script.returncode == 0, as_script.stderr
    imported = run_py(["-c", "import sys, pipe; pipe.main(sys.argv[1])", str(workspace)], cwd=project)
    assert imported.returncode == 0, imported.stderr
    for done in (as_script, imported):
        assert json.loads(done.stdout.strip().splitlines()[-1]) == {"identity": "pipe:total", "value": 42}

    with sp.open_runtime(workspace) as rt:
        settled = [
            e.payload for r in rt.runs.list() for e in rt.journal.read(r.run_id) if e.type == "step-settled"
        ]
    assert {p["step"] for p in settled} == {"pipe:total"}
    assert len({p["dispatch_key"] for p in settled}) == 1  # one key, whichever way the module was loaded
    assert sorted(p["outcome"] for p in settled) == ["built", "clean"]  # the second process hit the first's


def test_a_main_script_is_named_by_its_spec_or_its_path_from_sys_path(project: Path) -> None:
    _write(project / "flows/__init__.py", "")
    _write(project / "flows/pipe.py", "")
    _write(project / "pipe.py", "")
    _write(project / "loose/tool.py", "")
    assert name_from_path(str(project / "pipe.py"), [str(project)]) == "pipe"
    assert name_from_path(str(project / "flows/pipe.py"), [str(project)]) == "flows.pipe"
    # `python flows/pipe.py` puts flows/ itself on sys.path: it is a package, so the name goes up through it
    assert name_from_path(str(project / "flows/pipe.py"), [str(project / "flows")]) == "flows.pipe"
    assert name_from_path(str(project / "loose/tool.py"), ["/nowhere"]) == "tool"  # nothing fits: the stem

    def main_function(spec: Any, file: Path) -> Any:
        scope: dict[str, Any] = {"__name__": "__main__", "__spec__": spec, "__file__": str(file)}
        exec(compile("def total(x):\n    return x\n", str(file), "exec"), scope)
        return scope["total"]

    under_m = main_function(types.SimpleNamespace(name="flows.pipe"), project / "flows/pipe.py")
    assert module_name_of(under_m) == "flows.pipe"  # python -m flows.pipe
    assert module_name_of(main_function(None, project / "pipe.py")) == "pipe"  # python pipe.py


def test_an_installed_distribution_is_folded_by_its_version_not_its_source(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "env/lib/site-packages"
    _write(site / "fakepkg/__init__.py", "VALUE = 1\n")
    monkeypatch.syspath_prepend(str(site))
    _write(
        project / "uses_fake.py",
        "import fakepkg\nimport pytest\n\n\ndef f():\n    return fakepkg.VALUE\n\n\ndef g():\n    return pytest\n",
    )
    importlib.invalidate_caches()
    uses_fake = importlib.import_module("uses_fake")

    v1 = step_identity(uses_fake.f, packages={"fakepkg": ["fake-dist"]}, versions={"fake-dist": "1.0"})
    v2 = step_identity(uses_fake.f, packages={"fakepkg": ["fake-dist"]}, versions={"fake-dist": "2.0"})
    assert v1.distributions == (("fake-dist", "1.0"),) and v2.distributions == (("fake-dist", "2.0"),)
    assert [name for name, _ in v1.modules] == ["uses_fake"]  # site-packages code is not the project's
    assert v1.key_material()["distributions"] == {"fake-dist": "1.0"}
    assert v1.key_material() != v2.key_material()
    # By default the versions come from importlib.metadata.
    assert ("pytest", importlib.metadata.version("pytest")) in step_identity(uses_fake.g).distributions


def test_reaching_more_modules_than_the_cap_is_key_uncomputable(project: Path) -> None:
    for i in range(5):
        _write(project / f"link{i}.py", f"import link{i + 1}\n" if i < 4 else "END = 1\n")
    _write(project / "chain.py", "import link0\n\n\ndef walk():\n    return link0\n")
    importlib.invalidate_caches()
    walk = importlib.import_module("chain").walk
    assert len(step_identity(walk).modules) == 6

    with pytest.raises(CacheError) as err:
        step_identity(walk, max_modules=3)
    assert err.value.code == "key_uncomputable"
    assert "more than 3 modules" in err.value.message and err.value.details["step"] == "chain:walk"


def test_fifty_steps_of_one_module_parse_it_once(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    steps = "\n".join(f"def s{i}(x):\n    return x + shop_base.BASE + {i}\n" for i in range(50))
    # The project path in a comment: content no earlier test parsed, so nothing is memoised yet.
    _write(project / "many.py", f"# {project}\nimport shop_base\n\n{steps}")
    _write(project / "shop_base.py", f"# {project}\nBASE = 1\n")
    importlib.invalidate_caches()
    many = importlib.import_module("many")
    parsed: list[int] = []
    real_parse = _reach.ast.parse

    def counting(source: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(1)
        return real_parse(source, *args, **kwargs)

    monkeypatch.setattr(_reach.ast, "parse", counting)
    identities = {step_identity(getattr(many, f"s{i}")).key_material()["modules"]["many"] for i in range(50)}
    assert len(identities) == 1
    # shop_base.py once; many.py itself is folded by what each step names of it, never parsed whole.
    assert len(parsed) == 1


def _explain(db: str, name: str) -> Any:
    return CliRunner().invoke(app, ["cache", "explain", name, "--db", db, "--json"])


def test_cache_explain_takes_a_bare_step_name_and_names_the_changed_module(
    shop: Path, ws: tuple[Path, str]
) -> None:
    _, db = ws
    (pipe,) = _fresh("shop_pipe")
    before = pipe.total.step_spec.body["step"]["modules"]["shop_helpers"]
    pipe.total(5)
    (shop / "shop_helpers.py").write_text(HELPERS.replace("FACTOR = 2", "FACTOR = 3"))
    pipe, other = _fresh("shop_pipe", "shop_other")
    after = pipe.total.step_spec.body["step"]["modules"]["shop_helpers"]
    pipe.total(5)
    other.count(1)

    done = _explain(db, "total")  # the qualname alone
    assert done.exit_code == 0, done.output
    explained = json.loads(done.output)
    assert explained["subject"] == "shop_pipe:total" and explained["comparison"] == "changed"
    assert explained["changes"] == [
        {
            "category": "body",
            "kind": "changed",
            "where": "body.declaration.step.modules.shop_helpers",
            "old": before,
            "new": after,
        }
    ]
    text = CliRunner().invoke(app, ["cache", "explain", "total", "--db", db])
    assert f"module shop_helpers: {before[:12]} → {after[:12]}" in text.output
    by_node = _explain(db, "tally")  # a step's node name finds it too
    assert by_node.exit_code == 0 and json.loads(by_node.output)["subject"] == "shop_other:count"

    # A distribution's version change is named the same way.
    (change,) = diff_components(
        {"body": {"declaration": {"step": {"distributions": {"pandas": "2.1.0"}}}}},
        {"body": {"declaration": {"step": {"distributions": {"pandas": "2.2.0"}}}}},
    )
    assert change.line() == "distribution pandas: 2.1.0 → 2.2.0"


def test_cache_explain_with_a_bare_name_of_several_steps_exits_2_naming_them(
    shop: Path, ws: tuple[Path, str]
) -> None:
    _, db = ws
    pipe, twin = _fresh("shop_pipe", "shop_twin")
    assert (pipe.total(1), twin.total(1)) == (2, 101)

    ambiguous = _explain(db, "total")
    assert ambiguous.exit_code == 2
    error = json.loads(ambiguous.output)["error"]
    assert error["code"] == "not_found"
    assert "shop_pipe:total" in error["message"] and "shop_twin:total" in error["message"]
    assert _explain(db, "shop_twin:total").exit_code == 0  # the full subject still names one
    unknown = _explain(db, "nothing")
    assert unknown.exit_code == 2 and "no local cache entry" in json.loads(unknown.output)["error"]["message"]


def test_a_sibling_edit_in_the_step_s_own_file_rebuilds_only_the_steps_that_name_it(project: Path) -> None:
    def identities(text: str) -> dict[str, Any]:
        _write(project / "siblings.py", text)
        sys.modules.pop("siblings", None)
        importlib.invalidate_caches()
        mod = importlib.import_module("siblings")
        return {n: step_identity(getattr(mod, n)).key_material() for n in ("uses_rate", "uses_helper", "alone")}

    base = """
        RATE = 2
        UNRELATED = "a"

        def helper(x):
            return x + 1

        def uses_rate(x):
            return x * RATE

        def uses_helper(x):
            return helper(x)

        def alone(x):
            return x
        """
    first = identities(base)
    after_rate = identities(base.replace("RATE = 2", "RATE = 3"))
    assert after_rate["uses_rate"] != first["uses_rate"]
    assert after_rate["uses_helper"] == first["uses_helper"] and after_rate["alone"] == first["alone"]
    after_helper = identities(base.replace("x + 1", "x + 2"))
    assert after_helper["uses_helper"] != first["uses_helper"]
    assert after_helper["uses_rate"] == first["uses_rate"] and after_helper["alone"] == first["alone"]
    assert identities(base.replace('"a"', '"b"')) == first  # a constant no step names
