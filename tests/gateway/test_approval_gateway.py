"""Approval over HTTP and on the page: ``POST /v1/runs/{id}:approve`` decides (its refusals
are the HTTP form of ApproveRun's statuses), the runs list shows an approver what waits with
its arguments and Approve / Deny, and the run view shows its own run's request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, Page, expect

from tests.approval.approval_helpers import approval_registry
from tests.conftest import AuthServerFactory


@dataclass
class Front:
    """The gateway of a server with keys: ``http(name)`` is a client with that key."""

    base_url: str
    keys: dict[str, str]

    def http(self, name: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=30,
                                 headers={"Authorization": f"Bearer {self.keys[name]}"})


@pytest.fixture
async def front(make_auth_server: AuthServerFactory) -> AsyncIterator[Front]:
    auth = await make_auth_server(approval_registry(), http_port=0)
    keys = {"alice": auth.add_key("alice"), "bob": auth.add_key("bob", "approver"),
            "mallory": auth.add_key("mallory")}
    yield Front(f"http://127.0.0.1:{auth.server.http.gateway_port}", keys)


async def waiting_run(http: httpx.AsyncClient, service: str) -> tuple[str, dict[str, Any]]:
    """Starts a ``deploy`` run and returns its id and its approval request as listed."""
    started = await http.post("/v1/tools/deploy:execute",
                              json={"arguments": {"service": service, "target": "prod"}})
    assert started.status_code == 202, started.text
    run_id = started.json()["run_id"]
    listed = await http.get("/v1/runs?state=awaiting_approval")
    [run] = [r for r in listed.json()["runs"] if r["run_id"] == run_id]
    return run_id, run["approval"]


def reason_of(response: httpx.Response) -> str:
    return next(d["reason"] for d in response.json()["error"]["details"]
                if d["@type"].endswith("ErrorInfo"))


async def test_approve_over_http_and_its_refusals(front: Front) -> None:
    async with front.http("alice") as alice, front.http("bob") as bob, \
            front.http("mallory") as mallory:
        assert (await bob.get("/v1/capabilities")).json()["approve"] is True
        run_id, request = await waiting_run(alice, "billing")
        url = f"/v1/runs/{run_id}:approve"
        body = {"approval_id": request["approval_id"], "decision": "approve",
                "reason": "ok", "arguments_digest": request["arguments_digest"]}

        missing = await bob.post(url, json={"decision": "approve"})
        extra = await bob.post(url, json={**body, "who": "me"})
        bad_decision = await bob.post(url, json={**body, "decision": "maybe"})
        not_json = await bob.post(url, content=b"{nope",
                                  headers={"Content-Type": "application/json"})
        hidden = await mallory.post(url, json=body)
        own = await alice.post(url, json=body)
        forged = await bob.post(url, json={**body, "approval_id": "x" * 32})
        assert [r.status_code for r in (missing, extra, bad_decision, not_json)] == [400] * 4
        assert (hidden.status_code, reason_of(hidden)) == (404, "RUN_NOT_FOUND")
        assert (own.status_code, reason_of(own)) == (403, "APPROVER_ROLE_REQUIRED")
        assert (forged.status_code, reason_of(forged)) == (403, "APPROVAL_ID_MISMATCH")

        approved = await bob.post(url, json=body)
        assert approved.status_code == 200
        assert approved.json() == {"run_id": run_id, "decision": "approve",
                                   "arguments_digest": request["arguments_digest"]}
        # Sent again (its answer lost), the same decision gets the same answer; another
        # decision on the decided run is refused.
        again = await bob.post(url, json=body)
        assert (again.status_code, again.json()) == (200, approved.json())
        changed = await bob.post(url, json={**body, "decision": "deny"})
        assert (changed.status_code, reason_of(changed)) == (400, "APPROVAL_NOT_PENDING")

        denied_id, denied_request = await waiting_run(alice, "db")
        denied = await bob.post(f"/v1/runs/{denied_id}:approve", json={
            "approval_id": denied_request["approval_id"], "decision": "deny",
            "reason": "no"})
        assert denied.status_code == 200 and denied.json()["decision"] == "deny"
        outcomes = {}
        for run in (await alice.get("/v1/runs?state=finished")).json()["runs"]:
            outcomes[run["run_id"]] = run["outcome"]
        assert outcomes.get(run_id) == "OUTCOME_OK"
        assert outcomes.get(denied_id) == "OUTCOME_DENIED"


async def with_key(browser: Browser, front: Front, name: str, fragment: str = "") -> Page:
    """A page whose tab holds ``name``'s key from the start (as after pasting it once), so
    it lists the tools and runs once."""
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    await page.add_init_script(
        f"sessionStorage.setItem('stargrpc.token', {json.dumps(front.keys[name])})")
    await page.goto(front.base_url + "/" + fragment)
    await expect(page.locator("#tool option[value='deploy']")).to_have_count(1)
    return page


async def test_the_page_shows_the_request_and_approves_it(front: Front,
                                                          browser: Browser) -> None:
    async with front.http("alice") as alice:
        run_id, request = await waiting_run(alice, "billing")

    # The run's owner sees its request in the run view (and may not decide on it).
    page = await with_key(browser, front, "alice", f"#run={run_id}")
    box = page.locator("#approval .approval-box")
    await expect(box.locator(".approval-arguments")).to_contain_text('"service": "billing"')
    await expect(box).to_contain_text(request["arguments_digest"])
    await expect(page.locator("#run-state")).to_have_text("awaiting")
    # Once the page has listed the tools and runs (which clears the error box), a decision
    # of the run's owner is refused, and says why.
    await expect(page.locator(f"#runs-list button[data-run-id='{run_id}'] .badge")
                 ).to_have_text("awaiting")
    await box.locator(".approve-button").click()
    await expect(page.locator("#form-error")).to_contain_text("needs the role 'approver'")

    # An approver lists what waits, with the arguments, and approves it from the list.
    approver = await with_key(browser, front, "bob")
    await approver.select_option("#filter-outcome", "awaiting_approval")
    item = approver.locator("#runs-list li", has=approver.locator(
        f"button[data-run-id='{run_id}']"))
    await expect(item.locator(".approval-arguments")).to_contain_text("prod")
    await expect(item.locator(".badge")).to_have_text("awaiting")
    await item.locator("input").fill("looks right")
    await item.locator(".approve-button").click()
    await expect(item.locator(".approval-status")).to_have_text("Approved.")

    # The owner's view follows: the request goes, the run ends OK.
    await expect(page.locator("#result")).to_have_attribute("data-outcome", "OK")
    await expect(page.locator("#approval")).to_be_hidden()
    await expect(page.locator("#notices")).to_contain_text("approved by bob: looks right")
