"""The flow-author examples of README.md and docs/tutorials/flow-authors.md, run verbatim (in a temporary working
directory, on the session's server).

The data-team example (``python examples/shared_s3_cache.py``) and the plugin example
(``examples/third_party_plugin``) are run by ``test_prefect_examples.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _prefect_support import step_outcomes

pytestmark = pytest.mark.prefect


def test_readme_flow_author_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SMTHRS_WORKSPACE", raising=False)
    (tmp_path / "data").mkdir()
    (tmp_path / "data/raw.csv").write_text("0.2\n0.7\n0.9\n")
    # --- example (keep identical to README.md and docs/tutorials/flow-authors.md, "For Prefect flow authors: @step") ---
    from prefect import flow

    import smthrs_plugin as sp

    @sp.step(reads=["data/raw.csv"], writes=["data/clean.csv"])
    def clean(threshold: float) -> dict:
        with open("data/raw.csv") as f:  # a plain path: in the body, the workspace shows its sandbox
            rows = [r for r in f.read().split() if float(r) >= threshold]
        with open("data/clean.csv", "w") as f:
            f.write("\n".join(rows) + "\n")
        return {"kept": len(rows)}

    @flow
    def pipeline() -> dict:
        return clean(0.5)

    print(pipeline())  # runs the body in a sandbox, copies data/clean.csv back: built
    print(pipeline())  # same bytes in: a verified hit, data/clean.csv replayed: clean
    # --- end of the example ---
    assert capsys.readouterr().out.splitlines()[-2:] == ["{'kept': 2}", "{'kept': 2}"]
    assert (tmp_path / "data/clean.csv").read_text() == "0.7\n0.9\n"
    assert step_outcomes(tmp_path) == ["built", "clean"]


def test_readme_plan_in_a_flow_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SMTHRS_WORKSPACE", raising=False)
    (tmp_path / "src.txt").write_text("hello\n")
    # --- example (keep identical to docs/tutorials/flow-authors.md, "Plans on Prefect") ---
    from prefect import flow

    import smthrs_plugin as sp

    def shout(ni: sp.NodeInput) -> dict:  # one node's work, inside its sandbox
        text = (ni.root / "src.txt").read_text()
        (ni.root / "loud.txt").write_text(text.upper())
        return {"chars": len(text)}

    plan = sp.plan.compile_plan(
        "readme", "docs/readme", [sp.plan.node("shout", reads=["src.txt"], writes=["loud.txt"])]
    )

    @flow
    def release(run_id: str) -> dict:
        with sp.open_runtime() as rt:  # inside a flow run: every node dispatch is a Prefect task run
            return rt.scheduler(run_id).run(plan, shout).outcomes

    print(release("readme-1"), release("readme-2"))
    # --- end of the example ---
    assert capsys.readouterr().out.splitlines()[-1] == "{'shout': 'built'} {'shout': 'clean'}"
    assert (tmp_path / "loud.txt").read_text() == "HELLO\n"
