"""The value codecs: round trips, key stability, refusals, and poisoned documents that never run code."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from _codec_types import Color, Order, Point, samples

from smthrs_plugin.canonical import key
from smthrs_plugin.codecs import INLINE_LIMIT, MARKER, CodecRegistry, default_registry
from smthrs_plugin.errors import CodecError

HERE = Path(__file__).parent


class DictBlobs:
    """An in-memory BlobSink/BlobSource (content-addressed)."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    def put(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        return digest

    def get(self, digest: str) -> bytes:
        return self.blobs[digest]


@pytest.fixture
def registry() -> CodecRegistry:
    return default_registry()


@pytest.mark.parametrize("name", sorted(samples()))
def test_each_builtin_round_trips_to_an_equal_value_of_the_same_type(
    registry: CodecRegistry, name: str
) -> None:
    value = samples()[name]
    blobs = DictBlobs()
    doc = registry.encode(value, blobs)
    assert doc[MARKER] in (name, "dataclass")
    json.dumps(doc)  # plain JSON
    back = registry.decode(json.loads(json.dumps(doc)), blobs)
    assert type(back) is type(value) and back == value


def test_plain_json_passes_through_and_containers_recurse(registry: CodecRegistry) -> None:
    value = {"a": [1, 2.5, "x", None, True], "b": {"when": dt.date(2024, 1, 1)}}
    doc = registry.encode(value)
    assert doc["a"] == [1, 2.5, "x", None, True]
    assert doc["b"]["when"] == {MARKER: "date", "v": "2024-01-01"}
    assert registry.decode(doc) == value


def test_a_changed_value_gets_a_new_key(registry: CodecRegistry) -> None:
    s = samples()
    changed = {
        "pydantic": Point(x=1, y=2.5, tags=["b"]),
        "dataclass": Order(8, s["dataclass"].when, s["dataclass"].point, b"\x00\x01", (1, "a")),
        "datetime": s["datetime"] + dt.timedelta(microseconds=1),
        "date": dt.date(2024, 3, 1),
        "time": dt.time(8, 16, tzinfo=dt.timezone.utc),
        "decimal": s["decimal"] + 1,
        "uuid": __import__("uuid").UUID(int=1),
        "enum": Color.RED,
        "tuple": (1, "two", 3.0, 0),
        "bytes": b"hello worle",
    }
    for name, value in s.items():
        assert key(registry.key_form(value)) != key(registry.key_form(changed[name])), name


def test_a_tuple_and_a_list_have_different_keys(registry: CodecRegistry) -> None:
    assert key(registry.key_form((1, 2))) != key(registry.key_form([1, 2]))


