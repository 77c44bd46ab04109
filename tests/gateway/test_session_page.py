"""The progress page's session picker in a real headless Chromium: open a session, run
python in it twice (the second call sees the first's variable), see its files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from playwright.async_api import Browser, expect

from tests.gateway.conftest import CHROMIUM, GatewayUnderTest

if not Path(CHROMIUM).exists():
    pytest.skip("chromium is not installed (scripts/test.sh installs it)",
                allow_module_level=True)

expect.set_options(timeout=30_000)


async def run_code(page, code: str) -> None:
    await page.click("#view-json")
    await page.fill("#arguments", json.dumps({"code": code}))
    await page.click("#run-button")


async def test_the_page_runs_python_in_a_session_and_lists_its_files(
        gateway: GatewayUnderTest, browser: Browser) -> None:
    page = await browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    await page.goto(gateway.base_url + "/")
    await expect(page.locator("#tool option[value='python']")).to_have_count(1)
    await page.select_option("#tool", "echo")
    await expect(page.locator("#session-box")).to_be_hidden()  # no sessions for echo
    await page.select_option("#tool", "python")
    await expect(page.locator("#session-box")).to_be_visible()
    await page.click("#new-session")
    await expect(page.locator("#session option")).to_have_count(2)
    session_id = await page.locator("#session").input_value()
    assert session_id.startswith("ses_")
    await expect(page.locator("#session-files")).to_have_text("no files yet")

    await run_code(page, "kept = 41\nopen('notes.txt', 'w').write('hello')")
    await expect(page.locator("#result")).to_have_attribute("data-outcome", "OK")
    await expect(page.locator("#session-files li")).to_have_text(["notes.txt (5 bytes)"])
    await run_code(page, "print(kept + 1)")
    await expect(page.locator("#steps pre.step-output", has_text="42")).to_have_count(1)
    await expect(page.locator("#result")).to_have_attribute("data-outcome", "OK")
    await expect(page.locator("#session option:checked")).to_contain_text("2 calls")
    # "none" runs in a fresh sandbox again, where nothing of the session is.
    await page.select_option("#session", "")
    await run_code(page, "print(kept)")
    await expect(page.locator("#steps")).to_contain_text("NameError")
    await expect(page.locator("#result")).to_have_attribute("data-outcome", "FAILED")
    assert errors == []
