"""The progress page's State section in a real headless Chromium: an admin viewer sees the
run and tree state the shown run kept (values shown as text, never markup) and refreshes
it; for anyone else the state API answers 403 and the section stays hidden, until an admin
key is pasted."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser, Locator, Page, expect

from stargrpc.registry import Registry
from tests.conftest import AuthServer, AuthServerFactory
from tests.gateway.conftest import CHROMIUM
from tests.state_tools import state_registry
from tests.tree_tools import tree_registry

if not Path(CHROMIUM).exists():
    pytest.skip("chromium is not installed (scripts/test.sh installs it)",
                allow_module_level=True)

expect.set_options(timeout=30_000)

#: A value that would run script if the page put it in as markup.
HOSTILE = '<img src=x onerror="document.title=\'owned\'">'


def base_url(auth: AuthServer) -> str:
    return f"http://127.0.0.1:{auth.server.http.gateway_port}"


async def run_with(auth: AuthServer, key: str, tool: str = "state_run_and_tree",
                   arguments: dict[str, object] | None = None) -> dict[str, object]:
    """Runs ``tool`` (``state_run_and_tree`` keeps its run id as ``mine`` in its run state
    and as ``root`` in its tree's) with ``key`` over HTTP; its answer once it ended OK."""
    async with httpx.AsyncClient(base_url=base_url(auth), timeout=60,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        answer = await http.post(f"/v1/tools/{tool}:execute?wait=true",
                                 json={"arguments": arguments or {}})
    assert answer.status_code == 200, answer.text
    assert answer.json()["result"]["outcome"] == "OUTCOME_OK"
    return dict(answer.json())


async def open_run(browser: Browser, auth: AuthServer, key: str, run_id: str,
                   answers: list[int]) -> Page:
    """A page holding ``key`` that shows run ``run_id`` to its Result, once the page has
    asked for its tree state; the state API's answers (HTTP statuses) go to ``answers``."""
    page = await browser.new_page()
    page.on("response", lambda response: answers.append(response.status)
            if "/v1/state/" in response.url else None)
    await page.add_init_script(f"sessionStorage.setItem('stargrpc.token', {json.dumps(key)})")
    async with page.expect_response(lambda r: "/v1/state/run?" in r.url):
        await page.goto(f"{base_url(auth)}/#run={run_id}")
    await expect(page.locator("#result")).to_have_attribute("data-outcome", "OK")
    return page


def entry(page: Page, scope: str, key: str) -> Locator:
    return page.locator(f"#state-{scope}-entries div[data-key='{key}'] dd")


async def test_an_admin_sees_the_runs_state_and_others_do_not(
        make_auth_server: AuthServerFactory, browser: Browser) -> None:
    auth = await make_auth_server(state_registry(), roles=("admin",), http_port=0)
    run_id = str((await run_with(auth, auth.key))["run_id"])
    answers: list[int] = []
    page = await open_run(browser, auth, auth.key, run_id, answers)

    await expect(page.locator("#state-box")).to_be_visible()
    await expect(entry(page, "run", "mine")).to_have_text(json.dumps(run_id))
    await expect(page.locator("#state-tree-root")).to_have_text(run_id)
    await expect(entry(page, "tree", "root")).to_have_text(json.dumps(run_id))
    # What changes later shows on Refresh, as text.
    async with httpx.AsyncClient(base_url=base_url(auth), timeout=30,
                                 headers={"Authorization": f"Bearer {auth.key}"}) as http:
        put = await http.put(f"/v1/state/run/note?run_id={run_id}", json={"value": HOSTILE})
        assert put.status_code == 200, put.text
        deleted = await http.delete(f"/v1/state/tree/root?run_id={run_id}")
        assert deleted.json() == {"deleted": True}
    await page.click("#state-refresh")
    await expect(entry(page, "run", "note")).to_have_text(json.dumps(HOSTILE))
    await expect(page.locator("#state-tree-entries")).to_have_text("nothing kept")
    assert await page.locator("#state-box img").count() == 0
    assert await page.title() != "owned"
    assert answers and set(answers) == {200}
    await page.close()


async def test_a_viewer_without_the_admin_role_sees_no_state_section(
        make_auth_server: AuthServerFactory, browser: Browser) -> None:
    auth = await make_auth_server(state_registry(), roles=("admin",), http_port=0)
    viewer = auth.add_key("viewer", "tools")
    run_id = str((await run_with(auth, viewer))["run_id"])
    answers: list[int] = []
    page = await open_run(browser, auth, viewer, run_id, answers)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))

    # The page asked once, was refused (403, an audited refusal: not asked again with
    # that key, not even after the Result) and keeps the section hidden, without an error.
    assert answers == [403]
    await expect(page.locator("#state-box")).to_be_hidden()
    await expect(page.locator("#form-error")).to_be_hidden()
    # The viewer pastes an admin key: the same run's state shows.
    await page.click("#credentials summary")
    await page.fill("#token", auth.key)
    await page.dispatch_event("#token", "change")
    await expect(entry(page, "run", "mine")).to_have_text(json.dumps(run_id))
    await expect(page.locator("#state-box")).to_be_visible()
    assert answers[0] == 403 and set(answers[1:]) == {200}
    assert errors == []
    await page.close()


async def test_a_child_runs_tree_state_is_its_roots(make_auth_server: AuthServerFactory,
                                                     browser: Browser) -> None:
    registry = Registry([*tree_registry().values(), *state_registry().values()])
    auth = await make_auth_server(registry, roles=("admin",), http_port=0)
    parent = await run_with(auth, auth.key, "caller", {"tool": "state_run_and_tree"})
    parent_id = str(parent["run_id"])
    child_id = json.loads(parent["result"]["output"])["child_run_id"]
    assert child_id != parent_id
    answers: list[int] = []
    page = await open_run(browser, auth, auth.key, child_id, answers)

    # The child's own run state, and the tree's: kept under the root run, the parent.
    await expect(entry(page, "run", "mine")).to_have_text(json.dumps(child_id))
    await expect(page.locator("#state-tree-root")).to_have_text(parent_id)
    await expect(entry(page, "tree", "root")).to_have_text(json.dumps(child_id))
    # The parent kept nothing of its own.
    async with page.expect_response(lambda r: "/v1/state/tree?" in r.url):
        await page.goto(f"{base_url(auth)}/#run={parent_id}")
    await expect(page.locator("#run-id")).to_have_text(parent_id)
    await expect(page.locator("#state-run-entries")).to_have_text("nothing kept")
    await expect(entry(page, "tree", "root")).to_have_text(json.dumps(child_id))
    await page.close()
