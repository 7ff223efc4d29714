"""``load_settings`` remembers a parse per exact input (arguments, ``SMTHRS_*`` variables, working directory, host
name) and never serves one whose input changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from smthrs_plugin import settings as settings_module
from smthrs_plugin.errors import SettingsError
from smthrs_plugin.settings import load_settings


def test_a_changed_variable_is_read_afresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SMTHRS_HEARTBEAT_INTERVAL_S", "2.5")
    assert load_settings(workspace=tmp_path).heartbeat_interval_s == 2.5
    monkeypatch.setenv("SMTHRS_HEARTBEAT_INTERVAL_S", "4")
    assert load_settings(workspace=tmp_path).heartbeat_interval_s == 4.0
    monkeypatch.setenv("smthrs_wait_poll_s", "3")  # read case-insensitively, like pydantic-settings does
    assert load_settings(workspace=tmp_path).wait_poll_s == 3.0
    monkeypatch.delenv("SMTHRS_HEARTBEAT_INTERVAL_S")
    assert load_settings(workspace=tmp_path).heartbeat_interval_s == 1.0


def test_the_same_input_is_parsed_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    parses: list[dict] = []
    real = settings_module._parse
    monkeypatch.setattr(settings_module, "_parse", lambda given: parses.append(given) or real(given))
    monkeypatch.setenv("SMTHRS_HOST_ID", "memo-test-host")
    first = load_settings(workspace=tmp_path, db_url="sqlite:///x.db")
    again = load_settings(workspace=tmp_path, db_url="sqlite:///x.db")
    assert first == again and len(parses) == 1
    load_settings(workspace=tmp_path, db_url="sqlite:///y.db")
    assert len(parses) == 2


def test_the_default_workspace_follows_the_working_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("SMTHRS_WORKSPACE", raising=False)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    assert load_settings().workspace == (tmp_path / "a").resolve()
    monkeypatch.chdir(tmp_path / "b")
    assert load_settings().workspace == (tmp_path / "b").resolve()


def test_a_workspace_behind_a_re_pointed_symlink_is_resolved_again(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    link = tmp_path / "ws"
    link.symlink_to(tmp_path / "one")
    assert load_settings(workspace=link).workspace == (tmp_path / "one").resolve()
    link.unlink()
    link.symlink_to(tmp_path / "two")
    assert load_settings(workspace=link).workspace == (tmp_path / "two").resolve()


def test_a_bad_variable_is_refused_every_time_it_is_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SMTHRS_STALE_AFTER_S", "-1")
    for _ in range(2):
        with pytest.raises(SettingsError) as err:
            load_settings(workspace=tmp_path)
        assert err.value.code == "invalid_setting"


def test_arguments_of_another_type_are_not_served_a_remembered_parse(tmp_path: Path) -> None:
    good = load_settings(workspace=tmp_path, artifacts_options={"anon": True})
    assert good.artifacts_options == {"anon": True}
    with pytest.raises(SettingsError):
        load_settings(workspace=[str(tmp_path)])  # the text of the path, in a list: refused, never served
    assert load_settings(workspace=str(tmp_path)).workspace == good.workspace
