"""A sandbox tree as content of the artifact store: what remote execution ships both ways.

A tree travels as a :data:`Manifest` — ``{path: Entry}``, an entry being a file (digest and normalised mode), a
directory or a link (its target) — plus the blobs of its files in the content-addressed store. Nothing else
crosses: no timestamp, no owner, no absolute path, so a worker never needs (and never learns) the workspace path.

Invariants
- **Hydration is verified.** Every file is streamed from the store and must hash to its digest before it appears
  under its name (:meth:`ArtifactStore.get_to_file`); a missing or corrupt blob is
  ``RemoteError(input_unavailable)`` naming the path, and the tree is left for the caller to discard.
- **A delta is computed by content, never by clock.** Every file present after the body is hashed and compared
  with the manifest it was hydrated from, so a worker whose clock is off can neither hide a change (an mtime in
  the past) nor invent one (an mtime in the future). Changed files are uploaded before the delta is returned: a
  delta never names a blob the store does not have (CAS before the reference, as for cache entries).
- **A delta is untrusted where it is applied.** Every path must be relative, normalised, without ``..`` and land
  inside the tree without crossing a link; none may name the tree's root itself (``.``: removing or replacing it
  would empty the sandbox or swap it for a file or link); a path it writes may not lie under one the same delta
  reports as a file or link; the entry count is bounded by the enumeration budget. Anything else is
  ``RemoteError(invalid_delta)`` before a byte is written or removed. Files are written atomically (temp file, verify,
  rename) with a normalised mode; links last, so no write of this delta goes through a link it created.
- The sandbox that receives an applied delta still does its own whole-tree diff, boundary refusals and
  compare-and-set copy-back: this module moves bytes; it decides nothing about what a body may write.
- **Small files may travel inline** (remote execution): up to :data:`INLINE_FILE_MAX` bytes each and
  :data:`INLINE_TOTAL_MAX` per tree, their bytes ride with the shipment (:func:`shipped_tree`, :func:`hydrate`) or
  the delta (``delta_of(..., inline=True)``), keyed by digest, instead of one store round trip per file each way.
  Inline bytes are verified against their digest where they land exactly like a blob read from the store; a delta
  still names only blobs the store has (the worker uploads every changed file, inline or not).

Prior art: Bazel's remote execution API (an action's input root is a Merkle tree of digests in the CAS; outputs
come back as digests the client downloads), git's tree objects.
"""

from __future__ import annotations

import os
import posixpath
import stat as stat_mod
import threading
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Literal, TypeVar

from ..errors import ArtifactError, BoundaryError, RemoteError
from ..stores.artifacts import ArtifactStore, Corrupt, Intact
from .fsops import inside, normal_mode, remove_path
from .measure import DEFAULT_ENTRY_BUDGET, scan_tree, sha256_file

__all__ = [
    "Entry",
    "Manifest",
    "Delta",
    "Inline",
    "INLINE_FILE_MAX",
    "INLINE_TOTAL_MAX",
    "manifest_of",
    "shipped_tree",
    "upload",
    "hydrate",
    "delta_of",
    "apply_delta",
]

_T = TypeVar("_T")
#: Parallel blob transfers per tree (S3 round trips dominate a small tree).
_TRANSFERS = 8
#: A file up to this many bytes travels inline (module invariants): a store round trip costs more than its bytes.
INLINE_FILE_MAX = 64 * 1024
#: ... and at most this many inline bytes per shipment or delta (what crosses with the task, not the store).
INLINE_TOTAL_MAX = 1024 * 1024


@dataclass(frozen=True)
class Entry:
    """One path of a shipped tree: ``file`` (``digest``, ``mode`` 0o644/0o755, ``size``), ``dir`` or ``link``
    (``target``, never followed)."""

    kind: Literal["file", "dir", "link"]
    digest: str = ""
    mode: int = 0
    size: int = 0
    target: str = ""


Manifest = Mapping[str, Entry]


#: Bytes of small files travelling inline, by digest (verified where they land).
Inline = Mapping[str, bytes]


@dataclass(frozen=True)
class Delta:
    """What a body changed in its tree: entries created or modified (files, directories, links), paths removed,
    and the bytes of small changed files by digest (``inline``; their blobs are in the store too)."""

    changed: tuple[tuple[str, Entry], ...]
    removed: tuple[str, ...]
    inline: tuple[tuple[str, bytes], ...] = ()


def manifest_of(root: Path, *, budget: int = DEFAULT_ENTRY_BUDGET) -> dict[str, Entry]:
    """Every directory, file and link below ``root`` by content (files hashed). A FIFO, socket or device is
    ``RemoteError(unsupported_tree)``: only files, directories and links travel."""
    return _manifest(root, budget, None)


