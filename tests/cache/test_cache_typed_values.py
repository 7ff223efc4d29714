"""Typed step results through the dispatch seam: stored encoded by the value codecs, decoded on a hit to an
equal value of the same type, on every shared-tier backend; large payloads live in the CAS; a value the reader cannot
decode is never served."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pydantic
from _cache_support import Machine, upper, upper_node

from smthrs_plugin.cache.model import Miss, UnverifiableEvidence, VerifiedHit
from smthrs_plugin.codecs import INLINE_LIMIT, MARKER, CodecRegistry, builtin_codecs

Machines = Callable[..., Machine]


class Reading(pydantic.BaseModel):
    sensor: str
    at: dt.datetime
    values: list[float]


def typed_value() -> dict[str, Any]:
    return {
        "reading": Reading(
            sensor="s1", at=dt.datetime(2024, 1, 2, 3, 4, tzinfo=dt.timezone.utc), values=[1.5]
        ),
        "day": dt.date(2024, 1, 2),
        "pair": (Decimal("1.10"), "x"),
    }


def body_returning(value: Any) -> Callable[[Path], Any]:
    def body(root: Path) -> Any:
        upper(root)
        return value

    return body


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b) and a == b
    if isinstance(a, dict):
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b, strict=True):
            _same(x, y)


def test_a_typed_result_is_built_then_served_clean_as_an_equal_value_of_the_same_type(
    machines: Machines,
) -> None:
    a = machines("a", files={"in.txt": "x"})
    first = a.dispatch(upper_node(), body_returning(typed_value()))
    assert first.outcome == "built" and first.published["local"] == "published"
    hit = a.dispatch(upper_node(), body_returning(typed_value()))
    assert (hit.outcome, hit.decision) == ("clean", VerifiedHit("local"))
    _same(hit.value, typed_value())
    assert a.calls["upper"] == 1


def test_a_typed_result_round_trips_through_the_shared_tier(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "x"})
    b = machines("b", files={"in.txt": "x"})
    assert a.dispatch(upper_node(), body_returning(typed_value())).published["shared"] == "published"
    hit = b.dispatch(upper_node(), body_returning(typed_value()))
    assert (hit.outcome, hit.decision) == ("clean", VerifiedHit("shared"))
    _same(hit.value, typed_value())
    assert b.calls["upper"] == 0


def test_a_large_bytes_result_lives_in_the_cas_and_is_published_before_its_entry(machines: Machines) -> None:
    big = os.urandom(INLINE_LIMIT + 1024)
    digest = hashlib.sha256(big).hexdigest()
    a = machines("a", files={"in.txt": "x"})
    b = machines("b", files={"in.txt": "x"})
    built = a.dispatch(upper_node(), body_returning({"blob": big}))
    assert built.published == {"local": "published", "shared": "published"}
    assert a.artifacts.has(digest) and a.shared.has(digest)
    entry = a.dispatcher.local.lookup(built.key).entry  # type: ignore[union-attr]
    assert entry.value == {"blob": {MARKER: "bytes", "v": {"sha256": digest, "size": len(big)}}}
    assert entry.value_blobs == (digest,)
    hit = b.dispatch(upper_node(), body_returning({"blob": big}))
    assert hit.outcome == "clean" and hit.value == {"blob": big}
    assert b.artifacts.has(digest)  # hydrated once into b's local store


class Opaque:
    """A type only machine "a" has a codec for."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n

    __hash__ = None  # type: ignore[assignment]


class OpaqueCodec:
    tag = "test.Opaque"

    def handles(self, value: Any) -> bool:
        return type(value) is Opaque

    def key_form(self, value: Any, registry: CodecRegistry) -> Any:
        return value.n

    def encode(self, value: Any, registry: CodecRegistry, sink: Any) -> Any:
        return value.n

    def decode(self, doc: Any, registry: CodecRegistry, source: Any) -> Any:
        return Opaque(doc)

    def blob_digests(self, doc: Any) -> list[str]:
        return []


def test_a_shared_entry_whose_tag_this_reader_has_no_codec_for_is_refused_and_the_step_runs(
    machines: Machines,
) -> None:
    a = machines("a", files={"in.txt": "x"})
    a.dispatcher.codecs = CodecRegistry([*builtin_codecs(), OpaqueCodec()])
    b = machines("b", files={"in.txt": "x"})
    assert a.dispatch(upper_node(), body_returning({"o": Opaque(3)})).published["shared"] == "published"
    assert a.dispatch(upper_node(), body_returning({"o": Opaque(3)})).value == {"o": Opaque(3)}
    res = b.dispatch(upper_node(), body_returning({"o": 3}))
    assert res.outcome == "built" and isinstance(res.decision, UnverifiableEvidence)
    assert "test.Opaque" in res.decision.reason and b.calls["upper"] == 1


def test_a_local_entry_that_fails_to_decode_is_invalidated_and_the_step_runs(machines: Machines) -> None:
    a = machines(
        "a",
        files={"in.txt": "x"},
    )
    a.dispatcher.codecs = CodecRegistry([*builtin_codecs(), OpaqueCodec()])
    a.dispatch(upper_node(), body_returning(Opaque(1)), consult_shared=False, publish_shared=False)
    a.dispatcher.codecs = CodecRegistry(builtin_codecs())  # the plugin providing the codec was uninstalled
    res = a.dispatch(upper_node(), body_returning(1), consult_shared=False, publish_shared=False)
    assert res.outcome == "built" and isinstance(res.decision, UnverifiableEvidence)
    assert a.dispatch(upper_node(), body_returning(1), consult_shared=False).decision == VerifiedHit("local")
    assert any(p.get("reason") == "undecodable-value" for p in a.provenance())


def test_a_value_no_codec_stores_is_journaled_and_never_cached(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "x"})
    res = a.dispatch(upper_node(), body_returning({"o": Opaque(1)}))
    assert res.outcome == "built" and res.published["local"] == "unpublished:value"
    assert [p["stage"] for p in a.provenance()] == ["value"]
    assert a.dispatch(upper_node(), body_returning({"o": Opaque(1)})).decision == Miss()
