"""The shared cache tier: ``ac/<key digest>.json`` entries in an artifact store, first writer wins.

Invariants (Bazel's remote cache: CAS before AC)
- An entry is published only AFTER every blob it references (``referenced_digests``) exists in the shared store:
  blobs are copied there first (streamed through a temporary file, verified on both sides), then the entry is
  created with the store's atomic create-if-absent. A reader therefore never sees an entry whose blobs were not
  published; a blob can still go missing later (a gc race, an operator) and the seam then re-executes.
- First writer wins: a second publication answers :class:`AlreadyPublished` with the winner's decoded entry; the
  caller compares results (strict vs nondeterministic). Entries are never overwritten.
- Only ``shared``-scope entries are ever published (the seam checks admission first); a read re-decodes and
  verifies the document and checks it names the key it is stored under.
- Failures keep their stage: :class:`PublicationFailed` carries ``stage`` (``blobs`` or ``entry``) and the
  ``ArtifactError`` cause, so the seam can journal ``cache-provenance {action: "unpublished", stage}`` and carry
  on — a failed shared publication never fails the run.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal, Union

from ..boundary.evidence import referenced_digests
from ..canonical import key_digest
from ..errors import ArtifactError
from ..stores.artifacts import ArtifactStore, Existing
from .entry import CacheEntry, Decoded, Undecodable, decode_entry

__all__ = [
    "SharedTier",
    "Published",
    "AlreadyPublished",
    "PublishOutcome",
    "PublicationFailed",
    "copy_blobs",
    "same_store",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Published:
    """This writer created the entry."""


@dataclass(frozen=True)
class AlreadyPublished:
    """Another writer won; ``winner`` is its entry (or why it does not decode)."""

    winner: Decoded


PublishOutcome = Union[Published, AlreadyPublished]


class PublicationFailed(Exception):
    """Publishing to the shared tier failed at ``stage``; ``cause`` is the storage error."""

    def __init__(self, stage: Literal["blobs", "entry"], cause: ArtifactError) -> None:
        super().__init__(f"shared publication failed at stage {stage!r}: {cause}")
        self.stage = stage
        self.cause = cause


def same_store(a: ArtifactStore, b: ArtifactStore) -> bool:
    """Whether two handles name the same artifact root (then there is nothing to copy or hydrate)."""
    return a is b or (a.url == b.url and a.storage_options == b.storage_options)


def copy_blobs(digests: Iterable[str], src: ArtifactStore, dst: ArtifactStore) -> int:
    """Copy every digest missing from ``dst`` out of ``src`` (streamed, verified on read and on write).

    Raises ``ArtifactError`` (``not_found``/``corrupt`` from ``src``, ``unavailable`` from either). Returns the
    number of blobs copied."""
    wanted = sorted(set(digests))
    if not wanted or same_store(src, dst):
        return 0
    present = dst.has_many(wanted)
    missing = [d for d in wanted if not present[d]]
    if not missing:
        return 0
    tmp = tempfile.mkdtemp(prefix="smthrs-blobcopy-")
    try:
        for d in missing:
            path = os.path.join(tmp, d)
            src.get_to_file(d, path)
            dst.put_file(path, expected_digest=d)
            os.unlink(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return len(missing)


class SharedTier:
    """Entries under ``<store>/ac/``; blobs under ``<store>/cas/``."""

    def __init__(self, store: ArtifactStore) -> None:
        self.store = store

    def lookup(self, key: str) -> Decoded | None:
        """The entry published for ``key`` (decoded and verified), or None. Raises ``ArtifactError`` when the
        store cannot be read."""
        name = key_digest(key)
        data = self.store.get_entry(name)
        if data is None:
            return None
        decoded = decode_entry(data, name=name)
        if isinstance(decoded, Undecodable):
            log.warning("shared cache entry %s in %s is not served: %s", name, self.store.url, decoded.reason)
        elif decoded.scope != "shared":
            log.warning(
                "shared cache entry %s in %s is not served: scope %r", name, self.store.url, decoded.scope
            )
            return Undecodable(f"the published entry has scope {decoded.scope!r}", corrupt=True)
        return decoded

    def publish(self, entry: CacheEntry, source: ArtifactStore) -> PublishOutcome:
        """Blobs first (from ``source``), then the entry, first writer wins. Raises :class:`PublicationFailed`."""
        if entry.scope != "shared":
            raise ValueError("only shared-scope (admissible) entries are published")
        try:
            wanted = sorted(referenced_digests(entry.evidence))
            if not same_store(source, self.store):
                copy_blobs(wanted, source, self.store)
            elif wanted:
                # One store: the settle spilled them here already; prove it before the entry becomes visible.
                absent = [d for d, ok in self.store.has_many(wanted).items() if not ok]
                if absent:
                    raise ArtifactError(
                        "not_found",
                        f"blobs {', '.join(absent[:5])} are missing from {self.store.url}; the entry is not"
                        " published",
                    )
        except ArtifactError as exc:
            raise PublicationFailed("blobs", exc) from exc
        try:
            outcome = self.store.put_entry(entry.name, entry.encode())
        except ArtifactError as exc:
            raise PublicationFailed("entry", exc) from exc
        if isinstance(outcome, Existing):
            return AlreadyPublished(decode_entry(outcome.data, name=entry.name))
        return Published()

    def hydrate(self, digests: Iterable[str], into: ArtifactStore) -> int:
        """Copy the blobs a replay found missing from ``into`` out of the shared store; returns how many."""
        return copy_blobs(digests, self.store, into)

    def names(self) -> list[str]:
        return self.store.list_entries()

    def iter_entries(self) -> Iterator[tuple[str, Decoded | None]]:
        """Every published entry (name, decoded) — None when it vanished between listing and reading."""
        for name in self.store.list_entries():
            data = self.store.get_entry(name)
            yield name, None if data is None else decode_entry(data, name=name)