def shipped_tree(
    root: Path, *, budget: int = DEFAULT_ENTRY_BUDGET
) -> tuple[dict[str, Entry], dict[str, bytes]]:
    """:func:`manifest_of` ``root`` and, read in the same pass, the bytes of its small files by digest (what
    travels inline: module invariants)."""
    inline: dict[str, bytes] = {}
    return _manifest(root, budget, inline), inline


def _manifest(root: Path, budget: int, inline: dict[str, bytes] | None) -> dict[str, Entry]:
    dirs, entries = scan_tree(root, budget=budget)
    out: dict[str, Entry] = {d: Entry("dir") for d in dirs if d}
    keep: dict[str, bytes] = {} if inline is None else inline
    room = INLINE_TOTAL_MAX if inline is not None else -1
    for rel, st in entries.items():
        path = os.path.join(root, rel)
        if stat_mod.S_ISREG(st.st_mode):
            with open(path, "rb") as f:
                limit = min(INLINE_FILE_MAX, room)
                data = f.read(limit + 1) if st.st_size <= limit else None
                if (
                    data is not None and len(data) <= limit
                ):  # (a file that grew since its stat is not inlined)
                    digest = sha256(data).hexdigest()
                    if digest not in keep:
                        keep[digest] = data
                        room -= len(data)
                else:
                    f.seek(0)
                    digest = sha256_file(f)
            out[rel] = Entry("file", digest=digest, mode=normal_mode(st.st_mode), size=st.st_size)
        elif stat_mod.S_ISLNK(st.st_mode):
            out[rel] = Entry("link", target=os.readlink(path))
        else:
            raise RemoteError(
                "unsupported_tree",
                f"{rel!r} is a FIFO, socket or device; remote execution ships files, directories and links only",
                path=rel,
            )
    return dict(sorted(out.items()))


# Blobs this process stored or saw in a store, by store URL: a re-run of the same inputs asks the store nothing.
# A blob deleted since (gc) makes the worker fail its hydration, and the caller re-uploads with ``force``.
_PRESENT: dict[str, set[str]] = {}
_PRESENT_LOCK = threading.Lock()
_PRESENT_CAP = 200_000


def _remember(store: ArtifactStore, digests: Iterable[str]) -> None:
    with _PRESENT_LOCK:
        known = _PRESENT.setdefault(store.url, set())
        if len(known) > _PRESENT_CAP:
            known.clear()
        known.update(digests)


def upload(
    root: Path,
    manifest: Manifest,
    store: ArtifactStore,
    *,
    force: bool = False,
    skip: Collection[str] = (),
    probe_small: bool = True,
) -> int:
    """Make sure the blob of every file of ``manifest`` (read from ``root``) is in ``store``; returns how many were
    sent. Each file must still hash to its manifest digest (``digest_mismatch`` otherwise: it changed under us).
    ``force`` reads every blob instead of trusting the process's memo or a name's existence, and replaces the
    ones that are missing or corrupt (what a worker could not hydrate). ``skip``: digests that travel inline
    instead. ``probe_small=False``: a file up to :data:`INLINE_FILE_MAX` bytes is sent without asking the store
    first (its create is create-if-absent: one round trip either way, where a probe and a send are two)."""
    by_digest: dict[str, str] = {}
    small: set[str] = set()
    for rel, e in manifest.items():
        if e.kind == "file" and e.digest not in skip:
            by_digest.setdefault(e.digest, rel)
            if e.size <= INLINE_FILE_MAX:
                small.add(e.digest)
    if force:
        with _PRESENT_LOCK:
            _PRESENT.get(store.url, set()).difference_update(by_digest)
        missing = []
        for d in by_digest:
            # Read each blob: an intact one is left alone (another node's worker may be hydrating it right now);
            # a corrupt one is removed first, or first-writer-wins would keep it under its name.
            check = store.check_blob(d)
            if isinstance(check, Corrupt):
                store.delete_blob(d)
            if not isinstance(check, Intact):
                missing.append(d)
    else:
        with _PRESENT_LOCK:
            known = _PRESENT.get(store.url, set())
            unknown = [d for d in by_digest if d not in known]
        sent_blind = [] if probe_small else [d for d in unknown if d in small]
        asked = [d for d in unknown if probe_small or d not in small]
        present = store.has_many(asked) if asked else {}
        _remember(store, [d for d, ok in present.items() if ok])
        missing = sent_blind + [d for d, ok in present.items() if not ok]
    if missing:
        # Every digest here was just looked up (or read by check_blob) and not found intact, or is small enough
        # to send unasked: no HEAD first. The create is still create-if-absent, never an overwrite.
        store.put_files([(os.path.join(root, by_digest[d]), d) for d in missing], absent=True)
        _remember(store, missing)
    return len(missing)


