"""Explain a miss: which declared read (path, old → new digest), which input value, which environment field."""

from __future__ import annotations

from pathlib import Path

import pytest
from _cache_support import make_machine, upper

import smthrs_plugin as sp
from smthrs_plugin.cache.explain import Change, diff_components, explain, explain_request
from smthrs_plugin.errors import CacheError
from smthrs_plugin.stores.artifacts import ArtifactStore


def _node(threshold: float) -> sp.NodeDraft:
    return sp.node(
        "clean",
        body={"cmd": "clean"},
        inputs=[sp.Literal(threshold)],
        reads=["in.txt", "cfg.txt"],
        writes=["out.txt"],
    )


def test_explain_names_the_changed_read_the_input_and_the_environment_field(tmp_path: Path) -> None:
    m = make_machine(
        tmp_path, "a", ArtifactStore((tmp_path / "s").as_uri()), files={"in.txt": "a\n", "cfg.txt": "c"}
    )
    first = m.dispatch(_node(0.5), upper, plan_id="p", environment={"python": "3.11", "os": "linux"})
    before = dict(m.measurer.measure_paths(["in.txt"]))["in.txt"]
    m.write("in.txt", "b\n")
    second = m.dispatch(_node(0.7), upper, plan_id="p", environment={"python": "3.12", "os": "linux"})
    assert first.key != second.key

    explained = explain(m.dispatcher.local, "clean")  # a node id finds the "p/clean" subject
    assert explained.subject == "p/clean" and explained.status == "changed"
    assert (explained.key, explained.previous_key) == (second.key, first.key)
    by_category = {c.category: c for c in explained.changes}
    read = by_category["read"]
    assert before is not None
    assert (read.where, read.old, read.kind) == ("in.txt", before.digest, "changed")
    assert by_category["input"] == Change("input", "changed", "inputs.0.literal", 0.5, 0.7)
    assert by_category["environment"] == Change(
        "environment", "changed", "environment.python", "3.11", "3.12"
    )
    assert set(by_category) == {"read", "input", "environment"}  # cfg.txt, os and the body did not change
    text = "\n".join(explained.lines())
    assert "read in.txt:" in text and "environment environment.python: 3.11 → 3.12" in text

    # by key: the same answer
    assert explain(m.dispatcher.local, second.key).changes == explained.changes


def test_explain_before_dispatch_says_why_it_will_miss(tmp_path: Path) -> None:
    m = make_machine(
        tmp_path, "a", ArtifactStore((tmp_path / "s").as_uri()), files={"in.txt": "a", "cfg.txt": "c"}
    )
    m.dispatch(_node(0.5), upper)
    m.write("cfg.txt", "tuned")
    pending = explain_request(m.dispatcher.local, m.request(_node(0.5)))
    assert [(c.category, c.where) for c in pending.changes] == [("read", "cfg.txt")]


def test_the_first_entry_of_a_subject_has_nothing_to_compare_and_unknown_names_are_refused(
    tmp_path: Path,
) -> None:
    m = make_machine(
        tmp_path, "a", ArtifactStore((tmp_path / "s").as_uri()), files={"in.txt": "a", "cfg.txt": "c"}
    )
    m.dispatch(_node(0.5), upper)
    assert explain(m.dispatcher.local, "clean").status == "first-entry"
    with pytest.raises(CacheError) as err:
        explain(m.dispatcher.local, "no-such-node")
    assert err.value.code == "not_found"


def test_read_sets_are_compared_by_path() -> None:
    old = {"hermetic": {"readSet": [{"path": "a", "digest": "1" * 64}, {"path": "b", "digest": "2" * 64}]}}
    new = {"hermetic": {"readSet": [{"path": "b", "digest": "3" * 64}, {"path": "c", "digest": "4" * 64}]}}
    assert diff_components(old, new) == (
        Change("read", "removed", "a", "1" * 64, None),
        Change("read", "changed", "b", "2" * 64, "3" * 64),
        Change("read", "added", "c", None, "4" * 64),
    )
