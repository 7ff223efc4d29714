"""Storage backends of :mod:`smthrs_plugin.stores.artifacts` (private).

Everything is plain fsspec except the create-if-absent primitive: local disk stages a temp file and
``os.link``\\ s it into place (EEXIST when the name exists), S3 sends ``If-None-Match: *`` on ``PUT`` and on
``CompleteMultipartUpload``, ``memory://`` checks-and-sets under a process lock. fsspec's local
``mode="create"`` (check-then-write) is never used.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import uuid
from collections.abc import Callable
from typing import IO, Any, Union

#: ``progress(bytes_done, total_bytes_or_None)``; called from the transferring thread.
ProgressFn = Callable[[int, Union[int, None]], None]
CHUNK = 4 * 2**20


class NotARegularFile(OSError):
    """A path that should hold a document holds something else (a FIFO, a device, a directory)."""


class OverLimit(OSError):
    """A document whose size, known before reading it, is over the reader's limit."""


class Backend:
    kind = "generic"

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")

    def create_bytes(self, path: str, data: bytes) -> bool:
        """Write ``data`` at ``path`` unless something is there already; True when this call created it."""
        raise NotImplementedError

    def create_from_file(self, path: str, src: IO[bytes], progress: ProgressFn | None, total: int) -> str:
        """Create-if-absent from a stream whose digest was already computed; returns the digest of what was
        written (the caller compares it and nothing is published when they differ)."""
        raise NotImplementedError

    def stage_file(self, src: IO[bytes], progress: ProgressFn | None, total: int) -> tuple[str, str] | None:
        """Local disk only: copy ``src`` to a staging file while hashing it (one pass)."""
        return None

    def publish_staged(self, staged: str, path: str) -> None:
        raise NotImplementedError

    def discard_staged(self, staged: str) -> None:
        raise NotImplementedError

    def read(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(path))

    def read_bounded(self, path: str, limit: int) -> bytes:
        """At most ``limit + 1`` bytes of ``path`` (one more than allowed tells the caller it is too large); a
        backend that knows the size first raises :class:`OverLimit` instead of reading."""
        # A ranged read: an object of any size costs the reader at most limit + 1 bytes.
        return bytes(self.fs.cat_file(path, start=0, end=limit + 1))

    def open_read(self, path: str) -> IO[bytes]:
        return self.fs.open(path, "rb")  # type: ignore[no-any-return]

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def remove(self, path: str) -> bool:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            return False
        return True

    def find(self, prefix: str, *, withdirs: bool = False) -> list[str]:
        try:
            found = self.fs.find(prefix, withdirs=withdirs)
        except FileNotFoundError:
            return []
        return [str(p) for p in found]


class LocalBackend(Backend):
    kind = "local"

    # Directories are created when a call finds them missing, not checked before every write: a makedirs costs a
    # mkdir and a stat even when the directory exists, twice per stored entry or blob.
    def _tmp(self) -> str:
        return f"{self.root}/tmp/{uuid.uuid4().hex}.part"

    def _open_tmp(self, tmp: str) -> IO[bytes]:
        try:
            return open(tmp, "xb")
        except FileNotFoundError:
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            return open(tmp, "xb")

    def _link(self, tmp: str, path: str) -> bool:
        # link(2) fails with EEXIST when the name exists: create-if-absent without a check-then-write race.
        try:
            try:
                os.link(tmp, path)
            except FileNotFoundError:
                if not os.path.exists(tmp):
                    raise  # the staged file itself is gone: not a missing directory
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.link(tmp, path)
        except FileExistsError:
            return False
        return True

    def create_bytes(self, path: str, data: bytes) -> bool:
        tmp = self._tmp()
        try:
            with self._open_tmp(tmp) as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            return self._link(tmp, path)
        finally:
            unlink_quiet(tmp)

    def stage_file(self, src: IO[bytes], progress: ProgressFn | None, total: int) -> tuple[str, str] | None:
        tmp = self._tmp()
        h = hashlib.sha256()
        done = 0
        try:
            with self._open_tmp(tmp) as out:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, total)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            unlink_quiet(tmp)
            raise
        return tmp, h.hexdigest()

    def publish_staged(self, staged: str, path: str) -> None:
        self._link(staged, path)

    def discard_staged(self, staged: str) -> None:
        unlink_quiet(staged)

    def open_read(self, path: str) -> IO[bytes]:
        return open(path, "rb")

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def read_bounded(self, path: str, limit: int) -> bytes:
        # Non-blocking and checked before reading: a FIFO or device planted at an entry's name must not hang
        # or flood the reader.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotARegularFile(path)
            if st.st_size > limit:
                raise OverLimit(path)  # refused by its size: a planted huge file costs no read at all
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read(limit + 1)
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        return os.path.isfile(path)

    def remove(self, path: str) -> bool:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True


MEMORY_LOCK = threading.Lock()


class MemoryBackend(Backend):
    kind = "memory"

    def create_bytes(self, path: str, data: bytes) -> bool:
        # memory:// lives in this process only; the lock makes check-and-set atomic among its threads.
        with MEMORY_LOCK:
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, bytes(data))
            return True

    def create_from_file(self, path: str, src: IO[bytes], progress: ProgressFn | None, total: int) -> str:
        data = src.read()
        if progress is not None:
            progress(len(data), total)
        digest = hashlib.sha256(data).hexdigest()
        if path.endswith(digest[2:]):
            self.create_bytes(path, data)
        return digest


class S3Backend(Backend):
    kind = "s3"

    def remove(self, path: str) -> bool:
        # S3 DELETE succeeds on a missing key: ask first (two concurrent deleters may both report Deleted).
        if not self.fs.exists(path):
            return False
        self.fs.rm_file(path)
        return True

    def create_bytes(self, path: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(path, data, mode="create")  # PUT with If-None-Match: *
        except FileExistsError:
            return False
        return True

    def create_from_file(self, path: str, src: IO[bytes], progress: ProgressFn | None, total: int) -> str:
        # Stream with "xb" (multipart, committed with If-None-Match: *) and hash what is actually sent; when the
        # source changed since it was hashed, abort the upload instead of committing it under the wrong name.
        f = self.fs.open(path, "xb", block_size=max(5 * 2**20, CHUNK))
        h = hashlib.sha256()
        done = 0
        committed = False
        try:
            while chunk := src.read(CHUNK):
                h.update(chunk)
                f.write(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
            digest = h.hexdigest()
            if path.endswith(digest[2:]):
                try:
                    f.close()
                except FileExistsError:
                    pass  # another writer stored the same bytes first: content addressing makes that success
                committed = True
            return digest
        finally:
            if not committed:
                # fsspec files commit on close()/__del__ even after an error: abort explicitly, then mark closed
                # so that garbage collection cannot publish a half-written blob.
                try:
                    f.discard()
                finally:
                    f.closed = True


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------------------------------------------


def size_of(f: IO[bytes]) -> int | None:
    size = getattr(f, "size", None)  # fsspec buffered files know their size
    if isinstance(size, int):
        return size
    try:
        return os.fstat(f.fileno()).st_size
    except (OSError, AttributeError, ValueError):
        return None


def hash_stream(f: IO[bytes]) -> str:
    """Hex SHA-256 of the rest of an open binary stream."""
    if hasattr(hashlib, "file_digest"):
        return hashlib.file_digest(f, "sha256").hexdigest()  # type: ignore[arg-type]
    h = hashlib.sha256()
    while chunk := f.read(CHUNK):
        h.update(chunk)
    return h.hexdigest()
