"""Call trees on the progress page (headless Chromium): a run's children nest, live, under
the step that called them, each marked and linked; the runs list folds a tree into its root."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from playwright.async_api import Browser, expect

from tests.tree_tools import tree_registry


async def test_children_nest_in_the_run_panel_and_the_list_folds_the_tree(
        make_server: Any, browser: Browser, tmp_path: Path) -> None:
    server = await make_server(registry=tree_registry(), http_port=0)
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    await page.goto(f"http://127.0.0.1:{server.http.gateway_port}/")
    await expect(page.locator("#tool option[value='tree_node']")).to_have_count(1)
    await page.select_option("#tool", "tree_node")
    await page.click("#view-json")
    await page.fill("#arguments", json.dumps({"levels": 2, "fan_out": 2}))
    await page.click("#run-button")
    await expect(page.locator("#result")).to_have_attribute("data-outcome", "OK",
                                                            timeout=30_000)
    root = await page.locator("#run-id").text_content()
    # Two children under the root step, two grandchildren under each child.
    children = page.locator("#steps > li.step > ul.children > li.step.child-run")
    await expect(children).to_have_count(2)
    grandchildren = children.locator(":scope > ul.children > li.step.child-run")
    await expect(grandchildren).to_have_count(4)
    first = await children.first.get_attribute("data-child-run-id")
    link = children.first.locator(":scope > .step-head > a.child-run-link")
    await expect(link).to_have_attribute("href", f"#run={first}")
    # The leaves' output is theirs: the run's own output is its result only.
    await expect(grandchildren.first.locator("ul.children pre.step-output")).to_contain_text(
        "leaf")
    # The list shows the root alone, with its six runs folded under it.
    fold = page.locator(f"#runs-list button.run-item[data-run-id='{root}'] + details.run-tree")
    await expect(fold.locator("summary")).to_have_text("6 runs below")
    await expect(page.locator("#runs-list > li")).to_have_count(1)
    await fold.locator("summary").click()
    await expect(fold.locator("button.run-item")).to_have_count(6)
    await page.screenshot(path=str(tmp_path / "tree.png"), full_page=True)
    print(f"screenshot: {tmp_path / 'tree.png'}")
