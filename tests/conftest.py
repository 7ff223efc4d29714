"""Shared fixtures: real backends, started once per session.

- ``db_url`` — parametrized over SQLite (fresh file per test) and PostgreSQL (fresh database per test on the
  cluster ``.ci/run`` starts; skipped with a visible reason when ``SMTHRS_TEST_POSTGRES_URL`` is unset).
- ``s3_endpoint`` / ``s3_bucket`` — moto's real S3 HTTP server on 127.0.0.1 (one per session), a fresh bucket per
  test.
- ``artifacts_url`` — parametrized over ``file://``, ``memory://`` and ``s3://``.
- ``db`` (an opened ``db_url``), ``clock`` (a ``ManualClock``) and ``journal`` over them.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.settings import Settings, load_settings
from smthrs_plugin.stores.database import Database, open_database

# One temporary directory for the whole session and every process it starts (TMPDIR is inherited), removed at
# exit: a SIGKILLed child (the crash tests kill owners mid-node on purpose) cannot remove its own sandbox, and a
# test run must leave the machine as it found it.
_SESSION_TMP = tempfile.mkdtemp(prefix="smthrs-tests-")
os.environ["TMPDIR"] = _SESSION_TMP
tempfile.tempdir = None  # forget the cached default so this process uses it too
atexit.register(shutil.rmtree, _SESSION_TMP, True)

# Prefect must never write to ~/.prefect, nor chatter on stderr. Under pytest-xdist every worker is a
# session of its own (its own Prefect server, moto server and temporary tree): it gets its own client home too, so
# two workers never write one profile or memo file at once.
if "PREFECT_HOME" not in os.environ or os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="smthrs-prefect-home-")
for _k, _v in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL",
    "PREFECT_LOGGING_ROOT_LEVEL": "CRITICAL",
    # A first ephemeral-server start on a busy 2-core machine takes longer than Prefect's 20 s; the
    # library's own default (prefect/environment.py), set here too for subprocesses that import Prefect directly.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}.items():
    os.environ.setdefault(_k, _v)

# One Hypothesis profile for every property test: examples come from a seed derived from the test itself
# (derandomize), never from a shared database, the wall clock or what other threads did to global state, so a
# failure replays identically; no per-example deadline or speed health check can fail on a busy machine. A test
# that needs another seed says so with @seed.
hypothesis_settings.register_profile(
    "smthrs",
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
hypothesis_settings.load_profile("smthrs")

POSTGRES_URL = os.environ.get("SMTHRS_TEST_POSTGRES_URL")

# Longest files first (tests/file_weights.txt, written by tools/test_weights.py from a make test report). Under
# --dist loadfile a file runs on one worker; handed out in collection order, the longest start first and the end
# of the run is short files on both workers instead of one long file alone. pytest-xdist's own reordering (by test
# count, which puts a four-test, five-minute file last) is switched off so this order is the one used.
_WEIGHTS = Path(__file__).with_name("file_weights.txt")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    weights: dict[str, float] = {}
    for line in _WEIGHTS.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            seconds, rel = line.split(" ", 1)
            weights[rel] = float(seconds)
    root = config.rootpath
    # sort is stable: a file's tests keep their order, and unlisted files keep theirs after the listed ones
    items.sort(key=lambda item: -weights.get(item.path.relative_to(root).as_posix(), 0.0))



def _fresh_postgres_database(base_url: str) -> tuple[str, str]:
    import sqlalchemy as sa

    name = "t_" + uuid.uuid4().hex[:16]
    admin = sa.create_engine(base_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    admin.dispose()
    return base_url.rsplit("/", 1)[0] + "/" + name, name


def _drop_postgres_database(base_url: str, name: str) -> None:
    import sqlalchemy as sa

    admin = sa.create_engine(base_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{(tmp_path / 'state.db').as_posix()}"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    if not POSTGRES_URL:
        pytest.skip(
            "PostgreSQL not configured: set SMTHRS_TEST_POSTGRES_URL (.ci/run starts a private cluster)"
        )
    url, name = _fresh_postgres_database(POSTGRES_URL)
    yield url
    _drop_postgres_database(POSTGRES_URL, name)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database URL on each SQL backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{(tmp_path / 'state.db').as_posix()}"
        return
    if not POSTGRES_URL:
        pytest.skip(
            "PostgreSQL not configured: set SMTHRS_TEST_POSTGRES_URL (.ci/run starts a private cluster)"
        )
    url, name = _fresh_postgres_database(POSTGRES_URL)
    yield url
    _drop_postgres_database(POSTGRES_URL, name)


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    """A migrated, empty database on each SQL backend (closed after the test)."""
    database = open_database(db_url)
    yield database
    database.close()


@pytest.fixture
def clock() -> ManualClock:
    """A manual clock, so tests choose time instead of sleeping."""
    return ManualClock()


@pytest.fixture
def journal(db: Database, clock: ManualClock) -> Journal:
    return Journal(db, clock=clock)


@pytest.fixture
def runs(db: Database, journal: Journal, clock: ManualClock) -> RunStore:
    return RunStore(db, journal=journal, clock=clock)


@pytest.fixture
def settings() -> Settings:
    """The ownership constants, pinned so a developer's ``SMTHRS_*`` environment cannot change the tests."""
    return load_settings(
        stale_after_s=30.0, skew_allowance_s=10.0, heartbeat_interval_s=1.0, host_id="host-a"
    )


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1, one per test session."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    yield url
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh bucket name on the moto server."""
    import s3fs

    name = "smthrs-" + uuid.uuid4().hex[:12]
    fs = s3fs.S3FileSystem(
        key="testing", secret="testing", endpoint_url=s3_endpoint, skip_instance_cache=True
    )
    fs.mkdir(name)
    return name


@pytest.fixture
def s3_options(s3_endpoint: str) -> dict[str, str]:
    return {"key": "testing", "secret": "testing", "endpoint_url": s3_endpoint}


@pytest.fixture(params=["file", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def artifacts_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, str]]:
    """(fsspec URL, storage options) of a fresh artifact root on each backend."""
    if request.param == "file":
        return (tmp_path / "artifacts").as_uri(), {}
    if request.param == "memory":
        return f"memory://smthrs-{uuid.uuid4().hex[:12]}", {}
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/artifacts", request.getfixturevalue("s3_options")


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[Path]:
    """An 8 MB tmpfs for faults of a full or read-only disk (skipped where mounting is refused: not root, no
    CAP_SYS_ADMIN)."""
    import subprocess

    vol = tmp_path / "vol"
    vol.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(vol)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs was refused: {done.stderr.strip()}")
    try:
        yield vol
    finally:
        subprocess.run(["umount", str(vol)], check=True)


def _fill(path: Path) -> None:
    chunk = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:  # unbuffered: nothing left to flush at close
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass  # full: the point of the exercise
    os.sync()


@pytest.fixture
def fill_volume() -> Callable[[Path], None]:
    """``fill_volume(path)``: write zeros to ``path`` until its volume refuses (ENOSPC)."""
    return _fill
