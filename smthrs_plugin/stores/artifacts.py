"""Content-addressed artifact store over any fsspec URL (local disk, ``memory://``, ``s3://``).

Layout under the root URL::

    <root>/cas/sha256/ab/cdef…     blobs, named by the lowercase hex SHA-256 of their bytes (git's fan-out)
    <root>/ac/<name>.json          shared cache entries, first writer wins
    <root>/tmp/…                   local-disk staging only (never a blob, never listed)

Invariants
- A blob is only ever visible under its final name complete: local disk writes a temp file then ``os.link``\\ s
  it (the link fails if the name exists, so it is also create-if-absent); S3 ``PUT`` and multipart
  ``CompleteMultipartUpload`` are atomic and carry ``If-None-Match: *``; ``memory://`` swaps whole values under a
  lock. fsspec's local ``mode="create"`` (check-then-write) is never used.
- Bytes are verified on every read: a blob that no longer hashes to its name is ``corrupt`` and never returned.
- Entries are published first-writer-wins with the same primitive (``Created | Existing``); a writer publishes
  every blob an entry references *before* the entry, so a reader never sees an entry with a missing blob —
  the ordering Bazel's remote action cache relies on (CAS before AC).
- The fsspec filesystem is opened lazily once per process and never pickled: the store pickles as
  ``(url, storage_options)`` so process-pool and Dask workers open their own.
- Every storage failure becomes ``ArtifactError(unavailable)`` with the original exception as ``cause``.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, Union

from ..errors import ArtifactError
from ._artifact_backends import (
    CHUNK,
    Backend,
    LocalBackend,
    MemoryBackend,
    NotARegularFile,
    OverLimit,
    ProgressFn,
    S3Backend,
    hash_stream,
    size_of,
    unlink_quiet,
)

__all__ = [
    "ArtifactStore",
    "MAX_ENTRY_BYTES",
    "UNREADABLE_ENTRY",
    "ProgressFn",
    "Created",
    "Existing",
    "Deleted",
    "NotFound",
    "Intact",
    "Corrupt",
    "PutEntryOutcome",
    "DeleteOutcome",
    "BlobCheck",
    "is_digest",
]

#: The largest entry document a reader accepts: room for the largest honest entry (8 MiB of inline outputs,
#: base64-encoded, plus the value and provenance); the publisher refuses to publish a larger one.
MAX_ENTRY_BYTES = 32 * 1024 * 1024
#: The ``ArtifactError`` codes of :meth:`ArtifactStore.get_entry` that say something about the document at the name
#: (too large, not a regular file), not about reaching the store: a reader treats such a document as refused.
UNREADABLE_ENTRY = frozenset({"too_large", "not_a_file"})


_DIGEST_RE = re.compile(r"[0-9a-f]{64}\Z")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}\Z")
_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass(frozen=True)
class Created:
    """``put_entry``: this call published the entry."""

    name: str


@dataclass(frozen=True)
class Existing:
    """``put_entry``: another writer published first; ``data`` are the bytes that won."""

    name: str
    data: bytes


@dataclass(frozen=True)
class Deleted:
    name: str


@dataclass(frozen=True)
class NotFound:
    name: str


@dataclass(frozen=True)
class Intact:
    """``check_blob``: the blob exists and hashes to its name."""

    digest: str
    size: int


@dataclass(frozen=True)
class Corrupt:
    """``check_blob``: the blob exists but its bytes hash to ``actual``."""

    digest: str
    actual: str


PutEntryOutcome = Union[Created, Existing]
DeleteOutcome = Union[Deleted, NotFound]
BlobCheck = Union[Intact, Corrupt, NotFound]


def is_digest(value: object) -> bool:
    """True for a plain lowercase hex SHA-256 (64 characters)."""
    return isinstance(value, str) and _DIGEST_RE.match(value) is not None


def _check_digest(digest: object) -> str:
    if not is_digest(digest):
        raise ArtifactError(
            "invalid_digest",
            f"{digest!r} is not a blob digest; pass the plain lowercase hex SHA-256 of the bytes (64 characters)",
            digest=repr(digest),
        )
    return str(digest)


def _check_name(name: object) -> str:
    if not isinstance(name, str) or _NAME_RE.match(name) is None:
        raise ArtifactError(
            "invalid_name",
            f"entry name {name!r} is not allowed; use 1-200 characters of [A-Za-z0-9._-] starting with a letter"
            " or digit (e.g. a key digest)",
            name=repr(name),
        )
    return name


def _unavailable(url: str, action: str, exc: BaseException) -> ArtifactError:
    return ArtifactError(
        "unavailable",
        f"artifact store {url} failed to {action}: {type(exc).__name__}: {exc}. Check that the store is reachable"
        " and writable (endpoint, credentials, permissions), then retry",
        cause=exc,
        url=url,
    )


class ArtifactStore:
    """A content-addressed blob store plus first-writer-wins entries under one fsspec URL.

    ``url``: a local path, ``file://…``, ``memory://…`` or ``s3://bucket/prefix`` (needs ``s3fs``);
    ``storage_options``: passed to fsspec (e.g. ``{"endpoint_url": …, "key": …, "secret": …}``).
    Refuses (``invalid_url``) protocols with no known atomic create-if-absent primitive.
    """

    def __init__(
        self, url: str, storage_options: Mapping[str, Any] | None = None, *, max_workers: int = 8
    ) -> None:
        if not isinstance(url, str) or not url.strip():
            raise ArtifactError("invalid_url", f"artifact URL {url!r} is empty; pass a path or an fsspec URL")
        from fsspec.core import split_protocol

        protocol, rest = split_protocol(url)
        if protocol in (None, "file", "local"):
            # Resolved now: the filesystem opens lazily, maybe in another process with another cwd.
            url = "file://" + os.path.abspath(os.path.expanduser(rest))
            self._kind = "local"
        elif protocol == "memory":
            self._kind = "memory"
        elif protocol in ("s3", "s3a"):
            self._kind = "s3"
        else:
            raise ArtifactError(
                "invalid_url",
                f"artifact URL {url!r} uses protocol {protocol!r}, for which no atomic create-if-absent primitive"
                " is known; use a local path, file://, memory:// or s3://",
                url=url,
            )
        if not isinstance(max_workers, int) or max_workers < 1:
            raise ArtifactError("invalid_url", f"max_workers must be a positive int, got {max_workers!r}")
        self._url = url
        self._options: dict[str, Any] = dict(storage_options or {})
        self._max_workers = max_workers
        self._backend: Backend | None = None
        self._pid = -1
        self._lock = threading.Lock()

    # -- identity and pickling ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._url

    @property
    def storage_options(self) -> dict[str, Any]:
        return dict(self._options)

    @property
    def kind(self) -> str:
        """``"local"`` (this machine's disk), ``"memory"`` (this process) or ``"s3"`` (reachable from anywhere
        with the storage options): what remote execution asks before shipping a tree through the store."""
        return self._kind

    def __repr__(self) -> str:
        return f"ArtifactStore({self._url!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self._url, "storage_options": self._options, "max_workers": self._max_workers}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["storage_options"], max_workers=state["max_workers"])  # type: ignore[misc]

    def _be(self) -> Backend:
        pid = os.getpid()
        if self._backend is not None and self._pid == pid:
            return self._backend
        with self._lock:
            if self._backend is None or self._pid != pid:
                self._backend = self._open()
                self._pid = pid
            return self._backend

    def _open(self) -> Backend:
        from fsspec.core import url_to_fs

        options = dict(self._options)
        if self._kind == "s3":
            try:
                import s3fs  # noqa: F401
            except ImportError as exc:
                raise ArtifactError(
                    "invalid_url",
                    f"{self._url} needs s3fs; install it with `pip install 'smthrs-plugin[s3]'`",
                    cause=exc,
                ) from exc
            # Listing caches would let one process answer `exists` from a stale listing: entries and blobs are
            # written by other machines all the time.
            options.setdefault("use_listings_cache", False)
        try:
            fs, root = url_to_fs(self._url, **options)
        except Exception as exc:
            raise ArtifactError(
                "invalid_url",
                f"cannot open artifact store {self._url}: {type(exc).__name__}: {exc}; check the URL and the"
                " storage options",
                cause=exc,
            ) from exc
        cls = {"local": LocalBackend, "memory": MemoryBackend, "s3": S3Backend}[self._kind]
        return cls(fs, root)

    @property
    def fs(self) -> Any:
        """This process's fsspec filesystem (opened on first use)."""
        return self._be().fs

    def blob_path(self, digest: str) -> str:
        """The fsspec path of a blob (for diagnostics; read through :meth:`get_bytes`, which verifies)."""
        d = _check_digest(digest)
        return f"{self._be().root}/cas/sha256/{d[:2]}/{d[2:]}"

    def entry_path(self, name: str) -> str:
        """The fsspec path of a shared cache entry."""
        return f"{self._be().root}/ac/{_check_name(name)}.json"

    def _call(self, action: str, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except ArtifactError:
            raise
        except _ProgressFailed as exc:
            raise exc.original from None  # the caller's own callback failed: not a storage failure
        except Exception as exc:
            raise _unavailable(self._url, action, exc) from exc

    # -- blobs -------------------------------------------------------------------------------------------------

    def put_bytes(self, data: bytes, *, expected_digest: str | None = None) -> str:
        """Store ``data``; returns its digest. With ``expected_digest`` the bytes must hash to it
        (``digest_mismatch`` otherwise, nothing stored). Idempotent: storing existing bytes is a no-op."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"put_bytes takes bytes, got {type(data).__name__}")
        data = bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        if expected_digest is not None and _check_digest(expected_digest) != digest:
            raise ArtifactError(
                "digest_mismatch",
                f"bytes hash to {digest}, not the expected {expected_digest}; nothing was stored",
                digest=digest,
                expected=expected_digest,
            )
        path = self.blob_path(digest)
        be = self._be()
        self._call(f"store blob {digest}", lambda: be.exists(path) or be.create_bytes(path, data))
        return digest

    def put_file(
        self,
        path: str | os.PathLike[str],
        *,
        expected_digest: str | None = None,
        progress: ProgressFn | None = None,
        absent: bool = False,
    ) -> str:
        """Store a local file, streaming (constant memory); returns its digest. ``progress(done, total)`` is
        called as bytes move. A file that changes while being stored is refused (``digest_mismatch``).
        ``absent=True``: the caller just found no blob under this digest (``has_many``), so the existence round
        trip before an upload is skipped; the create is still create-if-absent, never an overwrite."""
        if expected_digest is not None:
            _check_digest(expected_digest)
        be = self._be()
        progress = _guard(progress)
        src_path = os.fspath(path)
        try:
            total = os.path.getsize(src_path)
        except OSError as exc:
            raise ArtifactError(
                "not_found", f"cannot store {src_path}: {exc}; pass an existing readable file", cause=exc
            ) from exc

        def mismatch(actual: str, want: str, why: str) -> ArtifactError:
            return ArtifactError(
                "digest_mismatch",
                f"{src_path} hashed to {actual}, not {want} ({why}); nothing was stored",
                digest=actual,
                expected=want,
            )

        def run() -> str:
            with open(src_path, "rb") as src:
                staged = be.stage_file(src, progress, total)
            if staged is not None:  # local disk: one pass, then link(2) into place
                tmp, digest = staged
                try:
                    if expected_digest is not None and digest != expected_digest:
                        raise mismatch(digest, expected_digest, "the file differs from what was measured")
                    be.publish_staged(tmp, self.blob_path(digest))
                finally:
                    be.discard_staged(tmp)
                return digest
            with open(src_path, "rb") as src:
                first = hash_stream(src)
            if expected_digest is not None and first != expected_digest:
                raise mismatch(first, expected_digest, "the file differs from what was measured")
            final = self.blob_path(first)
            if not absent and be.exists(final):
                if progress is not None:
                    progress(total, total)
                return first
            with open(src_path, "rb") as src:
                sent = be.create_from_file(final, src, progress, total)
            if sent != first:
                raise mismatch(sent, first, "the file changed while it was being stored")
            return first

        return self._call(f"store file {src_path}", run)

    def has(self, digest: str) -> bool:
        """Whether a blob with this digest exists (not verified: :meth:`check_blob` reads it)."""
        path = self.blob_path(digest)
        be = self._be()
        return self._call(f"look up blob {digest}", lambda: be.exists(path))

    def get_bytes(self, digest: str) -> bytes:
        """The verified bytes of a blob: ``not_found`` when absent, ``corrupt`` when they no longer hash to
        ``digest`` (never returned)."""
        path = self.blob_path(digest)
        be = self._be()
        try:
            data = be.read(path)
        except FileNotFoundError as exc:
            raise self._not_found(digest, exc) from exc
        except Exception as exc:
            raise _unavailable(self._url, f"read blob {digest}", exc) from exc
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise self._corrupt(digest, actual)
        return data

    def get_to_file(
        self, digest: str, dest: str | os.PathLike[str], *, progress: ProgressFn | None = None
    ) -> None:
        """Stream a blob into the local file ``dest`` (temp file in the same directory, verified, then renamed
        into place). ``dest`` is untouched unless the bytes verify."""
        path = self.blob_path(digest)
        be = self._be()
        progress = _guard(progress)
        dest_s = os.fspath(dest)
        tmp = os.path.join(
            os.path.dirname(dest_s) or ".", f".{os.path.basename(dest_s)}.{uuid.uuid4().hex}.part"
        )
        try:
            try:
                with be.open_read(path) as src, open(tmp, "xb") as out:
                    total = size_of(src)
                    h = hashlib.sha256()
                    done = 0
                    while chunk := src.read(CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        done += len(chunk)
                        if progress is not None:
                            progress(done, total)
            except FileNotFoundError as exc:
                if not os.path.isdir(os.path.dirname(dest_s) or "."):
                    raise ArtifactError(
                        "not_found",
                        f"destination directory of {dest_s} does not exist; create it first",
                        cause=exc,
                    ) from exc
                raise self._not_found(digest, exc) from exc
            except _ProgressFailed as exc:
                raise exc.original from None
            except Exception as exc:
                raise _unavailable(self._url, f"read blob {digest}", exc) from exc
            actual = h.hexdigest()
            if actual != digest:
                raise self._corrupt(digest, actual)
            os.replace(tmp, dest_s)
        finally:
            unlink_quiet(tmp)

    def check_blob(self, digest: str) -> BlobCheck:
        """Read and hash a blob: ``Intact | Corrupt | NotFound`` (for ``smthrs cache verify``)."""
        try:
            data = self.get_bytes(digest)
        except ArtifactError as exc:
            if exc.code == "not_found":
                return NotFound(digest)
            if exc.code == "corrupt":
                return Corrupt(digest, str(exc.details["actual"]))
            raise
        return Intact(digest, len(data))

    def iter_blobs(self) -> Iterator[str]:
        """Every stored blob digest, sorted (for gc)."""
        be = self._be()
        prefix = f"{be.root}/cas/sha256"
        paths = self._call("list blobs", lambda: be.find(prefix))
        out = []
        for p in paths:
            parts = p.rstrip("/").rsplit("/", 2)
            if len(parts) == 3 and is_digest(parts[1] + parts[2]):
                out.append(parts[1] + parts[2])
        yield from sorted(out)

    def delete_blob(self, digest: str) -> DeleteOutcome:
        """Remove a blob (gc). Delete only blobs no entry references: a reader trusts CAS-before-AC."""
        path = self.blob_path(digest)
        be = self._be()
        gone = self._call(f"delete blob {digest}", lambda: be.remove(path))
        return Deleted(digest) if gone else NotFound(digest)

    # -- batches (thread pool; S3 round trips dominate) --------------------------------------------------------

    def _map(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        if len(items) <= 1:
            return [fn(x) for x in items]
        with ThreadPoolExecutor(max_workers=min(self._max_workers, len(items))) as pool:
            # map() re-raises the first failure in input order, after every call has finished.
            return list(pool.map(fn, items))

    def has_many(self, digests: Iterable[str]) -> dict[str, bool]:
        """``{digest: exists}`` in input order."""
        ds = [_check_digest(d) for d in digests]
        return dict(zip(ds, self._map(self.has, ds), strict=True))

    def put_many(self, blobs: Iterable[bytes]) -> list[str]:
        """Store several byte strings; digests in input order."""
        return self._map(self.put_bytes, list(blobs))

    def put_files(
        self, files: Iterable[tuple[str | os.PathLike[str], str | None]], *, absent: bool = False
    ) -> list[str]:
        """Store several local files ``(path, expected_digest or None)``; digests in input order. ``absent`` as
        for :meth:`put_file`."""
        return self._map(
            lambda item: self.put_file(item[0], expected_digest=item[1], absent=absent), list(files)
        )

    def get_many(self, digests: Iterable[str]) -> dict[str, bytes]:
        """``{digest: verified bytes}``; the first missing/corrupt blob (in input order) raises."""
        ds = list(dict.fromkeys(_check_digest(d) for d in digests))
        return dict(zip(ds, self._map(self.get_bytes, ds), strict=True))

    # -- entries (the shared cache tier) -----------------------------------------------------------------------

    def put_entry(self, name: str, data: bytes) -> PutEntryOutcome:
        """Publish an entry unless one exists: ``Created`` (this writer won) or ``Existing`` (with the winning
        bytes). Publish every blob the entry references first. What holds the name may be unreadable:
        ``ArtifactError(too_large | not_a_file)`` as from :meth:`get_entry`."""
        path = self.entry_path(name)
        be = self._be()
        payload = bytes(data)
        for _ in range(3):
            if self._call(f"publish entry {name}", lambda: be.create_bytes(path, payload)):
                return Created(name)
            existing = self.get_entry(name)
            if existing is not None:
                return Existing(name, existing)
            # deleted (gc) between our failed create and the read: try to publish again
        raise ArtifactError(
            "unavailable",
            f"entry {name} kept appearing and disappearing while publishing it; is a gc running concurrently?",
            name=name,
        )

    def get_entry(self, name: str, *, max_bytes: int = MAX_ENTRY_BYTES) -> bytes | None:
        """The entry's bytes, or ``None`` when there is none. Read bounded: an entry over ``max_bytes`` is
        ``ArtifactError(too_large)`` and anything but a regular file ``ArtifactError(not_a_file)`` — whoever can
        write the store can plant either, and neither may exhaust or hang the reader (local disk refuses by the
        file's size before reading it; a remote store reads at most ``max_bytes + 1`` bytes)."""
        path = self.entry_path(name)
        be = self._be()
        try:
            data = be.read_bounded(path, max_bytes)
        except FileNotFoundError:
            return None
        except OverLimit as exc:
            raise self._entry_too_large(name, max_bytes) from exc
        except NotARegularFile as exc:
            raise ArtifactError(
                "not_a_file",
                f"entry {name} in {self._url} is not a regular file; remove it (`smthrs cache verify"
                " --with-shared` lists it)",
                name=name,
            ) from exc
        except IsADirectoryError as exc:
            raise ArtifactError(
                "not_a_file", f"entry {name} in {self._url} is a directory; remove it", name=name
            ) from exc
        except Exception as exc:
            raise _unavailable(self._url, f"read entry {name}", exc) from exc
        if len(data) > max_bytes:
            raise self._entry_too_large(name, max_bytes)
        return data

    def list_entries(self) -> list[str]:
        """Every entry name, sorted — a directory planted at an entry's name included, so that maintenance
        (``smthrs cache verify``) lists what readers refuse there."""
        be = self._be()
        prefix = f"{be.root}/ac"
        paths = self._call("list entries", lambda: be.find(prefix, withdirs=True))
        names = [p.rsplit("/", 1)[-1] for p in paths]
        return sorted({n[: -len(".json")] for n in names if n.endswith(".json") and _NAME_RE.match(n[:-5])})

    def delete_entry(self, name: str) -> DeleteOutcome:
        path = self.entry_path(name)
        be = self._be()
        gone = self._call(f"delete entry {name}", lambda: be.remove(path))
        return Deleted(name) if gone else NotFound(name)

    def purge_staging(self, older_than_s: float = 3600.0) -> int:
        """Local disk: remove staging files left by crashed writers (they are never visible as blobs)."""
        be = self._be()
        if be.kind != "local":
            return 0
        import time

        d = Path(be.root) / "tmp"
        n = 0
        cutoff = time.time() - older_than_s
        for p in d.glob("*.part") if d.is_dir() else ():
            try:
                if p.stat().st_mtime < cutoff:
                    p.unlink()
                    n += 1
            except FileNotFoundError:
                pass
        return n

    # -- helpers -----------------------------------------------------------------------------------------------

    def _entry_too_large(self, name: str, max_bytes: int) -> ArtifactError:
        return ArtifactError(
            "too_large",
            f"entry {name} in {self._url} is larger than {max_bytes} bytes, more than any honest entry; "
            "remove it (`smthrs cache verify --with-shared` lists it)",
            name=name,
            limit=max_bytes,
        )

    def _not_found(self, digest: str, exc: BaseException | None = None) -> ArtifactError:
        return ArtifactError(
            "not_found",
            f"blob {digest} is not in {self._url}; hydrate it from the shared tier or re-run the step",
            cause=exc,
            digest=digest,
        )

    def _corrupt(self, digest: str, actual: str) -> ArtifactError:
        return ArtifactError(
            "corrupt",
            f"blob {digest} in {self._url} hashes to {actual}: it was tampered with or damaged and is not served;"
            " delete it (`smthrs cache verify`) and re-run the step",
            digest=digest,
            actual=actual,
        )


class _ProgressFailed(Exception):
    """Carries an exception raised by the caller's progress callback through the storage error mapping."""

    def __init__(self, original: Exception) -> None:
        super().__init__(str(original))
        self.original = original


def _guard(progress: ProgressFn | None) -> ProgressFn | None:
    if progress is None:
        return None
    cb = progress

    def guarded(done: int, total: int | None) -> None:
        try:
            cb(done, total)
        except Exception as exc:
            raise _ProgressFailed(exc) from exc

    return guarded