def test_keys_are_stable_across_processes_and_hash_seeds(registry: CodecRegistry) -> None:
    here = {name: key(registry.key_form(v)) for name, v in samples().items()}
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(HERE)!r})
        from _codec_types import samples
        from smthrs_plugin.canonical import key
        from smthrs_plugin.codecs import default_registry
        r = default_registry()
        print(json.dumps({{n: key(r.key_form(v)) for n, v in samples().items()}}))
        """
    )
    for seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        assert json.loads(out.stdout) == here


def test_bytes_key_on_their_digest_and_large_ones_go_to_the_sink(registry: CodecRegistry) -> None:
    big = os.urandom(INLINE_LIMIT + 1)
    blobs = DictBlobs()
    doc = registry.encode(big, blobs)
    digest = hashlib.sha256(big).hexdigest()
    assert doc == {MARKER: "bytes", "v": {"sha256": digest, "size": len(big)}}
    assert registry.key_form(big) == doc
    assert registry.blob_digests({"nested": [doc]}) == [digest]
    assert registry.decode(doc, blobs) == big
    small = registry.encode(b"abc", blobs)
    assert "b64" in small["v"] and registry.blob_digests(small) == []
    assert registry.key_form(b"abc")["v"] == {"sha256": hashlib.sha256(b"abc").hexdigest(), "size": 3}


def test_a_tampered_blob_is_never_returned(registry: CodecRegistry) -> None:
    blobs = DictBlobs()
    doc = registry.encode(b"x" * (INLINE_LIMIT + 5), blobs)
    blobs.blobs[doc["v"]["sha256"]] = b"y" * (INLINE_LIMIT + 5)
    with pytest.raises(CodecError) as err:
        registry.decode(doc, blobs)
    assert err.value.code == "undecodable"


def test_a_type_with_no_codec_is_refused_naming_the_type_and_the_hook(registry: CodecRegistry) -> None:
    with pytest.raises(CodecError) as err:
        registry.key_form({"s": complex(1, 2)})
    assert err.value.code == "no_codec"
    assert "builtins.complex" in err.value.message and "smthrs_value_codecs" in err.value.message


def test_a_plain_dict_using_the_reserved_key_is_refused(registry: CodecRegistry) -> None:
    for walk in (registry.key_form, registry.encode):
        with pytest.raises(CodecError) as err:
            walk({"a": {MARKER: "datetime", "v": "2024-01-01T00:00:00+00:00"}})
        assert err.value.code == "reserved_key"


@pytest.mark.parametrize("naive", [dt.datetime(2024, 1, 1, 12), dt.time(12, 0)])
def test_a_naive_datetime_or_time_is_refused(registry: CodecRegistry, naive: Any) -> None:
    for walk in (registry.key_form, registry.encode):
        with pytest.raises(CodecError) as err:
            walk(naive)
        assert err.value.code == "invalid_value" and "timezone" in err.value.message


def test_a_zoneinfo_datetime_keeps_its_zone() -> None:
    from zoneinfo import ZoneInfo

    registry = default_registry()
    value = dt.datetime(2024, 10, 27, 2, 30, fold=1, tzinfo=ZoneInfo("Europe/Paris"))
    back = registry.decode(registry.encode(value))
    assert back == value and back.tzinfo == ZoneInfo("Europe/Paris") and back.utcoffset() == value.utcoffset()


def test_a_duplicate_tag_is_refused(registry: CodecRegistry) -> None:
    with pytest.raises(CodecError) as err:
        registry.register(type(registry.codec_for(b"x"))())  # type: ignore[misc]
    assert err.value.code == "duplicate_codec"


def test_an_unknown_tag_is_refused(registry: CodecRegistry) -> None:
    with pytest.raises(CodecError) as err:
        registry.decode({MARKER: "pickle", "v": "gASV..."})
    assert err.value.code == "undecodable" and "pickle" in err.value.message


def test_a_pydantic_model_whose_schema_changed_is_refused(registry: CodecRegistry) -> None:
    doc = registry.encode(Point(x=1, y=2.0))
    doc["v"]["schema"] = "0" * 64
    with pytest.raises(CodecError) as err:
        registry.decode(doc)
    assert err.value.code == "undecodable" and "schema" in err.value.message


def test_a_dataclass_whose_fields_changed_is_refused(registry: CodecRegistry) -> None:
    doc = registry.encode(samples()["dataclass"], DictBlobs())
    doc["v"]["fields"]["extra"] = 1
    with pytest.raises(CodecError) as err:
        registry.decode(doc)
    assert err.value.code == "undecodable"


@pytest.mark.parametrize("tag", ["pydantic", "dataclass", "enum"])
def test_a_poisoned_document_naming_a_function_is_never_called(registry: CodecRegistry, tag: str) -> None:
    inner: dict[str, Any] = {"class": "os:system"}
    inner.update(
        {
            "pydantic": {"schema": "0" * 64, "data": "touch /tmp/pwned"},
            "dataclass": {"fields": {}},
            "enum": {"value": "touch /tmp/pwned"},
        }[tag]
    )
    with pytest.raises(CodecError) as err:
        registry.decode({MARKER: tag, "v": inner})
    assert err.value.code == "unsafe_codec"


@pytest.mark.parametrize("tag", ["pydantic", "dataclass", "enum"])
def test_a_poisoned_document_never_imports_the_module_it_names(
    registry: CodecRegistry, tag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "imported.txt"
    (tmp_path / "smthrs_poison_mod.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nclass Evil:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    inner: dict[str, Any] = {"class": "smthrs_poison_mod:Evil"}
    inner.update(
        {"pydantic": {"schema": "0" * 64, "data": {}}, "dataclass": {"fields": {}}, "enum": {"value": 1}}[tag]
    )
    with pytest.raises(CodecError) as err:
        registry.decode({MARKER: tag, "v": inner})
    assert err.value.code == "unsafe_codec"
    assert "smthrs_poison_mod" not in sys.modules and not marker.exists()


def test_a_class_defined_in_a_function_is_refused_it_has_no_import_path(registry: CodecRegistry) -> None:
    import pydantic

    class Local(pydantic.BaseModel):
        a: int

    for walk in (registry.key_form, registry.encode):
        with pytest.raises(CodecError) as err:
            walk(Local(a=1))
        assert err.value.code == "invalid_value" and "import path" in err.value.message


def test_an_enum_member_and_a_nested_dataclass_decode_back(registry: CodecRegistry) -> None:
    value = {"c": Color.RED, "o": [samples()["dataclass"]]}
    blobs = DictBlobs()
    back = registry.decode(registry.encode(value, blobs), blobs)
    assert back["c"] is Color.RED and isinstance(back["o"][0], Order) and back == value
