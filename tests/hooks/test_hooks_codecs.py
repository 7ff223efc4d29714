"""The ``smthrs_value_codecs`` hook: a third-party codec (examples/third_party_plugin's ``Money``) is merged
into the runtime's registry after the built-ins, keys ``@step``-style arguments and stores/serves cached results."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import smthrs_plugin as sp
from smthrs_plugin.cache.requests import node_request
from smthrs_plugin.canonical import key
from smthrs_plugin.codecs import MARKER
from smthrs_plugin.errors import CodecError
from smthrs_plugin.hooks import hookimpl, new_plugins
from smthrs_plugin.settings import load_settings


@pytest.fixture(autouse=True)
def _bodies_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count body calls in this process's memory, so bodies run in-thread; how a body is isolated
    (a child process) is pinned by the isolation tests."""
    monkeypatch.setenv("SMTHRS_ISOLATION", "thread")


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "third_party_plugin"


@pytest.fixture
def example() -> Iterator[ModuleType]:
    sys.path.insert(0, str(EXAMPLE))
    try:
        import smthrs_example_plugin

        yield smthrs_example_plugin
    finally:
        sys.path.remove(str(EXAMPLE))


def test_a_third_party_codec_registered_through_the_hook_keys_its_type(example: ModuleType) -> None:
    plugins = new_plugins(entry_points=False, extra=[example])
    registry = plugins.codecs(load_settings())
    assert "example.Money" in registry.tags() and "pydantic" in registry.tags()
    m = example.Money("12.50", "EUR")
    assert registry.key_form(m) == {MARKER: "example.Money", "v": {"amount": "12.50", "currency": "EUR"}}
    assert key(registry.key_form(m)) != key(registry.key_form(example.Money("12.50", "USD")))
    without = new_plugins(entry_points=False).codecs(load_settings())
    with pytest.raises(CodecError) as err:
        without.key_form(m)
    assert err.value.code == "no_codec" and "smthrs_value_codecs" in err.value.message


def test_the_runtime_stores_and_serves_a_third_party_typed_result(
    example: ModuleType, tmp_path: Path
) -> None:
    plugins = new_plugins(entry_points=False, extra=[example])
    (tmp_path / "in.txt").write_text("x")
    calls: list[int] = []

    def body(root: Path) -> Any:
        calls.append(1)
        return {"total": example.Money("3.10", "EUR")}

    draft = sp.plan.node("price", body={"cmd": "price"}, reads=["in.txt"])
    with sp.open_runtime(workspace=tmp_path, plugins=plugins) as rt:
        assert "example.Money" in rt.codecs.tags()
        assert rt.dispatcher.codecs is rt.codecs
        request = node_request(draft, run_id="r1", workspace=rt.workspace, measurer=rt.measurer)
        built = rt.dispatcher.dispatch(request, body)
        assert built.outcome == "built" and built.published["local"] == "published"
        hit = rt.dispatcher.dispatch(request, body)
    assert hit.outcome == "clean" and hit.value == {"total": example.Money("3.10", "EUR")}
    assert type(hit.value["total"]) is example.Money and calls == [1]


def test_two_plugins_claiming_one_tag_are_refused(example: ModuleType) -> None:
    class Clash:
        @hookimpl
        def smthrs_value_codecs(self, settings: Any) -> list[Any]:
            return [example.MoneyCodec()]

    plugins = new_plugins(entry_points=False, extra=[example, Clash()])
    with pytest.raises(CodecError) as err:
        plugins.codecs(load_settings())
    assert err.value.code == "duplicate_codec"
