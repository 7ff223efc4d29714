"""The seven admission conjuncts, entry decoding, and forged/foreign shared entries never being served."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from _cache_support import Machine, upper, upper_node

from smthrs_plugin.boundary.evidence import Evidence, ExpectedSetDeviation, Output, diff_identity
from smthrs_plugin.cache import UnverifiableEvidence, VerifiedHit
from smthrs_plugin.cache.admission import CONJUNCTS, Admissible, NotAdmissible, admit
from smthrs_plugin.cache.entry import CacheEntry, Undecodable, check_cacheable, decode_entry
from smthrs_plugin.cache.shared import sign_document
from smthrs_plugin.canonical import key, key_digest

Machines = Callable[..., Machine]


def _evidence(**kw: object) -> Evidence:
    outs = (Output("o", "a" * 64, 1, 0o644, None),)
    base = Evidence(outs, (), diff_identity(outs, ()), (), True, True, (("i", "b" * 64),), "hard")
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("conjunct", "change"),
    [
        ("tier_sealed", {"tier": "compensable"}),
        ("boundary_hard", {"evidence": _evidence(boundary_mode="expected")}),
        ("reads_expanded", {"all_reads_exact": False}),
        ("no_deviation", {"evidence": _evidence(deviations=(ExpectedSetDeviation(("x",)),))}),
        ("whole_tree_writes_verified", {"evidence": _evidence(whole_tree_writes_verified=False)}),
        ("hermetic_reads_verified", {"evidence": _evidence(hermetic_reads_verified=False)}),
        ("read_set_verified", {"read_set_verified": False}),
    ],
)
def test_each_conjunct_alone_bars_admission(conjunct: str, change: dict[str, object]) -> None:
    args: dict[str, object] = {
        "tier": "sealed",
        "evidence": _evidence(),
        "all_reads_exact": True,
        "read_set_verified": True,
    }
    assert admit(**args) == Admissible()  # type: ignore[arg-type]
    refused = admit(**{**args, **change})  # type: ignore[arg-type]
    assert isinstance(refused, NotAdmissible) and refused.conjunct == conjunct
    assert conjunct in CONJUNCTS


def test_a_glob_read_is_admitted_by_its_expansion_unless_the_body_saw_the_whole_tree(
    machines: Machines,
) -> None:
    import smthrs_plugin as sp

    draft = sp.plan.node("upper", body={}, reads=["*.txt"], writes=["out.txt"])
    a = machines("a", files={"in.txt": "x"})
    res = a.dispatch(draft, upper)
    assert res.outcome == "built" and res.published["shared"] == "published"
    b = machines("b", files={"in.txt": "x"})
    whole = b.dispatch(draft, upper, sandbox="whole-tree", consult_shared=False)
    assert whole.outcome == "built" and whole.published["shared"] == "unpublished:reads_expanded"


def _entry(k: str) -> CacheEntry:
    ev = _evidence()
    return CacheEntry.build(
        key=k,
        subject="s",
        components={},
        evidence=ev,
        value={"v": 1.0},
        canonical_value=check_cacheable({"v": 1.0}).canonical,  # type: ignore[union-attr]
        admission={
            "tier": "sealed",
            "allReadsExact": True,
            "readSetVerified": True,
            "nondeterministic": False,
        },
        provenance={"run_id": "r"},
        scope="shared",
    )


def test_decoding_verifies_name_format_and_result_identity() -> None:
    k = key({"k": 1})
    e = _entry(k)
    good = decode_entry(e.encode(), name=e.name)
    assert isinstance(good, CacheEntry) and good.value == {"v": 1.0} and type(good.value["v"]) is float
    doc = json.loads(e.encode())
    for mutate, corrupt in (
        (lambda d: d.update(value={"v": 2.0}), True),
        (lambda d: d.update(format="other/9"), False),
        (lambda d: d.pop("admission"), False),
    ):
        bad = json.loads(json.dumps(doc))
        mutate(bad)
        out = decode_entry(json.dumps(bad), name=e.name)
        assert isinstance(out, Undecodable) and out.corrupt is corrupt
    assert isinstance(decode_entry(e.encode(), name=key_digest(key({"k": 2}))), Undecodable)
    assert isinstance(decode_entry(b"\x00not json"), Undecodable)


def test_tuples_and_non_json_values_are_not_cacheable() -> None:
    assert not hasattr(check_cacheable({"a": [1, 2.5, None, "s"]}), "reason")
    assert hasattr(check_cacheable([(1, 2)]), "reason")
    assert hasattr(check_cacheable({"p": Path("/x")}), "reason")
    assert hasattr(check_cacheable(float("nan")), "reason")


def test_a_forged_shared_entry_claiming_no_sandbox_is_never_served(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    built = a.dispatch(upper_node(), upper)
    name = a.entry_name(built.key)
    doc = json.loads(a.shared.get_entry(name) or b"")
    doc["evidence"]["hermetic_reads_verified"] = False  # a writer that never ran a hermetic sandbox
    forged = decode_entry(doc, name=key_digest(built.key))
    assert isinstance(forged, CacheEntry)
    a.shared.delete_entry(name)  # signed by the trusted key itself: admission, not the signature, refuses it
    a.shared.put_entry(name, sign_document(forged, a.dispatcher.trust))
    b = machines("b", files={"in.txt": "hello\n"})
    res = b.dispatch(upper_node(), upper, run_id="r2")
    assert isinstance(res.decision, UnverifiableEvidence) and "hermetic_reads_verified" in res.decision.reason
    assert res.outcome == "built" and b.calls["upper"] == 1


def test_an_entry_stored_under_another_keys_name_is_never_served(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    built = a.dispatch(upper_node(), upper)
    b = machines("b", files={"in.txt": "other\n"})
    wanted = b.request(upper_node(), run_id="r2").key
    a.shared.put_entry(b.entry_name(wanted), a.shared.get_entry(a.entry_name(built.key)) or b"")
    res = b.dispatch(upper_node(), upper, run_id="r2")
    assert isinstance(res.decision, UnverifiableEvidence) and (b.ws / "out.txt").read_text() == "OTHER\n"
    assert res.decision != VerifiedHit("shared")
