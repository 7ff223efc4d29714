"""The review page in a real browser (headless Debian chromium through Selenium) against the real ``smthrs serve``
process, and the CI job ``examples/ci_gate/review_job.sh`` that waits for the person's decisions.

The main test is the issue's story end to end: the CI job plans and parks, a reviewer opens the page, sees the card
(digest, envelope, node graph), is refused without the token, approves with it, approves the deploy request when
the run reaches it, and watches the run settle live while the job's retries carry it to completion (exit 0).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _browser import (
    DEADLINE_S,
    REPO,
    SMTHRS,
    Server,
    chrome,
    clean_env,
    needs_chromium,
    parse_serve_log,
    rpc,
    screenshot,
    script_errors,
    serve,
    stop,
    wait_for,
)

JOB = REPO / "examples" / "ci_gate" / "review_job.sh"


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


@pytest.fixture
def server(ws: Path, tmp_path: Path) -> Iterator[Server]:
    with serve(ws, tmp_path / "serve.log") as s:
        yield s


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    driver = chrome(tmp_path / "chromium-profile")
    driver.set_script_timeout(DEADLINE_S)
    try:
        yield driver
    finally:
        driver.quit()


def start_job(ws: Path, out: Path, **env: str) -> subprocess.Popen[bytes]:
    with out.open("wb") as sink:
        return subprocess.Popen(
            ["bash", str(JOB)],
            env=clean_env(ws, SMTHRS=SMTHRS, CI_GATE_WORKSPACE=str(ws), REVIEW_POLL_S="0.5", **env),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )


def job_output(out: Path) -> str:
    return out.read_text(errors="replace")


def pending(server: Server) -> dict[str, Any]:
    status, body = rpc(server.url, "review.pending")
    assert status == 200 and "result" in body, body
    return body["result"]  # type: ignore[no-any-return]


def js(driver: Any, script: str, *args: Any) -> Any:
    return driver.execute_script(script, *args)


def text_of(driver: Any, selector: str) -> str:
    return str(
        js(driver, "const e = document.querySelector(arguments[0]); return e ? e.textContent : ''", selector)
    )


def page_has(driver: Any, selector: str) -> bool:
    return bool(js(driver, "return document.querySelector(arguments[0]) !== null", selector))


def click(driver: Any, selector: str) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.CSS_SELECTOR, selector).click()


def use_token(driver: Any, token: str) -> None:
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.ID, "token-input")
    field.clear()
    field.send_keys(token)
    click(driver, "#token-save")
    wait_for(lambda: "token set" in text_of(driver, "#token-state"), "the page to keep the token")


def live_outcome(driver: Any, node: str) -> str:
    return str(
        js(
            driver,
            "const r = [...document.querySelectorAll('#live-outcomes tr')].find(t => t.dataset.node === arguments[0]);"
            " return r ? r.children[1].textContent : ''",
            node,
        )
    )


def run_status(driver: Any, run_id: str) -> str:
    return str(
        js(
            driver,
            "const r = [...document.querySelectorAll('#runs tr')].find(t => t.children[0].textContent === arguments[0]);"
            " return r ? r.children[2].textContent : ''",
            run_id,
        )
    )


@needs_chromium()
@pytest.mark.slow
def test_a_reviewer_approves_the_plan_and_the_deploy_in_the_page_and_the_ci_job_completes(
    ws: Path, server: Server, browser: Any, tmp_path: Path
) -> None:
    out = tmp_path / "job.out"
    job = start_job(ws, out, SMTHRS_SERVE_URL=server.url, REVIEW_DEADLINE_S=str(int(DEADLINE_S * 5)))
    try:
        wait_for(
            lambda: "review and approve at: " + server.url in job_output(out), "the job to print the URL"
        )
        wait_for(lambda: "parked (75): plan" in job_output(out), "the job's run to park on the plan approval")
        [card] = pending(server)["plans"]
        plan_id, digest = card["plan_id"], card["digest"]

        browser.get(server.url)
        card_sel = ".card.plan"
        wait_for(lambda: page_has(browser, card_sel + " svg.dag g.node"), "the pending card and its graph")
        assert text_of(browser, card_sel + " .plan-id") == plan_id
        assert text_of(browser, card_sel + " .digest-value") == digest
        assert text_of(browser, card_sel + " .flow-id") == "ci/release"
        assert "deploy:prod" in text_of(browser, card_sel + " .envelope")
        nodes = js(
            browser,
            "return [...document.querySelectorAll('.card.plan svg.dag g.node')].map(g => g.dataset.node)",
        )
        assert nodes == ["build", "test", "deploy"]
        assert js(browser, "return document.querySelectorAll('.card.plan svg.dag path.edge').length") == 2
        graph = text_of(browser, card_sel + " svg.dag")
        assert "$ mkdir -p dist && cp src/app.txt" in graph and "irreversible" in graph
        assert "approval: ship" in graph
        table = text_of(browser, card_sel + " table.nodes")
        assert "mkdir -p deployed && cp dist/app.txt deployed/app.txt" in table and "deployed/" in table
        assert "Approve and Deny need the approval token" in text_of(browser, card_sel + " .needs-token")
        screenshot(browser, ws, "review-pending.png")

        # Without the token: the server refuses (401), the page says so, nothing is decided.
        click(browser, card_sel + " button.approve")
        wait_for(lambda: "Refused (401)" in text_of(browser, card_sel + " .result"), "the 401 message")
        assert "Nothing was decided" in text_of(browser, "#flash")
        assert [p["plan_id"] for p in pending(server)["plans"]] == [plan_id]

        # A wrong token: 403, still nothing decided.
        use_token(browser, "not-the-token")
        click(browser, card_sel + " button.approve")
        wait_for(lambda: "Refused (403)" in text_of(browser, card_sel + " .result"), "the 403 message")
        assert [p["plan_id"] for p in pending(server)["plans"]] == [plan_id]

        # With the session's token: approved; the card leaves the list.
        use_token(browser, server.token)
        click(browser, card_sel + " button.approve")
        wait_for(lambda: "Approved plan " + plan_id in text_of(browser, "#flash"), "the approval receipt")
        assert pending(server)["plans"] == []
        wait_for(lambda: not page_has(browser, card_sel), "the decided card to leave the page")
        # ... into the history: who decided, with which scope and digest, and the command the CI job re-runs.
        entry = f".history-entry[data-ident='{plan_id}']"
        wait_for(lambda: page_has(browser, entry + " .next-command"), "the plan's history entry")
        assert text_of(browser, entry + " .h-principal") == "local/operator"
        assert text_of(browser, entry + " .h-digest") == digest
        assert text_of(browser, entry + " .next-command") == f"smthrs run {plan_id} --key KEY"

        # The job's next retry launches the run; it parks on the deploy node's request, which the page shows.
        req_sel = ".card.request"
        wait_for(lambda: page_has(browser, req_sel + " svg.dag g.node.focus"), "the deploy request's card")
        assert text_of(browser, req_sel + " .request-id") == "ship"
        assert text_of(browser, req_sel + " .node-id") == "deploy"
        [request] = pending(server)["requests"]
        assert text_of(browser, req_sel + " .run-id") == request["run_id"]
        # The live view follows that run: build and test settled before it parked.
        wait_for(
            lambda: text_of(browser, "#live-run") == request["run_id"], "the live view on the parked run"
        )
        wait_for(lambda: live_outcome(browser, "test") == "built", "test's outcome in the live view")
        assert live_outcome(browser, "build") == "built"

        click(browser, req_sel + " button.approve")
        wait_for(
            lambda: "Approved request ship" in text_of(browser, "#flash"), "the request's approval receipt"
        )

        # The job's retry drives the woken run to its end; the page sees deploy settle and the run complete.
        wait_for(lambda: job.poll() is not None, "the CI job to finish")
        assert job.returncode == 0, job_output(out)
        assert "run completed: " + request["run_id"] + " completed" in job_output(out)
        assert (ws / "deployed" / "app.txt").read_text() == "release 1.4.0\n"
        wait_for(lambda: live_outcome(browser, "deploy") == "built", "deploy's outcome in the live view")
        wait_for(lambda: text_of(browser, "#live-status") == "completed", "the run's status in the live view")
        assert live_outcome(browser, "build") in ("built", "clean")
        assert pending(server) == {"plans": [], "requests": []}
        wait_for(lambda: run_status(browser, request["run_id"]) == "completed", "the runs table to catch up")
        assert script_errors(browser) == []
        shot = screenshot(browser, ws, "review-page.png")
        assert shot.stat().st_size > 0 and (REPO / ".smthrs" / "ci-artifacts" / "review-page.png").exists()
    finally:
        stop(job)


@needs_chromium()
@pytest.mark.slow
def test_hostile_plan_ids_flows_and_commands_render_as_text_and_never_run_script(
    ws: Path, server: Server, browser: Any
) -> None:
    import smthrs_plugin as sp
    from smthrs_plugin.cli.control_support import PlanLauncher
    from smthrs_plugin.control.receipts import Accepted
    from smthrs_plugin.plan import compile_plan, node

    script = "<script>window.__pwned=1</script>"
    img = "<img src=x onerror=window.__pwned=2>"
    with sp.open_runtime(workspace=ws) as rt:
        control = rt.control()
        card = control.plan(
            compile_plan(script, "ci/" + img, [node("<b>n</b>", body={"run": "echo '" + img + "'"})]),
            envelope={"capabilities": ["<svg onload=window.__pwned=3>"]},
            approval=True,
        )
        gated = control.plan(
            compile_plan(
                img,
                "ci/gated",
                [node("x", body={"run": "true"}, approval={"request": "<i>r</i>"})],
            )
        )
        receipt = control.run(gated, idempotency_key="k", launcher=PlanLauncher(rt, {}))
        assert isinstance(receipt, Accepted) and receipt.run_id is not None

    browser.get(server.url)
    wait_for(lambda: page_has(browser, ".card.plan svg.dag g.node"), "the hostile card")
    wait_for(lambda: page_has(browser, ".card.request svg.dag g.node"), "the hostile request")
    assert text_of(browser, ".card.plan .plan-id") == card.plan_id
    assert text_of(browser, ".card.plan .flow-id") == "ci/" + img
    assert "<svg onload=window.__pwned=3>" in text_of(browser, ".card.plan .envelope")
    assert "echo '" + img + "'" in text_of(browser, ".card.plan table.nodes")
    assert text_of(browser, ".card.request .run-id") == receipt.run_id
    assert text_of(browser, ".card.request .request-id") == "<i>r</i>"
    # The live view opened the hostile run's stream (its id URL-encoded) and shows its events as text.
    wait_for(lambda: text_of(browser, "#live-run") == receipt.run_id, "the live view on the hostile run")
    wait_for(lambda: "run-suspended" in text_of(browser, "#live-events"), "the hostile run's events")
    # Two more refreshes of the page, then: no injected element exists and nothing ran.
    first = text_of(browser, "#updated")
    wait_for(lambda: text_of(browser, "#updated") not in ("", first), "a page refresh")
    assert js(browser, "return typeof window.__pwned") == "undefined"
    assert js(browser, "return document.querySelectorAll('img, b, i, main script, main svg svg').length") == 0
    assert js(browser, "return document.scripts.length") == 1
    assert script_errors(browser) == []
    screenshot(browser, ws, "review-hostile.png")


@needs_chromium()
@pytest.mark.slow
def test_the_live_view_resumes_from_its_last_cursor_across_a_server_restart_without_gaps_or_duplicates(
    ws: Path, browser: Any, tmp_path: Path
) -> None:
    import urllib.parse

    import smthrs_plugin as sp
    from smthrs_plugin.cli.control_support import PlanLauncher
    from smthrs_plugin.control.authority import NodeTarget
    from smthrs_plugin.control.receipts import Accepted
    from smthrs_plugin.observe.watch import watch
    from smthrs_plugin.plan import compile_plan, node

    plan = compile_plan(
        "release",
        "ci/release",
        [
            node("build", body={"run": "true"}),
            node(
                "deploy",
                body={"run": "true"},
                inputs=[sp.plan.Pending("build")],
                approval={"request": "ship"},
            ),
        ],
    )
    with sp.open_runtime(workspace=ws) as rt:
        control = rt.control()
        card = control.plan(plan)
        receipt = control.run(card, idempotency_key="k", launcher=PlanLauncher(rt, {}))
        assert isinstance(receipt, Accepted) and receipt.run_id is not None
        run_id = receipt.run_id

        with serve(ws, tmp_path / "serve-1.log") as first:
            port = urllib.parse.urlsplit(first.url).port
            assert port is not None
            browser.get(first.url)
            wait_for(lambda: text_of(browser, "#live-run") == run_id, "the live view on the parked run")
            wait_for(lambda: "run-suspended" in text_of(browser, "#live-events"), "the parked run's events")
            wait_for(lambda: text_of(browser, "#live-conn") == "live", "the stream to be live")
        wait_for(
            lambda: "reconnecting" in text_of(browser, "#live-conn"), "the page to notice the server left"
        )

        # While the page is disconnected the run is approved and driven to its end.
        asked = control.show(run_id).pending[0]
        control.approve(NodeTarget(run_id, "ship", asked.digest, asked.envelope))
        control.resume(run_id, idempotency_key="r", launcher=PlanLauncher(rt, {}))
        assert control.show(run_id).status == "completed"
        with watch(rt.db, run_id, follow=False) as stream:
            journal = [e.sequence for e in stream]

    with serve(ws, tmp_path / "serve-2.log", port=port):
        wait_for(lambda: live_outcome(browser, "deploy") == "built", "deploy's outcome after the reconnect")
        wait_for(
            lambda: text_of(browser, "#live-status") == "completed", "the completed run after the reconnect"
        )
        seen = js(
            browser,
            "return [...document.querySelectorAll('#live-events li')].map(li => Number(li.dataset.seq))",
        )
        assert seen == journal  # every event once, in order: nothing skipped, nothing repeated


@needs_chromium()
@pytest.mark.slow
def test_a_changed_plan_shows_what_changed_since_its_last_approved_card(
    ws: Path, server: Server, browser: Any
) -> None:
    import smthrs_plugin as sp
    from smthrs_plugin.plan import compile_plan, node

    def release(deploy: str, notify: bool) -> Any:
        nodes = [
            node("build", body={"run": "make"}, writes=["dist/"]),
            node("deploy", body={"run": deploy}, inputs=[sp.plan.Pending("build")], tier="irreversible"),
        ]
        if notify:
            nodes.append(
                node("notify", body={"call": "ops.hooks:notify"}, inputs=[sp.plan.Pending("deploy")])
            )
        return compile_plan("release", "ci/release", nodes)

    with sp.open_runtime(workspace=ws) as rt:
        control = rt.control()
        approved = control.plan(
            release("./deploy.sh", False), envelope={"capabilities": ["deploy:prod"]}, approval=True
        )
        control.approve(approved.approval)
        changed = control.plan(
            release("./deploy.sh --force", True), envelope={"capabilities": ["deploy:prod"]}, approval=True
        )

    browser.get(server.url)
    wait_for(lambda: page_has(browser, ".card.plan .changes:not([hidden]) li"), "the changes of the new card")
    assert text_of(browser, ".card.plan .plan-id") == changed.plan_id
    changes = text_of(browser, ".card.plan .changes")
    assert approved.digest[:15] in changes
    assert "added notify" in changes and "envelope" not in changes
    deploy = text_of(browser, ".card.plan .changes li.change[data-node='deploy']")
    assert deploy.startswith("changed") and "./deploy.sh \u2192 ./deploy.sh --force" in deploy
    classes = js(
        browser,
        "return Object.fromEntries([...document.querySelectorAll('.card.plan svg.dag g.node')]"
        ".map(g => [g.dataset.node, g.getAttribute('class')]))",
    )
    assert "added" in classes["notify"] and "changed" in classes["deploy"]
    assert "added" not in classes["build"] and "changed" not in classes["build"]
    screenshot(browser, ws, "review-changes.png")


@needs_chromium()
@pytest.mark.slow
def test_a_denial_in_the_page_takes_two_clicks_and_the_ci_job_stops_with_the_denial(
    ws: Path, server: Server, browser: Any, tmp_path: Path
) -> None:
    out = tmp_path / "job.out"
    job = start_job(ws, out, SMTHRS_SERVE_URL=server.url, REVIEW_DEADLINE_S=str(int(DEADLINE_S * 5)))
    try:
        wait_for(lambda: "parked (75): plan" in job_output(out), "the job's run to park on the plan approval")
        browser.get(server.url)
        wait_for(lambda: page_has(browser, ".card.plan button.deny"), "the pending card")
        use_token(browser, server.token)
        click(browser, ".card.plan button.deny")
        wait_for(lambda: "Click again" in text_of(browser, ".card.plan button.deny"), "the armed Deny button")
        assert len(pending(server)["plans"]) == 1  # one click decides nothing
        click(browser, ".card.plan button.deny")
        wait_for(lambda: "Denied plan" in text_of(browser, "#flash"), "the denial receipt")
        assert pending(server)["plans"] == []
        wait_for(lambda: job.poll() is not None, "the CI job to stop")
        assert job.returncode == 3, job_output(out)  # the exit code of a denied plan
        assert "plan_denied" in job_output(out)
        assert not (ws / "deployed").exists()
        # Watching a run that does not exist: the stream's refusal is shown, not retried forever.
        from selenium.webdriver.common.by import By

        field = browser.find_element(By.ID, "watch-input")
        field.clear()
        field.send_keys("no-such-run")
        click(browser, "#watch-form button")
        wait_for(
            lambda: text_of(browser, "#live-conn").startswith("refused: "), "the refused stream's message"
        )
        assert "no-such-run" in text_of(browser, "#live-conn")
    finally:
        stop(job)


def test_the_job_starts_its_own_server_keeps_the_token_off_its_log_and_completes_after_each_approval(
    ws: Path, tmp_path: Path
) -> None:
    out = tmp_path / "job.out"
    job = start_job(ws, out, REVIEW_DEADLINE_S=str(int(DEADLINE_S * 5)))
    try:
        wait_for(lambda: "parked (75): plan" in job_output(out), "the job's run to park on the plan approval")
        url, token = parse_serve_log((ws / ".smthrs" / "serve.log").read_text())
        assert url and token and "review and approve at: " + url in job_output(out)
        assert token not in job_output(out)
        assert (ws / ".smthrs" / "serve.log").stat().st_mode & 0o077 == 0
        [card] = rpc(url, "review.pending")[1]["result"]["plans"]
        assert rpc(url, "approve", {"ident": card["plan_id"], "digest": card["digest"]})[0] == 401
        status, body = rpc(url, "approve", {"ident": card["plan_id"], "digest": card["digest"]}, token)
        assert status == 200 and body["result"]["receipt"]["_tag"] == "Accepted", body
        wait_for(lambda: "waits for request ship" in job_output(out), "the run to park on the deploy request")
        [request] = rpc(url, "review.pending")[1]["result"]["requests"]
        params = {"ident": request["run_id"], "request": "ship", "digest": request["key"]}
        status, body = rpc(url, "approve", params, token)
        assert status == 200 and body["result"]["receipt"]["_tag"] == "Accepted", body
        wait_for(lambda: job.poll() is not None, "the CI job to finish")
        assert job.returncode == 0, job_output(out)
        assert (ws / "deployed" / "app.txt").read_text() == "release 1.4.0\n"
    finally:
        stop(job)


def test_the_job_gives_up_at_its_deadline_still_parked_with_exit_75(ws: Path, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    job = start_job(ws, out, REVIEW_DEADLINE_S="0")
    try:
        wait_for(lambda: job.poll() is not None, "the CI job to give up")
        assert job.returncode == 75, job_output(out)
        assert "no decision within 0s; still parked" in job_output(out)
    finally:
        stop(job)
