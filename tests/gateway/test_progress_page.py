"""The progress page in a real headless Chromium (Debian's, driven by Playwright).

The run parks at a gate the test holds, so "the steps show while the run is still going"
and "a reload mid-run re-joins it" are facts, not races. A screenshot of the finished page
is kept at test-artifacts/progress-page.png (and one mid-run, progress-page-live.png) for
a reviewer.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from playwright.async_api import Browser, Page, expect

from tests.gateway.conftest import CHROMIUM, NUMBERS, GatewayUnderTest

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

if not Path(CHROMIUM).exists() and not os.environ.get("CI"):
    pytest.skip("chromium is not installed (scripts/test.sh installs it)",
                allow_module_level=True)

expect.set_options(timeout=30_000)


async def start_from_the_page(page: Page, gateway: GatewayUnderTest, tool: str,
                              arguments: dict[str, object]) -> None:
    await page.goto(gateway.base_url + "/")
    await expect(page.locator("#tool option[value='staged']")).to_have_count(1)
    await page.select_option("#tool", tool)
    await page.click("#view-json")
    await page.fill("#arguments", json.dumps(arguments))
    await page.click("#run-button")


async def test_page_follows_a_run_live_survives_a_reload_and_shows_the_result(
        gateway: GatewayUnderTest, gate, browser: Browser) -> None:
    name, opened = gate
    page = await browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    titles = page.locator("#steps li.step .step-title")
    thinking = page.locator('li.step[data-step-id="s2"]')

    await start_from_the_page(page, gateway, "staged", {"gate": name})

    # Live: the first steps, in order and nested under the run, while the run waits.
    await expect(titles).to_have_text(["staged", "Fetching sources", "Thinking"])
    await expect(thinking.locator(":scope > pre.step-output")).to_have_text("considering…\n")
    await expect(thinking).to_have_attribute("data-status", "RUNNING")
    await expect(page.locator('li.step[data-step-id="s1"]')).to_have_attribute(
        "data-status", "COMPLETE")
    await expect(page.locator('li.step[data-step-id="s0"] > ul.children > li.step')
                 ).to_have_count(2)
    await expect(page.locator("#time-left")).to_contain_text("stops if nothing happens for")
    await expect(page.locator("#result")).to_be_hidden()
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "progress-page-live.png"), full_page=True)
    run_id = await page.locator("#run-id").text_content()
    assert run_id and page.url.endswith(f"#run={run_id}")

    # A reload mid-run re-joins the same run and shows everything so far.
    await page.reload()
    await expect(page.locator("#run-id")).to_have_text(run_id)
    await expect(page.locator("#tool")).to_have_value("staged")
    await expect(titles).to_have_text(["staged", "Fetching sources", "Thinking"])
    await expect(thinking.locator(":scope > pre.step-output")).to_have_text("considering…\n")
    await expect(page.locator("#result")).to_be_hidden()
    await expect(page.locator("#run-state")).to_have_text("running")
    # The countdown survives the reload: counted from the events' own times.
    await expect(page.locator("#time-left")).to_contain_text("stops if nothing happens for")
    left = float(await page.locator("#time-left").get_attribute("data-seconds") or "-1")
    assert 0 < left <= gateway.server.settings.critic_soft_timeout

    # The run goes on: the rest streams in, then the Result with its file.
    opened.set()
    await expect(page.locator("#result")).to_have_attribute("data-outcome", "OK")
    await expect(titles).to_have_text(
        ["staged", "Fetching sources", "Thinking", "Writing the report"])
    await expect(page.locator("li.step[data-status='COMPLETE']")).to_have_count(4)
    await expect(thinking.locator(":scope > pre.step-output")).to_have_text(
        "considering…\ndecided\n")
    await expect(page.locator("#result-output")).to_have_text("staged run done")
    await expect(page.locator("#time-left")).to_be_hidden()
    links = page.locator("#result-files a.download")
    await expect(links).to_have_text(["report.txt", "numbers.csv"])
    # Both download: one came inline in the Result, the other as FileChunk events.
    for index, expected in enumerate((b"the report\n", NUMBERS)):
        async with page.expect_download() as download_info:
            await links.nth(index).click()
        download = await download_info.value
        saved = Path(await download.path())
        assert await asyncio.to_thread(saved.read_bytes) == expected

    await page.screenshot(path=str(ARTIFACTS / "progress-page.png"), full_page=True)
    assert errors == []


async def test_page_streams_count_deltas_and_cancels(gateway: GatewayUnderTest, gate,
                                                     browser: Browser) -> None:
    name, _ = gate
    page = await browser.new_page()
    await start_from_the_page(page, gateway, "count", {"to": 5})

    await expect(page.locator("#result")).to_have_attribute("data-outcome", "OK")
    await expect(page.locator('li.step[data-step-id="s1"] > pre.step-output')).to_have_text(
        "1\n2\n3\n4\n5\n")

    # A run that waits can be cancelled from the page.
    await page.select_option("#tool", "staged")
    await page.click("#view-json")
    await page.fill("#arguments", json.dumps({"gate": name}))
    await page.click("#run-button")
    await expect(page.locator("#steps li.step .step-title")).to_have_count(3)
    await page.click("#cancel-button")
    await expect(page.locator("#result")).to_have_attribute("data-outcome", "CANCELLED")
    await expect(page.locator('li.step[data-step-id="s2"]')).to_have_attribute(
        "data-status", "ERROR")
