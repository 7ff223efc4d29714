"""Publisher keys of the shared cache tier: who may write entries this machine serves.

Each shared entry carries an Ed25519 signature over its canonical bytes (RFC 8785), and a reader serves only entries
signed by a key it trusts: whoever can write the bucket could otherwise hand every reader any value and output.

- A key is named by its key id (docs/rules.md, "Publisher keys"), which entry names carry; the signature, not the
  name, proves the publisher.
- Signatures are domain-separated (``context``): one made for one kind of document never verifies as another.
- :class:`Trust` is what a dispatcher is given: the signer (None → never publish to the shared tier) and the trusted
  public keys, its own first; :func:`trust_from_settings` builds it once per process (the settings are in
  docs/rules.md).
- Publishing to a shared tier takes a CONFIGURED key (a file or a ``Secret`` block, or one a caller passes): the
  workspace key generated when none is configured signs only the workspace's own store (:func:`shared_trust`), so
  a machine nobody gave a key never uploads entries only it trusts into a team's bucket.
- Key files are read strictly: a malformed file or value is a typed error naming it (``SettingsError`` for a
  setting, ``CacheError(invalid_key)`` for an explicit path), never skipped. Private keys are written ``0600`` with
  create-if-absent (``os.link``), so two processes creating the workspace key at once agree on one key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .._blocks import SIGNING_KEY_BLOCK_SETTING, block_error, secret_from_block
from ..errors import CacheError, SettingsError
from ..settings import CacheSettings

__all__ = [
    "KEY_ID_HEX",
    "PublicKey",
    "SigningKey",
    "Trust",
    "TrustOrigin",
    "key_id_of",
    "generate_key_pair",
    "load_private_key",
    "load_public_key",
    "parse_trusted_keys",
    "workspace_key",
    "trust_from_settings",
    "configured_signing_key",
    "WORKSPACE_KEY_DIR",
    "is_workspace_store",
    "shared_trust",
    "shared_trust_warning",
    "reads_only_notice",
]

#: Hex characters of a key id (64 bits of the public key's SHA-256: enough to name a team's few publishers).
KEY_ID_HEX = 16
#: Where the default workspace key lives, relative to the workspace.
WORKSPACE_KEY_DIR = Path(".smthrs") / "keys"
_PRIVATE_NAME = "cache-signing.key"
_PUBLIC_NAME = "cache-signing.pub"
TrustOrigin = Literal["configured", "reader-only", "workspace-default", "explicit"]


def key_id_of(raw_public: bytes) -> str:
    """The key id of a raw 32-byte Ed25519 public key."""
    return hashlib.sha256(raw_public).hexdigest()[:KEY_ID_HEX]


def _invalid_key(msg: str, where: str = "") -> CacheError:
    return CacheError("invalid_key", msg, where=where)


@dataclass(frozen=True)
class PublicKey:
    """A trusted publisher's public key."""

    raw: bytes = field(repr=False)
    key_id: str = ""
    _key: Ed25519PublicKey = field(repr=False, compare=False, default=None)  # type: ignore[assignment]

    @classmethod
    def from_raw(cls, raw: bytes) -> PublicKey:
        if len(raw) != 32:
            raise _invalid_key(f"an Ed25519 public key is 32 bytes, got {len(raw)}")
        return cls(bytes(raw), key_id_of(raw), Ed25519PublicKey.from_public_bytes(raw))

    def verify(self, signature: bytes, message: bytes, *, context: bytes) -> bool:
        """Whether ``signature`` is this key's signature of ``message`` under ``context``."""
        try:
            self._key.verify(signature, context + b"\x00" + message)
        except InvalidSignature:
            return False
        return True

    def b64(self) -> str:
        """The inline form ``SMTHRS_CACHE_TRUSTED_KEYS`` accepts (base64 of the raw 32 bytes)."""
        return base64.b64encode(self.raw).decode("ascii")

    def pem(self) -> bytes:
        return self._key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )


