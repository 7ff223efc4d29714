"""Fixtures of the cache suites: a shared-tier store on every artifact backend, and a machine factory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _cache_support import Machine, make_machine

from smthrs_plugin.stores.artifacts import ArtifactStore


@pytest.fixture
def shared(artifacts_url: tuple[str, dict[str, Any]]) -> ArtifactStore:
    """The shared tier's store, on file://, memory:// and s3:// (moto)."""
    url, options = artifacts_url
    return ArtifactStore(url, options)


@pytest.fixture
def machines(tmp_path: Path, shared: ArtifactStore) -> Callable[..., Machine]:
    """``machines("a", files={...})`` → a fresh machine sharing ``shared`` with every other one of this test."""

    def make(name: str, **kw: Any) -> Machine:
        return make_machine(tmp_path, name, shared, **kw)

    return make
