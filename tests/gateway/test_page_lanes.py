"""The page with lanes: a queued run shows as queued, with its place in line, in the run
panel and the runs list, then as running once it starts."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
from playwright.async_api import Browser, expect

from tests.gateway.conftest import GATES, GatewayUnderTest, gateway_registry


async def test_a_queued_run_shows_its_place_then_runs(make_server, browser: Browser,
                                                     tmp_path: Path) -> None:
    server = await make_server(registry=gateway_registry(), http_port=0,
                               lanes={"slow": {"max_concurrent": 1}},
                               tool_lanes={"staged": "slow"})
    base_url = f"http://127.0.0.1:{server.http.gateway_port}"
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    GATES[first], GATES[second] = asyncio.Event(), asyncio.Event()
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
            gateway = GatewayUnderTest(server, base_url, http)
            holding = await http.post("/v1/tools/staged:execute",
                                      json={"arguments": {"gate": first}})
            assert holding.status_code == 202, holding.text
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            await page.goto(gateway.base_url + "/")
            await expect(page.locator("#tool option[value='staged']")).to_have_count(1)
            await page.select_option("#tool", "staged")
            await page.fill("[data-path='gate']", second)
            await page.click("#run-button")

            await expect(page.locator("#run-state")).to_have_text("queued")
            await expect(page.locator("#queue-place")).to_contain_text(
                "Waiting in lane slow: #1 in line")
            run_id = await page.locator("#run-id").text_content()
            listed = page.locator(f"#runs-list button[data-run-id='{run_id}']")
            await expect(listed.locator(".badge")).to_have_text("queued")
            await expect(listed.locator(".run-meta")).to_contain_text("lane slow, #1 in line")
            await page.screenshot(path=str(tmp_path / "queued.png"), full_page=True)

            GATES[first].set()
            await expect(page.locator("#run-state")).to_have_text("running")
            await expect(page.locator("#queue-place")).to_be_hidden()
            GATES[second].set()
            await expect(page.locator("#result")).to_have_attribute("data-outcome", "OK")
    finally:
        for name in (first, second):
            GATES.pop(name).set()
