"""Helpers shared by the store test modules (plain functions, not fixtures)."""

from __future__ import annotations

from typing import Any

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.engine.ownership.arbiter import Ownership
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import OwnerId
from smthrs_plugin.settings import Settings
from smthrs_plugin.stores.database import Database


def owner(tag: str, host: str = "host-a", pid: int = 4242) -> OwnerId:
    return OwnerId(host, pid, f"nonce-{tag}")


def ownership(
    db: Database, journal: Journal, clock: ManualClock, settings: Settings, tag: str, **kw: Any
) -> Ownership:
    return Ownership(db, owner=owner(tag), journal=journal, clock=clock, settings=settings, **kw)
