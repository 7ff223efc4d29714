"""smthrs_plugin — durable execution for Prefect.

A content-addressed step cache keyed on the bytes of declared inputs, step boundaries, fenced ownership,
approval gates and durable waits, with artifacts stored through fsspec (local disk and S3 alike).
"""

from __future__ import annotations

from .canonical import canonical_bytes, key, key_digest
from .errors import (
    ArtifactError,
    BoundaryError,
    BoundaryRefusal,
    CacheError,
    CanonicalError,
    ControlError,
    FenceLost,
    InvalidInput,
    PlanError,
    ReplayError,
    RunParentCycleError,
    SchedulerError,
    SettingsError,
    SmthrsError,
    StoreError,
)
from .settings import Settings, load_settings

__version__ = "0.1.0"

# Each section below is owned by one subpackage; edit only your own section.
# --- plan exports ---
# --- end plan exports ---
# --- store exports ---
# --- end store exports ---
# --- boundary/cache exports ---
# --- end boundary/cache exports ---
