"""Reserved top-level directories (``.smthrs/``, ``.git/``, ``.venv/``) are never declared written or removed:
refused with ``PlanError(invalid_effects)`` naming the path by ``Declaration``, at plan compile and
when ``@step`` decorates — before anything runs. Reading them stays allowed."""

from __future__ import annotations

import pytest

import smthrs_plugin as sp
from smthrs_plugin.boundary import Declaration
from smthrs_plugin.errors import CacheError, PlanError

RESERVED_DECLARATIONS = [
    ({"writes": [".smthrs/state.db"]}, ".smthrs/"),
    ({"writes": [".git/hooks/pre-commit"]}, ".git/"),
    ({"writes": [".venv/"]}, ".venv/"),
    ({"writes": [".git/**"]}, ".git/"),
    ({"writes": ["**/.git/hooks/*"]}, ".git/"),  # '**' may match zero segments
    ({"writes": [".g*/hooks/x"]}, ".git/"),
    ({"removes": [".git/"]}, ".git/"),
    ({"removes": [".smthrs"]}, ".smthrs/"),
]


@pytest.mark.parametrize(("effects", "reserved"), RESERVED_DECLARATIONS)
def test_a_declaration_reaching_a_reserved_directory_is_refused(
    effects: dict[str, list[str]], reserved: str
) -> None:
    with pytest.raises(PlanError) as caught:
        Declaration.of(reads=["in.txt"], **effects)
    assert caught.value.code == "invalid_effects"
    assert f"reserved directory {reserved!r}" in caught.value.message


@pytest.mark.parametrize(("effects", "reserved"), RESERVED_DECLARATIONS)
def test_a_plan_node_reaching_a_reserved_directory_is_refused_at_compile(
    effects: dict[str, list[str]], reserved: str
) -> None:
    with pytest.raises(PlanError) as caught:
        sp.plan.compile_plan(plan_id="p", flow="f", nodes=[sp.plan.node("n", body={"cmd": "x"}, **effects)])
    assert caught.value.code == "invalid_effects" and "'n'" in caught.value.message
    assert f"reserved directory {reserved!r}" in caught.value.message


def test_reading_reserved_paths_and_writing_everywhere_else_stay_allowed() -> None:
    Declaration.of(reads=[".git/HEAD", ".smthrs/config.json"], writes=["**", "dist/", "src/**/*.py", "git/x"])
    sp.plan.compile_plan(
        plan_id="p",
        flow="f",
        nodes=[sp.plan.node("n", body={"cmd": "x"}, reads=[".git/HEAD"], writes=["**/*.o"])],
    )


@pytest.mark.parametrize(("effects", "reserved"), RESERVED_DECLARATIONS)
def test_a_step_reaching_a_reserved_directory_is_refused_when_decorating(
    effects: dict[str, list[str]], reserved: str
) -> None:
    with pytest.raises(CacheError) as caught:

        @sp.step(reads=["in.txt"], **effects)  # type: ignore[arg-type]
        def poison() -> int:
            return 1

    assert caught.value.code == "invalid_declaration"
    assert isinstance(caught.value.cause, PlanError) and caught.value.cause.code == "invalid_effects"
    assert f"reserved directory {reserved!r}" in caught.value.message
