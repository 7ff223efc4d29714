"""The review page in headless chromium against the real ``smthrs serve``: what changed since the last approved card
as old → new values (a node re-keyed by an upstream change says so), gates and envelopes as readable text, the
decision history (who, when, scope, digest, receipt) with the next step once a card or request is decided, and a
decision made with the CLI pushed to the open page through its WebSocket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _browser import (
    DEADLINE_S,
    chrome,
    needs_chromium,
    rpc,
    screenshot,
    script_errors,
    serve,
    smthrs,
    wait_for,
)

import smthrs_plugin as sp
from smthrs_plugin.cli.control_support import PlanLauncher
from smthrs_plugin.control.receipts import Accepted
from smthrs_plugin.plan import Plan, compile_plan, node

ENV = {"capabilities": ["deploy:prod"]}
FLOW_RUN = "6f1c2d3e-4b5a-4c6d-8e9f-0a1b2c3d4e5f"

pytestmark = [needs_chromium(), pytest.mark.slow]


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.txt").write_text("release 1.4.0\n")
    return root


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    driver = chrome(tmp_path / "chromium-profile")
    driver.set_script_timeout(DEADLINE_S)
    try:
        yield driver
    finally:
        driver.quit()


def pipeline(build: str = "mkdir -p dist && cp src/app.txt dist/app.txt") -> Plan:
    return compile_plan(
        "release",
        "ci/release",
        [
            node("build", body={"run": build}, reads=["src/app.txt"], writes=["dist/"]),
            node("test", body={"run": "grep -q release dist/app.txt"}, reads=["dist/app.txt"],
                 inputs=[sp.plan.Pending("build")]),
            node("deploy", body={"run": "mkdir -p deployed && cp dist/app.txt deployed/app.txt"},
                 reads=["dist/app.txt"], writes=["deployed/"], tier="irreversible",
                 inputs=[sp.plan.Pending("test")], approval={"request": "ship", "envelope": ENV}),
        ],
    )  # fmt: skip


def js(driver: Any, script: str, *args: Any) -> Any:
    return driver.execute_script(script, *args)


def text_of(driver: Any, selector: str) -> str:
    return str(
        js(driver, "const e = document.querySelector(arguments[0]); return e ? e.textContent : ''", selector)
    )


def attr_of(driver: Any, selector: str, name: str) -> str:
    return str(
        js(
            driver,
            "const e = document.querySelector(arguments[0]); return e ? (e.getAttribute(arguments[1]) || '') : ''",
            selector,
            name,
        )
    )


def page_has(driver: Any, selector: str) -> bool:
    return bool(js(driver, "return document.querySelector(arguments[0]) !== null", selector))


def use_token(driver: Any, token: str) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "token-input").send_keys(token)
    driver.find_element(By.ID, "token-save").click()
    wait_for(lambda: "token set" in text_of(driver, "#token-state"), "the page to keep the token")


def test_a_changed_build_shows_old_and_new_values_and_its_dependents_as_rekeyed_because_build_changed(
    ws: Path, browser: Any, tmp_path: Path
) -> None:
    with sp.open_runtime(workspace=ws) as rt:
        control = rt.control()
        first = control.plan(pipeline(), envelope=ENV, approval=True)
        control.approve(first.approval)
        second = control.plan(pipeline(build="make dist"), envelope=ENV, approval=True)
    with serve(ws, tmp_path / "serve.log") as server:
        browser.get(server.url)
        sel = f".card.plan[data-plan-id='{second.plan_id}']"
        wait_for(lambda: page_has(browser, sel + " .changes li.change"), "the changes of the new card")
        build = text_of(browser, sel + " .changes li.change[data-node='build']")
        assert build.startswith("changed") and "run" in build
        assert (
            text_of(browser, sel + " li[data-node='build'] del.old")
            == "mkdir -p dist && cp src/app.txt dist/app.txt"
        )
        assert text_of(browser, sel + " li[data-node='build'] ins.new") == "make dist"
        for rekeyed in ("test", "deploy"):
            line = text_of(browser, sel + f" .changes li.change[data-node='{rekeyed}']")
            assert "re-keyed because build changed" in line, line
            assert "key1_" not in line  # the cause is named; the key itself is not the news
        assert "approved by local/operator" in text_of(browser, sel + " .changes-title")
        classes = js(
            browser,
            "return Object.fromEntries([...document.querySelectorAll(arguments[0] + ' svg.dag g.node')]"
            ".map(g => [g.dataset.node, g.getAttribute('class')]))",
            sel,
        )
        assert (
            "changed" in classes["build"] and "rekeyed" in classes["test"] and "rekeyed" in classes["deploy"]
        )
        # Gates and envelopes as text: who may decide, what a yes grants; no raw JSON.
        assert "local/operator (scopes once, remembered, run)" in text_of(browser, sel + " .approvers")
        gate = js(
            browser,
            "return [...document.querySelectorAll(arguments[0] + ' table.nodes tbody tr')]"
            ".map(tr => tr.lastElementChild.textContent)",
            sel,
        )
        assert gate[2] == "asks approval \u201cship\u201d \u2014 grants capabilities: deploy:prod"
        assert "{" not in text_of(browser, sel + " table.nodes") and "{" not in text_of(
            browser, sel + " .envelope"
        )
        assert script_errors(browser) == []
        screenshot(browser, ws, "review-diffs.png")


def test_a_plan_approved_in_the_page_moves_to_the_history_with_who_scope_digest_receipt_and_the_retry_command(
    ws: Path, browser: Any, tmp_path: Path
) -> None:
    with sp.open_runtime(workspace=ws) as rt:
        card = rt.control().plan(pipeline(), envelope=ENV, approval=True)
    with serve(ws, tmp_path / "serve.log") as server:
        browser.get(server.url)
        wait_for(lambda: page_has(browser, ".card.plan button.approve"), "the pending card")
        use_token(browser, server.token)
        browser.find_element("css selector", ".card.plan button.approve").click()
        entry = f".history-entry[data-ident='{card.plan_id}']"
        wait_for(lambda: page_has(browser, entry + " .next-command"), "the decided card in the history")
        assert not page_has(browser, ".card.plan")
        assert attr_of(browser, entry, "data-source") == "page"
        assert text_of(browser, entry + " .state") == "approved"
        assert text_of(browser, entry + " .h-principal") == "local/operator"
        assert text_of(browser, entry + " .h-scope") == "run"
        assert text_of(browser, entry + " .h-digest") == card.digest
        assert text_of(browser, entry + " .h-at") != ""
        status, body = rpc(server.url, "review.history", {"ident": card.plan_id})
        assert status == 200, body
        receipt = body["result"]["decision"]["receipt"]
        assert receipt.startswith("rcpt_") and text_of(browser, entry + " .h-receipt") == receipt
        assert text_of(browser, entry + " .next-command") == f"smthrs run {card.plan_id} --key KEY"
        assert script_errors(browser) == []
        screenshot(browser, ws, "review-history.png")


def test_a_cli_decision_is_pushed_to_the_open_page_and_its_history_says_who_decided(
    ws: Path, browser: Any, tmp_path: Path
) -> None:
    with sp.open_runtime(workspace=ws) as rt:
        card = rt.control().plan(pipeline(), envelope=ENV, approval=True)
    with serve(ws, tmp_path / "serve.log") as server:
        browser.get(server.url)
        sel = f".card.plan[data-plan-id='{card.plan_id}']"
        # The card's decision stream is open: from now on only that stream may settle it (the poll leaves it).
        wait_for(lambda: attr_of(browser, sel, "data-live") == "1", "the card's live decision stream")
        decided = smthrs(ws, "approve", card.plan_id, "--scope", "once")
        assert decided.returncode == 0, decided.stderr
        entry = f".history-entry[data-ident='{card.plan_id}']"
        wait_for(lambda: page_has(browser, entry + " .next-command"), "the CLI's decision on the open page")
        assert attr_of(browser, entry, "data-source") == "live"
        assert not page_has(browser, sel)
        assert text_of(browser, entry + " .h-principal") == "local/operator"
        assert text_of(browser, entry + " .h-scope") == "once"
        assert "Decided elsewhere: plan " + card.plan_id + " approved by local/operator" in text_of(
            browser, "#flash"
        )
        assert script_errors(browser) == []


def test_a_request_decided_with_the_cli_shows_woken_and_links_the_prefect_flow_run(
    ws: Path, browser: Any, tmp_path: Path
) -> None:
    with sp.open_runtime(workspace=ws) as rt:
        control = rt.control()
        card = control.plan(pipeline(), envelope=ENV, approval=True)
        control.approve(card.approval)
        receipt = control.run(card, idempotency_key="ci-key", launcher=PlanLauncher(rt, {}))
        assert isinstance(receipt, Accepted) and receipt.run_id is not None
        run_id = receipt.run_id
        # What the Prefect integration journals when a deployment's flow run binds the run.
        rt.journal.append(
            run_id, "prefect-flow-run", {"flow_run_id": FLOW_RUN, "flow": "ci/release", "parameters": {},
                                         "deployment_id": "dep-1"},
        )  # fmt: skip
    with serve(ws, tmp_path / "serve.log", PREFECT_UI_URL="http://127.0.0.1:4200") as server:
        browser.get(server.url)
        sel = f".card.request[data-run-id='{run_id}']"
        wait_for(lambda: attr_of(browser, sel, "data-live") == "1", "the request's live decision stream")
        decided = smthrs(ws, "approve", run_id, "--request", "ship")
        assert decided.returncode == 0, decided.stderr
        entry = f".history-entry[data-ident='{run_id}']"
        wait_for(lambda: page_has(browser, entry + " .next .woken"), "the woken request in the history")
        assert attr_of(browser, entry, "data-source") == "live"
        assert text_of(browser, entry + " .h-request") == "ship"
        assert text_of(browser, entry + " .h-principal") == "local/operator"
        assert f"Prefect runs flow run {FLOW_RUN} of deployment dep-1 again" in text_of(
            browser, entry + " .next"
        )
        assert (
            attr_of(browser, entry + " a.prefect-link", "href")
            == f"http://127.0.0.1:4200/runs/flow-run/{FLOW_RUN}"
        )
        assert script_errors(browser) == []
        screenshot(browser, ws, "review-woken.png")
