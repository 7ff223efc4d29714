"""Fixtures of the observation suites: a migrated database on each backend (via the root ``db_url`` fixture), a
manual clock (so creation times, and therefore catalog order and ties, are chosen by the test), and the engine
stores that write what the observation APIs read."""

from __future__ import annotations

import pytest

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.stores.database import Database


@pytest.fixture
def runs(db: Database, journal: Journal, clock: ManualClock) -> RunStore:
    return RunStore(db, journal=journal, clock=clock)
