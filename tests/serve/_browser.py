"""Helpers of the review page's browser tests (imported by name: pytest puts this directory on sys.path): the real
``smthrs serve`` process, Debian's chromium driven through its chromedriver, polling waits with deadlines, and the
screenshot kept as a CI artifact."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
REPO = Path(__file__).resolve().parents[2]
SMTHRS = str(Path(sys.executable).parent / "smthrs")
#: Every wait: far above anything a step takes on a busy 2-core machine; tests poll for a state, never time it.
DEADLINE_S = 120.0

_LISTENING = re.compile(r"^smthrs serve: listening on (http://\S+/)\s*$", re.M)
_TOKEN = re.compile(r"^smthrs serve: approval token: (\S+)\s*$", re.M)

T = TypeVar("T")


def needs_chromium() -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not CHROMIUM.exists() or not CHROMEDRIVER.exists(),
        reason="Debian's chromium + chromium-driver are not installed (/usr/bin/chromium, /usr/bin/chromedriver); "
        ".ci/run installs them with apt-get",
    )


def wait_for(cond: Callable[[], T], what: str, timeout: float = DEADLINE_S, interval: float = 0.1) -> T:
    """Poll ``cond`` until it returns something truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def clean_env(workspace: Path, **extra: str) -> dict[str, str]:
    """The environment of a child process: ours without any SMTHRS_* setting, bound to ``workspace``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMTHRS_")}
    env["SMTHRS_WORKSPACE"] = str(workspace)
    env.update(extra)
    return env


@dataclass
class Server:
    url: str
    token: str
    proc: subprocess.Popen[bytes]
    log: Path


def parse_serve_log(text: str) -> tuple[str | None, str | None]:
    """``(url, token)`` from the stderr lines ``smthrs serve`` prints at start (None while not printed yet)."""
    url = _LISTENING.search(text)
    token = _TOKEN.search(text)
    return (url.group(1) if url else None, token.group(1) if token else None)


@contextmanager
def serve(workspace: Path, log: Path, port: int = 0, **env: str) -> Iterator[Server]:
    """The real ``smthrs serve`` on ``workspace`` (loopback; ``port`` 0: a free one; ``env``: extra environment),
    stopped (its pid only) on exit."""
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [SMTHRS, "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=workspace,
            env=clean_env(workspace, **env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:

        def started() -> tuple[str, str] | None:
            if proc.poll() is not None:
                raise AssertionError(
                    f"smthrs serve exited {proc.returncode}: {log.read_text(errors='replace')}"
                )
            url, token = parse_serve_log(log.read_text(errors="replace"))
            return (url, token) if url and token else None

        url, token = wait_for(started, "smthrs serve to print its address and token")
        yield Server(url, token, proc, log)
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=DEADLINE_S)


def rpc(
    url: str, method: str, params: dict[str, Any] | None = None, token: str | None = None
) -> tuple[int, Any]:
    """``(HTTP status, decoded body)`` of one JSON-RPC call."""
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params or {}}).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url.rstrip("/") + "/rpc", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE_S) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw or b"null")
        except ValueError:
            return exc.code, raw.decode(errors="replace")


def chrome(profile: Path) -> Any:
    """Headless Debian chromium through its chromedriver, a fresh profile, nothing downloaded: the driver path is
    given (Selenium Manager is skipped) and chromium's background networking is off (this network is closed)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    profile.mkdir(parents=True, exist_ok=True)
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


def screenshot(driver: Any, workspace: Path, name: str) -> Path:
    """A full-page PNG under ``<workspace>/.smthrs/screenshots/`` and its copy under
    ``<repo>/.smthrs/ci-artifacts/`` (the CI artifact)."""
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 8000), "scale": 1},
        },
    )
    shots = workspace / ".smthrs" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    path = shots / name
    path.write_bytes(base64.b64decode(shot["data"]))
    artifacts = REPO / ".smthrs" / "ci-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, artifacts / name)
    return path


def script_errors(driver: Any) -> list[str]:
    """Uncaught exceptions and rejections the page's scripts raised so far (console entries; a refused HTTP call
    the page handles is logged by chromium too, and is not one of these)."""
    return [e["message"] for e in driver.get_log("browser") if "Uncaught" in e["message"]]


def smthrs(workspace: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """One ``smthrs`` CLI command on ``workspace`` (its output captured)."""
    return subprocess.run(
        [SMTHRS, *args],
        cwd=workspace,
        env=clean_env(workspace),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
