"""Fixtures of the control-plane suites: a migrated database on each backend (the root ``db_url`` fixture), the
control plane over it, a recording launcher, and small plans. Real parts only: SQLite files, PostgreSQL databases,
the real runtime and scheduler for plan runs, real processes for the CLI and crash tests."""

from __future__ import annotations

import pytest
from _control_support import RecordingLauncher

from smthrs_plugin.control.facade import Control
from smthrs_plugin.settings import Settings, load_settings
from smthrs_plugin.stores.database import Database


@pytest.fixture
def settings() -> Settings:
    # Pinned so a developer's SMTHRS_* environment cannot change the tests.
    return load_settings(
        stale_after_s=30.0, skew_allowance_s=10.0, heartbeat_interval_s=0.05, host_id="ctl-host"
    )


@pytest.fixture
def control(db: Database, settings: Settings) -> Control:
    return Control(db, settings=settings)


@pytest.fixture
def launcher() -> RecordingLauncher:
    return RecordingLauncher()
