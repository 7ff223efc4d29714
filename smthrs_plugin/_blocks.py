"""Prefect blocks as smthrs configuration: a saved block says where artifacts live, or holds the cache signing key.

``SMTHRS_ARTIFACTS_BLOCK`` / ``open_runtime(artifacts_block=...)`` name a block (``<block type slug>/<name>``, e.g.
``s3-bucket/team-cache``) that becomes the fsspec artifact store — and so the shared cache tier;
``SMTHRS_CACHE_SIGNING_KEY_BLOCK`` names a ``Secret`` block holding the publisher's private key.

Invariants
- **Prefect is imported only here, only inside a function, and only when a block is named.** ``import
  smthrs_plugin``, ``smthrs --help`` and every configuration without a block never import Prefect (it costs
  seconds and may start an ephemeral API server). This module sits on the bottom floor so that
  ``settings`` and ``cache.signing`` can call it without going through the plugin manager.
- **A block that cannot be used is a typed refusal, never a fallback.** Every failure — a malformed name, no such
  block, a block type that is not installed, the wrong type, a stored block that no longer validates, incomplete
  or unsupported credentials, the Prefect API unreachable or refusing — is ``SettingsError(invalid_setting)``
  naming the block and the setting, with ``details["reason"]`` one of :data:`REASONS`, and saying what to do. The
  local default store is used only when no block is named at all.
- **Secret values never leave this module in a message.** The secret access key, session token, MinIO password,
  remote file system settings and a ``Secret`` block's value live only in :attr:`ArtifactLocation.options` (kept
  out of its repr) or the returned key bytes. Errors name blocks, types and field names, never values; a Prefect
  failure that may echo stored values (pydantic validation of the block) is summarised by field location only and
  is not chained (``from None``), so no traceback prints it either.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from .errors import SettingsError

__all__ = [
    "ARTIFACTS_BLOCK_SETTING",
    "SIGNING_KEY_BLOCK_SETTING",
    "REASONS",
    "SUPPORTED_ARTIFACT_BLOCKS",
    "ArtifactLocation",
    "artifacts_from_block",
    "block_error",
    "check_block_name",
    "secret_from_block",
]

ARTIFACTS_BLOCK_SETTING: Final = "SMTHRS_ARTIFACTS_BLOCK"
SIGNING_KEY_BLOCK_SETTING: Final = "SMTHRS_CACHE_SIGNING_KEY_BLOCK"

#: ``details["reason"]`` of a block refusal (a closed set, like an error code; see the module docstring).
REASONS: Final = frozenset(
    {
        "invalid_name",  # not <type slug>/<name>
        "conflict",  # a URL (or key file) and a block given at the same level
        "not_found",  # no block document of that type and name on the Prefect API consulted
        "unknown_type",  # the block type's Python class is not installed here
        "wrong_type",  # the block is not one this setting can use
        "invalid_block",  # the stored block no longer validates against its class
        "missing_credentials",  # half a key pair, or an empty secret
        "unsupported",  # a block option smthrs cannot honour (e.g. assume-role)
        "unreachable",  # the Prefect API did not answer, or refused the request
    }
)

#: What a "save it first" hint suggests for a block type.
_EXAMPLE_CLASS: Final = {
    "s3-bucket": "S3Bucket",
    "remote-file-system": "RemoteFileSystem",
    "secret": "Secret",
}

#: Block type slugs an artifacts block may have, and what they become.
SUPPORTED_ARTIFACT_BLOCKS: Final = ("s3-bucket", "remote-file-system")

#: How a refusal names where the block came from (the setting, or the argument that overrides it).
_LABELS: Final = {
    ARTIFACTS_BLOCK_SETTING: f"{ARTIFACTS_BLOCK_SETTING} / artifacts_block=",
    SIGNING_KEY_BLOCK_SETTING: SIGNING_KEY_BLOCK_SETTING,
}

# Prefect's slugs and block document names: lowercase letters, digits and dashes (names may also hold
# underscores/dots in older servers; anything but a slash or whitespace is passed through to the API).
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*/[^/\s]+$")


@dataclass(frozen=True)
class ArtifactLocation:
    """Where the artifact store lives: an fsspec ``url``, its storage ``options`` (may hold credentials — never in
    the repr) and the ``block`` it came from (None: a URL setting or the local default)."""

    url: str
    options: Mapping[str, Any] = field(repr=False, default_factory=dict)
    block: str | None = None


def block_error(reason: str, block: str, setting: str, message: str) -> SettingsError:
    """The typed refusal for ``block`` (named by ``setting``): ``details`` carry the block, the setting and the
    reason (one of :data:`REASONS`)."""
    if reason not in REASONS:
        raise ValueError(f"unknown block refusal reason {reason!r}; known: {sorted(REASONS)}")
    label = _LABELS.get(setting, setting)
    return SettingsError(
        "invalid_setting",
        f"Prefect block {block!r} ({label}): {message}",
        block=block,
        setting=setting,
        reason=reason,
    )


def check_block_name(name: str, setting: str, *, default_type: str | None = None) -> str:
    """``name`` as ``<type slug>/<name>`` (``default_type`` prefixes a bare name), or ``invalid_name``."""
    ref = name.strip()
    if default_type is not None and "/" not in ref and ref:
        ref = f"{default_type}/{ref}"
    if not _NAME.match(ref):
        example = f"{default_type or 's3-bucket'}/team-cache"
        raise block_error(
            "invalid_name",
            name,
            setting,
            f"a block is named '<block type slug>/<block name>', e.g. {example!r} (see `prefect block ls`)",
        )
    return ref


def _load(ref: str, setting: str) -> Any:
    """The saved block ``ref`` from the Prefect API of the current settings, or a typed refusal."""
    import httpx
    from prefect.blocks.core import Block, UnknownBlockType
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import get_current_settings
    from pydantic import ValidationError

    slug, doc = ref.split("/", 1)
    api = get_current_settings().api.url or "Prefect's ephemeral local server (PREFECT_API_URL is not set)"
    try:
        # _sync: a plain call even from inside an async flow run (the loader must never hand back a coroutine).
        return Block.load(ref, _sync=True)  # type: ignore[call-arg]
    except UnknownBlockType as exc:
        raise block_error(
            "unknown_type",
            ref,
            setting,
            f"no Python class for the block type {slug!r} is installed here ({exc}); install the package that"
            " defines it (`pip install prefect-aws` for s3-bucket) in this environment",
        ) from None
    except httpx.HTTPError as exc:
        raise block_error(
            "unreachable",
            ref,
            setting,
            f"the Prefect API at {api} did not serve the block ({_http_reason(exc)}); start or reach the"
            " server (check PREFECT_API_URL / PREFECT_API_KEY) and try again — smthrs never falls back to the"
            " local store",
        ) from None
    except ValidationError as exc:
        # Before ValueError (its base): the text would echo the stored values, secrets included.
        raise block_error(
            "invalid_block",
            ref,
            setting,
            f"the stored block does not validate{_validation_fields(exc)}; save it again with the installed"
            " version of its package",
        ) from None
    except ValueError as exc:
        if isinstance(exc.__cause__, ObjectNotFound) or str(exc).startswith("Unable to find block document"):
            raise block_error(
                "not_found",
                ref,
                setting,
                f"no block {doc!r} of type {slug!r} on the Prefect API at {api}; save it first (e.g."
                f" `{_EXAMPLE_CLASS.get(slug, 'TheBlockClass')}(...).save({doc!r})`), check the type and name with"
                f" `prefect block ls`, or unset {setting}",
            ) from None
        raise
    except RuntimeError as exc:
        text = str(exc)
        if "due to failed validation" in text:
            raise block_error(
                "invalid_block",
                ref,
                setting,
                f"the stored block no longer validates against its class{_validation_fields(exc)}; save it"
                " again with the installed version of its package",
            ) from None
        if text.startswith("Timed out while attempting to connect to ephemeral Prefect API server"):
            raise block_error(
                "unreachable",
                ref,
                setting,
                "Prefect's ephemeral API server did not start in time; point PREFECT_API_URL at a running"
                " server (or raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS) and try again — smthrs"
                " never falls back to the local store",
            ) from None
        raise


def _http_reason(exc: Exception) -> str:
    # Status and exception type only: a response body or URL query could echo anything.
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return f"HTTP {status}" if status is not None else type(exc).__name__


def _validation_fields(exc: BaseException) -> str:
    # Field locations and pydantic's short messages only: a ValidationError's text would echo the input values.
    from pydantic import ValidationError

    cause = exc if isinstance(exc, ValidationError) else exc.__cause__
    if not isinstance(cause, ValidationError):
        return ""
    parts = [
        f"{'.'.join(str(p) for p in e['loc']) or '<block>'}: {e['msg']}"
        for e in cause.errors(include_url=False, include_input=False, include_context=False)
    ]
    return f" ({'; '.join(parts[:5])})" if parts else ""


def artifacts_from_block(name: str, *, setting: str = ARTIFACTS_BLOCK_SETTING) -> ArtifactLocation:
    """The artifact store a saved block describes: ``s3-bucket`` (``prefect_aws.S3Bucket``: bucket, folder, and its
    ``AwsCredentials``/``MinIOCredentials`` incl. region and ``aws_client_parameters``) → ``s3://bucket/folder`` +
    s3fs options; ``remote-file-system`` (``prefect.filesystems.RemoteFileSystem``) → its basepath + settings.
    An ``S3Bucket`` whose credentials are empty uses the ambient AWS credential chain (environment, profile, instance
    role), as boto3 would. Every failure is a typed refusal (module docstring)."""
    ref = check_block_name(name, setting)
    block = _load(ref, setting)
    slug = type(block).get_block_type_slug()
    if slug == "s3-bucket":
        return ArtifactLocation(*_s3_bucket(block, ref, setting), block=ref)
    if slug == "remote-file-system":
        basepath = str(block.basepath).rstrip("/")
        if not basepath:
            raise block_error("invalid_block", ref, setting, "the RemoteFileSystem block has no basepath")
        return ArtifactLocation(basepath, dict(block.settings or {}), block=ref)
    raise block_error(
        "wrong_type",
        ref,
        setting,
        f"a {type(block).__name__} block ({slug!r}) cannot hold artifacts; name a block of type"
        f" {' or '.join(SUPPORTED_ARTIFACT_BLOCKS)}",
    )


def _secret_text(value: Any) -> str | None:
    if value is None:
        return None
    get = getattr(value, "get_secret_value", None)
    return str(get()) if get is not None else str(value)


def _s3_bucket(block: Any, ref: str, setting: str) -> tuple[str, dict[str, Any]]:
    """``S3Bucket`` → (``s3://bucket[/folder]``, s3fs storage options)."""
    bucket = str(block.bucket_name).strip().strip("/")
    if not bucket:
        raise block_error("invalid_block", ref, setting, "the S3Bucket block has an empty bucket_name")
    folder = str(block.bucket_folder or "").strip("/")
    url = f"s3://{bucket}/{folder}" if folder else f"s3://{bucket}"
    creds = block.credentials
    kind = type(creds).__name__
    options: dict[str, Any] = {}
    client_kwargs: dict[str, Any] = {}
    if hasattr(creds, "minio_root_user"):  # prefect_aws.MinIOCredentials
        key, secret, token = creds.minio_root_user, _secret_text(creds.minio_root_password), None
    else:  # prefect_aws.AwsCredentials
        if getattr(creds, "assume_role_arn", None):
            raise block_error(
                "unsupported",
                ref,
                setting,
                f"its {kind} assume a role (assume_role_arn), which the s3fs store cannot do from a block; save"
                " credentials of the role itself (or a profile_name whose AWS config assumes it)",
            )
        key, secret = creds.aws_access_key_id, _secret_text(creds.aws_secret_access_key)
        token = creds.aws_session_token
        if creds.profile_name:
            options["profile"] = creds.profile_name
    if bool(key) != bool(secret):
        missing = "secret" if key else "access key id"
        raise block_error(
            "missing_credentials",
            ref,
            setting,
            f"its {kind} have an access key id or a secret but not both (the {missing} is empty); save both, or"
            " neither to use the ambient AWS credential chain",
        )
    if key:
        options["key"], options["secret"] = key, secret
    if token:
        options["token"] = token
    if creds.region_name:
        client_kwargs["region_name"] = creds.region_name
    params = creds.aws_client_parameters
    if params.endpoint_url:
        options["endpoint_url"] = params.endpoint_url
    if params.use_ssl is False:
        options["use_ssl"] = False
    if params.verify_cert_path:
        client_kwargs["verify"] = str(params.verify_cert_path)
    elif params.verify is not None:
        client_kwargs["verify"] = params.verify
    if params.api_version:
        client_kwargs["api_version"] = params.api_version
    config = dict(params.config or {})
    if str(config.get("signature_version", "")).lower() == "unsigned":
        config.pop("signature_version")
        options["anon"] = True  # botocore's UNSIGNED, the way s3fs spells it
    if config:
        options["config_kwargs"] = config
    if client_kwargs:
        options["client_kwargs"] = client_kwargs
    return url, options


def secret_from_block(name: str, *, setting: str = SIGNING_KEY_BLOCK_SETTING) -> bytes:
    """The value of the ``Secret`` block ``name`` (``secret/<name>`` or a bare ``<name>``) as UTF-8 bytes, exactly as
    saved (not JSON-decoded); a typed refusal for any other block type or an empty value."""
    ref = check_block_name(name, setting, default_type="secret")
    block = _load(ref, setting)
    slug = type(block).get_block_type_slug()
    if slug != "secret":
        raise block_error(
            "wrong_type",
            ref,
            setting,
            f"a {type(block).__name__} block ({slug!r}) is not a Secret; save the value as a prefect Secret block"
            " (`Secret(value=...).save(name)`)",
        )
    value = _secret_text(block.value)
    if not value or not value.strip():
        raise block_error("missing_credentials", ref, setting, "the Secret block's value is empty")
    return value.encode("utf-8")