def hydrate(manifest: Manifest, store: ArtifactStore, dest: Path, *, inline: Inline | None = None) -> None:
    """Build ``manifest`` under the empty directory ``dest`` from ``store`` alone (and the ``inline`` bytes of the
    shipment, by digest), every file verified."""
    dest_s = os.fspath(dest)
    list(_checked(manifest))
    for rel, e in manifest.items():
        if e.kind == "dir":
            os.makedirs(os.path.join(dest_s, rel), exist_ok=True)
    files = [(rel, e) for rel, e in manifest.items() if e.kind == "file"]
    for rel, _ in files:
        os.makedirs(os.path.dirname(os.path.join(dest_s, rel)), exist_ok=True)

    blobs = _verified(tuple((inline or {}).items()), "input_unavailable", "a declared read's inline copy")
    rest = _place_inline([(rel, e, os.path.join(dest_s, rel)) for rel, e in files], blobs)
    _fetch(store, rest, "input_unavailable", "declared read")
    for rel, e in manifest.items():
        if e.kind == "link":
            path = os.path.join(dest_s, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.symlink(e.target, path)


def delta_of(
    root: Path,
    before: Manifest,
    store: ArtifactStore,
    *,
    budget: int = DEFAULT_ENTRY_BUDGET,
    inline: bool = False,
) -> Delta:
    """What changed under ``root`` since it was hydrated from ``before``, by content; changed files' blobs are
    stored before the delta is returned. ``inline``: the delta also carries the bytes of small changed files (the
    coordinator then needs no store read for them), and a small blob is stored without asking first."""
    after = manifest_of(root, budget=budget)
    changed = tuple((rel, e) for rel, e in after.items() if before.get(rel) != e)
    removed = tuple(rel for rel in before if rel not in after)
    upload(root, {rel: e for rel, e in changed}, store, probe_small=not inline)
    if not inline:
        return Delta(changed, removed)
    return Delta(changed, removed, _inline_of(root, changed))


def _inline_of(root: Path, entries: Iterable[tuple[str, Entry]]) -> tuple[tuple[str, bytes], ...]:
    """The bytes of the small files among ``entries`` by digest, within :data:`INLINE_TOTAL_MAX` (re-read: a file
    that no longer hashes to its entry is left to the store, which refused it already if it changed)."""
    out: dict[str, bytes] = {}
    room = INLINE_TOTAL_MAX
    for rel, e in entries:
        if e.kind != "file" or e.digest in out or e.size > min(INLINE_FILE_MAX, room):
            continue
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read(INLINE_FILE_MAX + 1)
        if sha256(data).hexdigest() == e.digest:
            out[e.digest] = data
            room -= len(data)
    return tuple(out.items())


def apply_delta(
    delta: Delta, store: ArtifactStore, root: Path, *, budget: int = DEFAULT_ENTRY_BUDGET
) -> None:
    """Make ``root`` (the tree the delta's manifest was taken of) what the worker's tree became. The delta is
    checked whole before anything is written (see the module invariants)."""
    if len(delta.changed) + len(delta.removed) > budget:
        raise RemoteError(
            "invalid_delta",
            f"a worker reported {len(delta.changed) + len(delta.removed)} changed paths, over the enumeration "
            f"budget of {budget}",
        )
    changed = dict(delta.changed)
    if len(changed) != len(delta.changed):
        raise RemoteError("invalid_delta", "a worker reported one path twice")
    list(_checked(changed))
    list(_checked({rel: Entry("dir") for rel in delta.removed}))
    for rel, e in changed.items():
        if e.kind not in ("file", "dir", "link") or (e.kind == "file" and e.mode not in (0o644, 0o755)):
            raise RemoteError("invalid_delta", f"a worker reported {rel!r} as {e!r}", path=rel)
    blobs = _verified(delta.inline, "invalid_delta", "an inline output a worker reported")
    leaves = {rel: e.kind for rel, e in changed.items() if e.kind != "dir"}
    for rel in changed:
        parent = rel.rpartition("/")[0]
        while parent:
            if parent in leaves:
                # delta_of never reports one: the link would replace the directory the path was written into, or
                # the write would fail half-way under a file with an untyped OSError. (A REMOVED path under one is
                # what replacing a directory by a file or link looks like: removals run first, so no removal
                # goes through a link this delta creates.)
                raise RemoteError(
                    "invalid_delta",
                    f"a worker reported {rel!r} under {parent!r}, which it reports as a {leaves[parent]}",
                    path=rel,
                )
            parent = parent.rpartition("/")[0]
    root_real = os.path.realpath(root)

    def dest(rel: str) -> str:
        try:
            path = inside(root_real, rel)
        except BoundaryError as exc:
            raise RemoteError(
                "invalid_delta", f"a worker reported {rel!r}, {exc}", cause=exc, path=rel
            ) from exc
        if os.path.normpath(path) == root_real:
            # _checked refuses "." already; this holds whatever spelling reaches the root.
            raise RemoteError(
                "invalid_delta", f"a worker reported {rel!r}, which is the tree's root itself", path=rel
            )
        return path

    # Every destination resolves inside the tree NOW, before the first removal: a refusal writes nothing. They
    # stay valid while the delta is applied: a directory it creates is a real one, and links come last.
    dests = {rel: dest(rel) for rel in (*changed, *delta.removed)}

    # Deepest first, so a directory's children go before it.
    for rel in sorted(delta.removed, key=lambda r: -r.count("/")):
        remove_path(dests[rel])
    for rel, e in sorted(changed.items(), key=lambda kv: kv[0].count("/")):
        if e.kind == "dir":
            path = dests[rel]
            if os.path.lexists(path) and not (os.path.isdir(path) and not os.path.islink(path)):
                remove_path(path)
            os.makedirs(path, exist_ok=True)
    files = [(rel, e) for rel, e in changed.items() if e.kind == "file"]
    for rel, _ in files:
        path = dests[rel]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.lexists(path) and (os.path.islink(path) or os.path.isdir(path)):
            remove_path(path)

    rest = _place_inline([(rel, e, dests[rel]) for rel, e in files], blobs)
    _fetch(store, rest, "output_unavailable", "output a worker reported")
    for rel, e in changed.items():
        if e.kind == "link":
            path = dests[rel]
            if os.path.lexists(path):
                remove_path(path)
            os.symlink(e.target, path)


def _fetch(store: ArtifactStore, items: list[tuple[str, Entry, str]], code: str, what: str) -> None:
    """Stream each file's blob to its path (verified, then renamed into place) with its mode; a blob missing or
    corrupt in the store is ``RemoteError(code)`` naming the path."""

    def one(item: tuple[str, Entry, str]) -> None:
        rel, e, path = item
        try:
            store.get_to_file(e.digest, path)
        except ArtifactError as exc:
            if exc.code in ("not_found", "corrupt"):
                raise RemoteError(
                    code,
                    f"{what} {rel!r} (blob {e.digest}) is {exc.code.replace('_', ' ')} in the artifact store "
                    f"{store.url}",
                    cause=exc,
                    path=rel,
                    digest=e.digest,
                ) from exc
            raise
        os.chmod(path, e.mode)

    _parallel(one, items)


def _verified(inline: Iterable[tuple[str, bytes]], code: str, what: str) -> dict[str, bytes]:
    """Inline blobs by digest, each hashing to its digest (``RemoteError(code)`` otherwise): checked before any
    of them is written, like a blob read from the store."""
    out: dict[str, bytes] = {}
    for digest, data in inline:
        if not isinstance(data, bytes) or sha256(data).hexdigest() != digest:
            raise RemoteError(code, f"{what} does not hash to its digest {digest!r}", digest=str(digest))
        out[digest] = data
    return out


def _place_inline(items: list[tuple[str, Entry, str]], blobs: Inline) -> list[tuple[str, Entry, str]]:
    """Write each file whose blob travelled inline (temp file beside it, mode set, renamed into place); return the
    others, for the store."""
    rest = []
    for rel, e, path in items:
        data = blobs.get(e.digest)
        if data is None:
            rest.append((rel, e, path))
            continue
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex}.part")
        try:
            with open(tmp, "xb") as f:
                f.write(data)
            os.chmod(tmp, e.mode)
            os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
    return rest


def _checked(manifest: Mapping[str, Entry]) -> Iterable[str]:
    """Each path, refused unless a normalised relative path strictly inside the tree: ``""`` and ``.`` name the
    root, which a delta may neither remove nor replace (nor a manifest list: the root is the tree itself)."""
    for rel in manifest:
        if (
            not isinstance(rel, str)
            or rel in ("", ".")
            or "\x00" in rel
            or "\\" in rel
            or rel.startswith("/")
            or posixpath.normpath(rel) != rel
            or rel == ".."
            or rel.startswith("../")
        ):
            raise RemoteError(
                "invalid_delta", f"{rel!r} is not a normalised relative path inside the tree", path=str(rel)
            )
        yield rel


def _parallel(fn: Callable[[_T], None], items: list[_T]) -> None:
    if len(items) <= 1:
        for it in items:
            fn(it)
        return
    with ThreadPoolExecutor(max_workers=min(_TRANSFERS, len(items))) as pool:
        # list() re-raises the first failure, after every transfer finished.
        list(pool.map(fn, items))
