"""fileset.py: Bazel-like globs (dotfiles only when named), normalisation refusals, conservative overlap."""

from __future__ import annotations

import pytest

from smthrs_plugin.errors import PlanError
from smthrs_plugin.plan.fileset import (
    Filegroup,
    Glob,
    TreeArtifact,
    entries_overlap,
    entry_matches,
    flatten,
    glob_match,
    normalize_path,
    static_prefix,
)


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        ("src/*.py", "src/a.py", True),
        ("src/*.py", "src/pkg/a.py", False),  # '*' stays within one segment
        ("src/**/*.py", "src/a.py", True),  # '**' matches zero segments
        ("src/**/*.py", "src/pkg/sub/a.py", True),
        ("src/**", "src/pkg/a.txt", True),
        ("src/?.py", "src/ab.py", False),
        ("src/*", "src/.env", False),  # a wildcard never matches a dotfile...
        ("src/**", "src/.cache/x", False),  # ...nor does '**' walk into a dot directory
        ("src/.*", "src/.env", True),  # ...unless the pattern segment starts with '.'
        ("src/.cache/**", "src/.cache/x", True),
        ("**/*.py", ".venv/lib/x.py", False),
    ],
)
def test_glob_match_follows_bazel_and_skips_dotfiles_unless_named(
    pattern: str, path: str, expected: bool
) -> None:
    assert glob_match(pattern, path) is expected


def test_glob_excludes_remove_matches() -> None:
    g = Glob(include=["src/**/*.py"], exclude=["src/gen/**"])
    assert entry_matches(g, "src/a.py")
    assert not entry_matches(g, "src/gen/x.py")


@pytest.mark.parametrize(
    "bad",
    ["/etc/passwd", "C:/x", "a/../b", "a\\..\\b", "a//b", "./a", "", "a/./b", "x\x00y"],
)
def test_normalisation_refuses_paths_outside_the_workspace(bad: str) -> None:
    with pytest.raises(PlanError) as err:
        normalize_path(bad)
    assert err.value.code == "invalid_effects"
    assert "workspace-relative" in err.value.message


@pytest.mark.parametrize(
    "bad", [["/abs/*.py"], ["a/**x/b"], ["a/[ab].py"], [{"tree": "../x"}], [{"bogus": 1}]]
)
def test_flatten_refusals_are_typed_plan_errors_not_pydantic_errors(bad: list[object]) -> None:
    # Regression: Glob/TreeArtifact validators used to leak pydantic's ValidationError.
    with pytest.raises(PlanError) as err:
        flatten(bad)
    assert err.value.code == "invalid_effects"


def test_flatten_expands_filegroups_in_order_and_classifies_strings() -> None:
    group = Filegroup(name="srcs", entries=("b.py", Filegroup(name="inner", entries=("a.py",)), "dist/"))
    out = flatten([group, "src/*.c", "b.py", "a\\b.txt"])
    assert out == ("b.py", "a.py", TreeArtifact(path="dist"), Glob(include=("src/*.c",)), "a/b.txt")


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("out/a", "out/a", True),
        ("out/a", "out/b", False),
        (TreeArtifact(path="dist"), "dist/app.whl", True),
        (TreeArtifact(path="dist"), "distx/app.whl", False),
        (TreeArtifact(path="dist/sub"), TreeArtifact(path="dist"), True),
        (Glob(include=("src/*.py",)), "src/a.py", True),  # exact×glob: decided precisely
        (Glob(include=("src/*.py",)), "src/a.c", False),
        # glob×glob and tree×glob: conservative, unless the static prefixes prove them disjoint
        (Glob(include=("a/*",)), Glob(include=("b/*",)), False),
        (Glob(include=("a/*",)), TreeArtifact(path="b"), False),
        (Glob(include=("a/*",)), Glob(include=("a/x/*",)), True),
        (Glob(include=("**/*.js",)), Glob(include=("b/*",)), True),
        (Glob(include=("a/*",)), TreeArtifact(path="a/deep"), True),
        (Glob(include=("a/deep/**",)), TreeArtifact(path="a"), True),
        (Glob(include=("a/*", "b/*")), TreeArtifact(path="b"), True),
        (Glob(include=("*.js",)), TreeArtifact(path="dist"), True),
    ],
)
def test_overlap_is_precise_for_paths_and_conservative_for_globs_unless_prefixes_are_disjoint(
    a: object, b: object, expected: bool
) -> None:
    assert entries_overlap(a, b) is expected  # type: ignore[arg-type]
    assert entries_overlap(b, a) is expected  # type: ignore[arg-type]


def test_static_prefix_is_the_literal_directory_to_enumerate() -> None:
    assert static_prefix("src/pkg/**/*.py") == "src/pkg"
    assert static_prefix("*.py") == ""
