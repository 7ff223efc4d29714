"""One wiring point: ``open_runtime`` is the only place that constructs run drivers, the cache
dispatch seam, the control plane and the cache tiers; the CLI, the hosts and ``smthrs serve`` take them from a
runtime, so they all share its owner, journal, waits, liveness check, metrics and publisher trust."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import smthrs_plugin as sp
from smthrs_plugin.engine.drive.driver import RunDriver

PACKAGE = Path(sp.__file__).resolve().parent
RUNTIME = PACKAGE / "runtime.py"

#: Constructed nowhere in the package but the composition root.
WIRED_EVERYWHERE = {
    "RunDriver": "a run driver: take Runtime.driver or Runtime.run_driver(...)",
    "CacheDispatcher": "the cache dispatch seam: take Runtime.dispatcher (runtime.process_dispatcher in a worker)",
    "Control": "the control plane: take Runtime.control()",
}
#: Constructed nowhere in the top layer (cli/, prefect/, serve/): the runtime hands these out.
WIRED_ON_TOP = {
    "LocalTier": "a cache tier: take Runtime.cache_tiers(...)",
    "SharedTier": "a cache tier: take Runtime.cache_tiers(...)",
    "ArtifactStore": "an artifact store: take Runtime.artifacts or Runtime.cache_tiers(shared)",
    "trust_from_settings": "the publisher trust: take Runtime.trust",
    "PlanScheduler": "a plan scheduler: take Runtime.scheduler(run_id)",
    "open_database": "a database: take Runtime.db",
}
TOP_LAYER = ("cli", "prefect", "serve")
#: Commands that only read or fence ONE database named by --db (no workspace): a runtime would create a workspace
#: and a signing key in the current directory as a side effect of reading.
DATABASE_ONLY = {"cli/_runs.py", "cli/_watch.py", "cli/_recover.py"}
#: ``smthrs doctor`` checks the stores a runtime would open without opening one (a runtime would create the database
#: and a workspace key), and gives its S3 client timeouts of its own: it opens them itself.
DIAGNOSTIC = {"cli/_doctor.py": {"open_database", "ArtifactStore"}}
#: The Prefect run waker settles a parked run whose deployment flow run Prefect already cancelled. It is called with
#: the deciding plane's journal only, and records the cancellation on that same journal through a plane with no
#: waker (nothing is left to wake); cancelling a parked run claims nothing, so no owner or liveness check is involved.
HOST_SETTLES = {("prefect/plugin.py", "Control")}


def _constructions(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                aliases[a.asname or a.name] = a.name
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name is not None:
            out.append((node.lineno, aliases.get(name, name)))
    return out


def test_only_the_runtime_constructs_drivers_dispatchers_the_control_plane_and_cache_tiers() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == RUNTIME:
            continue
        rel = path.relative_to(PACKAGE).as_posix()
        on_top = rel.split("/", 1)[0] in TOP_LAYER
        for line, name in _constructions(path):
            why = None if (rel, name) in HOST_SETTLES else WIRED_EVERYWHERE.get(name)
            exempt = (name == "open_database" and rel in DATABASE_ONLY) or name in DIAGNOSTIC.get(rel, ())
            if why is None and on_top and not exempt:
                why = WIRED_ON_TOP.get(name)
            if why is not None:
                offenders.append(f"smthrs_plugin/{rel}:{line} constructs {name}(...) — {why}")
    assert offenders == [], "\n".join(offenders)


def test_a_runtime_hands_out_its_driver_dispatcher_control_plane_and_tiers_wired_with_its_own_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("SMTHRS_CACHE_SIGNING_KEY", "SMTHRS_CACHE_TRUSTED_KEYS"):
        monkeypatch.delenv(var, raising=False)  # the workspace's own key: a tier outside it is warned about
    with sp.open_runtime(workspace=tmp_path / "ws") as rt:
        assert rt.dispatcher is rt.dispatcher and rt.measurer is rt.dispatcher.measurer
        assert rt.dispatcher.trust is rt.trust and rt.dispatcher.journal is rt.journal
        driver = rt.driver
        assert isinstance(driver, RunDriver) and rt.driver is driver
        assert (driver.owner, driver.journal, driver.waits) == (rt.owner, rt.journal, rt.waits)
        assert driver.ownership.liveness is rt.ownership.liveness and driver.metrics is rt.metrics
        own = rt.run_driver(wait_budget_s=0.5, max_runs=2)
        assert own is not driver and (own.owner, own.budget_s, own.max_runs) == (rt.owner, 0.5, 2)
        control = rt.control()
        assert rt.control() is control and (control.owner, control.journal) == (rt.owner, rt.journal)
        tiers = rt.cache_tiers()
        assert tiers.local.db is rt.db and tiers.artifacts is rt.artifacts and tiers.shared.trust is None
        assert rt.cache_tiers(trusted=True).shared.trust is rt.trust
        other = rt.cache_tiers((tmp_path / "team").as_uri(), trusted=True)
        assert other.shared.store.url == (tmp_path / "team").as_uri() and other.warning is not None