@dataclass(frozen=True)
class SigningKey:
    """This machine's private publisher key."""

    _key: Ed25519PrivateKey = field(repr=False)
    public: PublicKey
    path: Path | None = None

    @property
    def key_id(self) -> str:
        return self.public.key_id

    @classmethod
    def of(cls, key: Ed25519PrivateKey, path: Path | None = None) -> SigningKey:
        raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls(key, PublicKey.from_raw(raw), path)

    def sign(self, message: bytes, *, context: bytes) -> bytes:
        return self._key.sign(context + b"\x00" + message)

    def pem(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


# -- reading keys ------------------------------------------------------------------------------------------------


def _b64_32(text: str) -> bytes | None:
    try:
        raw = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == 32 else None


def _raw_key(data: bytes) -> bytes | None:
    """32 raw key bytes, given as themselves or as their base64; None for anything else."""
    return data if len(data) == 32 else _b64_32(data.decode("ascii", "replace"))


def _private_from_bytes(data: bytes, where: str) -> Ed25519PrivateKey:
    if data.lstrip().startswith(b"-----BEGIN"):
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise _invalid_key(f"{where} is not an unencrypted PEM private key: {exc}", where=where) from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise _invalid_key(f"{where} holds a {type(key).__name__}, not an Ed25519 key", where=where)
        return key
    raw = _raw_key(data)
    if raw is not None:
        return Ed25519PrivateKey.from_private_bytes(raw)
    raise _invalid_key(
        f"{where} is neither a PEM Ed25519 private key, 32 raw bytes, nor their base64; create one with"
        " `smthrs cache keygen DIR`",
        where=where,
    )


def load_private_key(path: str | os.PathLike[str]) -> SigningKey:
    """A private key file (PEM PKCS#8, 32 raw bytes, or their base64). ``CacheError(invalid_key)`` otherwise."""
    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise _invalid_key(f"cannot read the signing key {p}: {exc}", where=str(p)) from exc
    return SigningKey.of(_private_from_bytes(data, str(p)), p)


def _public_from_bytes(data: bytes, where: str) -> PublicKey:
    if data.lstrip().startswith(b"-----BEGIN"):
        try:
            key = serialization.load_pem_public_key(data)
        except (ValueError, TypeError) as exc:
            raise _invalid_key(f"{where} is not a PEM public key: {exc}", where=where) from exc
        if not isinstance(key, Ed25519PublicKey):
            raise _invalid_key(f"{where} holds a {type(key).__name__}, not an Ed25519 key", where=where)
        return PublicKey.from_raw(
            key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        )
    raw = _raw_key(data)
    if raw is not None:
        return PublicKey.from_raw(raw)
    raise _invalid_key(
        f"{where} is neither a PEM Ed25519 public key, 32 raw bytes, nor their base64", where=where
    )


def load_public_key(spec: str) -> PublicKey:
    """One trusted key: inline PEM, inline base64 of the raw key, or a file holding either (or 32 raw bytes)."""
    s = spec.strip()
    if s.startswith("-----BEGIN"):
        return _public_from_bytes(s.encode("ascii", "replace"), "an inline PEM key")
    p = Path(s).expanduser()
    if p.is_file():
        try:
            return _public_from_bytes(p.read_bytes(), str(p))
        except OSError as exc:
            raise _invalid_key(f"cannot read the public key {p}: {exc}", where=str(p)) from exc
    raw = _b64_32(s)
    if raw is not None:
        return PublicKey.from_raw(raw)
    raise _invalid_key(
        f"trusted key {s[:60]!r} is neither a readable file nor an inline base64/PEM Ed25519 public key",
        where=s[:200],
    )


def parse_trusted_keys(text: str | Iterable[str]) -> tuple[PublicKey, ...]:
    """Comma-separated (or an iterable of) key specs → public keys, deduplicated, in the given order."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: dict[str, PublicKey] = {}
    for item in items:
        if item.strip():
            k = load_public_key(item)
            out.setdefault(k.key_id, k)
    return tuple(out.values())


# -- writing keys ------------------------------------------------------------------------------------------------


def _create_exclusive(path: Path, data: bytes, mode: int) -> bool:
    """Write ``data`` to ``path`` only if absent (temp file + link(2)); False when it already existed."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp)


def generate_key_pair(directory: str | os.PathLike[str]) -> tuple[Path, Path, SigningKey]:
    """``smthrs cache keygen DIR``: write ``DIR/cache-signing.key`` (0600) and ``DIR/cache-signing.pub``.

    Refuses (``CacheError(invalid_key)``) when either file exists: a key is never overwritten."""
    d = Path(directory).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    priv, pub = d / _PRIVATE_NAME, d / _PUBLIC_NAME
    for p in (priv, pub):
        if p.exists():
            raise _invalid_key(
                f"{p} already exists; keys are never overwritten — pick another directory", where=str(p)
            )
    key = SigningKey.of(Ed25519PrivateKey.generate(), priv)
    if not _create_exclusive(priv, key.pem(), 0o600):
        raise _invalid_key(f"{priv} appeared while writing it; pick another directory", where=str(priv))
    _create_exclusive(pub, key.public.pem(), 0o644)
    return priv, pub, key


_WS_LOCK = threading.Lock()


def workspace_key(workspace: str | os.PathLike[str]) -> SigningKey:
    """The workspace's default publisher key, generated on first use (concurrent creators agree on one)."""
    d = Path(workspace) / WORKSPACE_KEY_DIR
    priv = d / _PRIVATE_NAME
    with _WS_LOCK:
        if not priv.is_file():
            d.mkdir(parents=True, exist_ok=True)
            key = SigningKey.of(Ed25519PrivateKey.generate(), priv)
            _create_exclusive(priv, key.pem(), 0o600)  # False: another process won; read its key below
        loaded = load_private_key(priv)
        pub = d / _PUBLIC_NAME
        if not pub.exists():
            _create_exclusive(pub, loaded.public.pem(), 0o644)
        return loaded


# -- the trust policy ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trust:
    """Who this machine is (``signer``, None → never publishes to the shared tier) and whose entries it serves
    (``trusted``, the signer's own key first, then by key id). ``origin`` says how it was configured."""

    signer: SigningKey | None
    trusted: tuple[PublicKey, ...]
    origin: TrustOrigin = "explicit"
    _by_id: dict[str, PublicKey] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        own = [] if self.signer is None else [self.signer.public]
        rest = sorted(self.trusted, key=lambda k: k.key_id)
        by_id: dict[str, PublicKey] = {}
        for k in [*own, *rest]:
            by_id.setdefault(k.key_id, k)
        object.__setattr__(self, "trusted", tuple(by_id.values()))
        object.__setattr__(self, "_by_id", by_id)

    @classmethod
    def of(
        cls, signer: SigningKey | None, trusted: Iterable[PublicKey] = (), origin: TrustOrigin = "explicit"
    ) -> Trust:
        return cls(signer, tuple(trusted), origin)

    @property
    def publishers(self) -> tuple[str, ...]:
        """Trusted key ids in lookup order: this machine's own first, then by key id."""
        return tuple(k.key_id for k in self.trusted)

    def key(self, key_id: str) -> PublicKey | None:
        """The trusted key with this id, or None (untrusted)."""
        return self._by_id.get(key_id)

    def describe(self) -> str:
        own = "none (reads only)" if self.signer is None else self.signer.key_id
        return f"signing key {own}; trusted {', '.join(self.publishers) or 'none'} ({self.origin})"


def configured_signing_key(settings: CacheSettings) -> SigningKey | None:
    """The publishing key the settings configure (``SMTHRS_CACHE_SIGNING_KEY`` or ``_BLOCK``, loaded now), or None
    when neither is set. ``SettingsError`` naming the variable when it cannot be read."""
    block = settings.cache_signing_key_block
    if block is not None:
        return _signing_key_from_block(block, settings.cache_signing_key)
    try:
        if settings.cache_signing_key is not None:
            return load_private_key(settings.cache_signing_key)
    except CacheError as exc:
        raise SettingsError("invalid_setting", f"SMTHRS_CACHE_SIGNING_KEY: {exc.message}", cause=exc) from exc
    return None


def trust_from_settings(settings: CacheSettings, workspace: str | os.PathLike[str]) -> Trust:
    """The trust policy the settings describe (module table). ``SettingsError`` naming the variable when a
    configured key cannot be read."""
    signer = configured_signing_key(settings)
    trusted: tuple[PublicKey, ...] = ()
    try:
        if settings.cache_trusted_keys is not None:
            trusted = parse_trusted_keys(settings.cache_trusted_keys)
    except CacheError as exc:
        raise SettingsError(
            "invalid_setting", f"SMTHRS_CACHE_TRUSTED_KEYS: {exc.message}", cause=exc
        ) from exc
    if signer is not None:
        return Trust(signer, trusted, "configured")
    if settings.cache_trusted_keys is not None:
        return Trust(None, trusted, "reader-only")
    return Trust(workspace_key(workspace), (), "workspace-default")


def _signing_key_from_block(block: str, key_file: str | None) -> SigningKey:
    """The publisher key held by the ``Secret`` block ``block`` (loaded through Prefect, :mod:`.._blocks`)."""
    if key_file is not None:
        # Two sources of one identity: refusing beats guessing which key the operator meant to publish under.
        raise block_error(
            "conflict",
            block,
            SIGNING_KEY_BLOCK_SETTING,
            "SMTHRS_CACHE_SIGNING_KEY names a key file too; set only one of the two",
        )
    data = secret_from_block(block)
    try:
        return SigningKey.of(_private_from_bytes(data, f"the Secret block {block!r}"))
    except CacheError as exc:
        # The message names the block, never the value (``_private_from_bytes`` describes only its shape).
        raise block_error("invalid_block", block, SIGNING_KEY_BLOCK_SETTING, exc.message) from None


def is_workspace_store(url: str, workspace: str | os.PathLike[str]) -> bool:
    """Whether the store at ``url`` is this workspace's own (a ``file://`` path inside it): nobody else reads or
    publishes there, so it is not a shared tier other machines see."""
    if not url.startswith("file://"):
        return False
    try:
        Path(url[len("file://") :]).resolve().relative_to(Path(workspace).resolve())
    except ValueError:
        return False
    return True


def shared_trust(trust: Trust, shared_url: str, workspace: str | os.PathLike[str]) -> Trust:
    """The trust a shared tier at ``shared_url`` is used with: ``trust`` itself, or — for the generated workspace
    key and a store outside the workspace — the same trusted keys without a signer (reads only: an entry signed by
    a key no other machine was told to trust would only fill the team's bucket)."""
    if trust.signer is None or trust.origin != "workspace-default":
        return trust
    if is_workspace_store(shared_url, workspace):
        return trust
    return Trust(None, trust.trusted, trust.origin)


def shared_trust_warning(trust: Trust, shared_url: str, workspace: str | os.PathLike[str]) -> str | None:
    """What to say loudly when a shared tier other machines may write (anything but a local path inside the
    workspace) is used with no configured key: this machine reads it only, and serves nothing other machines
    published (it trusts only its own workspace key)."""
    if trust.origin != "workspace-default" or is_workspace_store(shared_url, workspace):
        return None
    return (
        f"this machine has no publishing key: it reads the shared cache tier {shared_url} but never publishes to"
        " it (what it builds stays in its local tier), and it serves only entries of keys it trusts — none but"
        f" its own workspace key ({trust.publishers[0] if trust.publishers else '-'}), so entries other machines"
        " published there are IGNORED. To serve them, set SMTHRS_CACHE_TRUSTED_KEYS to their public keys; to"
        " publish, create a key (`smthrs cache keygen DIR`) and set SMTHRS_CACHE_SIGNING_KEY=DIR/cache-signing.key"
        " (or SMTHRS_CACHE_SIGNING_KEY_BLOCK). `smthrs doctor` checks the setup"
    )


def reads_only_notice(trust: Trust, shared_url: str, workspace: str | os.PathLike[str]) -> str | None:
    """What to say once when a shared tier is configured for reading only (trusted keys, no signing key)."""
    if trust.origin != "reader-only" or is_workspace_store(shared_url, workspace):
        return None
    return (
        f"this machine reads the shared cache tier {shared_url} only (SMTHRS_CACHE_TRUSTED_KEYS, no"
        " SMTHRS_CACHE_SIGNING_KEY): entries it builds stay in its local tier"
    )
