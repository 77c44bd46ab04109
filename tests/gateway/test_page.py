"""The grown-up progress page in headless Chromium: the runs list, a form for every bundled
tool's schema (round-tripping with the JSON view), a refused call, rich messages, a re-join
after a reload with the run's real arguments, keyboard-only use at 390 px, and an axe-core
scan. Screenshots go to the test's tmp dir (its path is printed)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Browser, Page, expect

from stargrpc.registry import load_registry
from tests.client_builds import npm_ci
from tests.conftest import AuthServerFactory
from tests.gateway.conftest import GatewayUnderTest

AXE_DIR = Path(__file__).parent / "axe"
BUNDLED = sorted(load_registry(bundled=True, entry_points=False))


@pytest.fixture(scope="session")
def axe_source() -> str:
    """axe-core's script, installed from the committed lock file when missing."""
    script = AXE_DIR / "node_modules" / "axe-core" / "axe.min.js"
    npm_ci(AXE_DIR, script, timeout=300)
    return script.read_text()


def sample(schema: dict[str, Any], root: dict[str, Any], name: str = "") -> Any:
    """A value for ``schema`` unlike its default, so a round trip must carry it."""
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    if "anyOf" in schema:
        schema = next(s for s in schema["anyOf"] if s.get("type") != "null")
    if "enum" in schema:
        return schema["enum"][-1]
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        return {key: sample(sub, root, key) for key, sub in schema["properties"].items()}
    if kind == "object":
        return {"X-Sample": "1"}
    if kind == "array":
        return [sample(schema["items"], root), sample(schema["items"], root)]
    if kind == "boolean":
        return not schema.get("default", False)
    if kind == "integer":
        return int(schema.get("minimum", 0)) + 2
    if kind == "number":
        return 2.5
    return f"line one of {name}\n    line two" if name in ("code", "command") else f"{name} x"


async def open_page(browser: Browser, gateway: GatewayUnderTest, width: int = 1280) -> Page:
    page = await browser.new_page(viewport={"width": width, "height": 900})
    await page.goto(gateway.base_url + "/")
    await expect(page.locator("#tool option[value='report']")).to_have_count(1)
    return page


async def inject_axe(page: Page, axe_source: str) -> None:
    """Loads axe-core through the DevTools protocol: the page's CSP (no inline script)
    stays on and would refuse a script tag."""
    await page.evaluate(axe_source + "\n;true")


async def json_view(page: Page) -> Any:
    await page.click("#view-json")
    value = json.loads(await page.input_value("#arguments"))
    await page.click("#view-form")
    return value


async def test_a_form_for_every_tool_round_trips_with_the_json_view(
        gateway: GatewayUnderTest, browser: Browser, tmp_path: Path) -> None:
    page = await open_page(browser, gateway)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    catalog = (await gateway.http.get("/v1/tools")).json()["tools"]
    schemas = {tool["name"]: tool["input_schema"] for tool in catalog}
    for name in [*BUNDLED, "report"]:
        await page.select_option("#tool", name)
        schema = schemas[name]
        # Defaults and required marks are in the form as generated.
        for key in schema.get("required", []):
            await expect(page.locator(f"[data-path='{key}']").first).to_have_attribute(
                "required", "")
        wanted = sample(schema, schema)
        await page.click("#view-json")
        await page.fill("#arguments", json.dumps(wanted))
        await page.click("#view-form")
        assert await json_view(page) == wanted, name
        await page.screenshot(path=str(tmp_path / f"form-{name}.png"), full_page=True)
    # Code fields are a code editor, not a one-line JSON string.
    await page.select_option("#tool", "python")
    await expect(page.locator("textarea.code[data-path='code']")).to_have_count(1)
    await page.select_option("#tool", "shell")
    await expect(page.locator("textarea.code[data-path='command']")).to_have_count(1)

    # Filled through the form controls, the call sends exactly what the JSON view shows.
    await page.select_option("#tool", "report")
    await page.fill("[data-path='title']", "Quarterly")
    await page.click("text=Add tags item")
    await page.fill("[data-path='tags[0]']", "alpha")
    await page.select_option("[data-path='mode']", label="full")
    await page.uncheck("[data-path='draft']")
    await page.fill("[data-path='limits.rows']", "2")
    shown = await json_view(page)
    assert shown == {"title": "Quarterly", "tags": ["alpha"], "mode": "full", "draft": False,
                     "limits": {"rows": 2, "strict": False}}
    async with page.expect_request("**/v1/tools/report:execute") as sent:
        await page.click("#run-button")
    assert (await sent.value).post_data_json == {"arguments": shown}
    await expect(page.locator("#result")).to_have_attribute("data-outcome", "OK")
    assert errors == []
    print(f"screenshots in {tmp_path}")


async def test_rich_messages_refusals_the_runs_list_and_a_rejoin(
        gateway: GatewayUnderTest, browser: Browser, gate, tmp_path: Path,
        axe_source: str) -> None:
    page = await open_page(browser, gateway)
    await page.select_option("#tool", "report")
    await page.fill("[data-path='title']", "Weekly")
    await page.click("#run-button")
    result = page.locator("#result")
    await expect(result).to_have_attribute("data-outcome", "OK")
    messages = page.locator("#result-messages")
    await expect(messages.locator("h4")).to_have_text("Weekly")
    await expect(messages.locator("strong")).to_have_text("brief")
    await expect(messages.locator("table tbody tr")).to_have_count(3)
    await expect(messages.locator("img")).to_have_attribute("alt", "a green square")
    await expect(messages.locator(".link-card a")).to_have_attribute(
        "href", "https://example.com/report")
    assert await messages.locator("script").count() == 0  # markdown never becomes HTML
    await expect(page.locator("#result-structured details")).to_have_count(3)
    await expect(page.locator("#tools-box")).to_be_hidden()  # empty sections are hidden
    await expect(page.locator("#files-box")).to_be_hidden()
    # The run has ended: no steer box (it shows for a live run when /v1/capabilities offers it).
    await expect(page.locator("#steer-form")).to_be_hidden()
    await page.screenshot(path=str(tmp_path / "rich-messages.png"), full_page=True)
    first_run = await page.locator("#run-id").text_content()

    # A refused call: the previous run's panel goes, the violation's description shows.
    await page.select_option("#tool", "count")
    await page.click("#view-json")
    await page.fill("#arguments", json.dumps({"to": "many"}))
    await page.click("#run-button")
    error = page.locator("#form-error")
    await expect(error).to_contain_text("count was not started")
    await expect(error.locator("li")).to_contain_text("to")
    assert "integer" in (await error.locator("li").first.text_content() or "")
    await expect(page.locator("#run-view")).to_be_hidden()
    await page.screenshot(path=str(tmp_path / "refused.png"), full_page=True)

    # A run with its own arguments; after a reload the form shows those, not the defaults.
    name, opened = gate
    await page.select_option("#tool", "staged")
    await page.click("#view-form")
    await page.fill("[data-path='gate']", name)
    await page.click("#run-button")
    await expect(page.locator("#steps li.step .step-title")).to_have_count(3)
    run_id = await page.locator("#run-id").text_content()
    listed = page.locator(f"#runs-list button[data-run-id='{run_id}']")
    await expect(listed.locator(".badge")).to_have_text("running")
    await expect(page.locator(f"#runs-list button[data-run-id='{first_run}'] .badge")
                 ).to_have_text("ok")
    await page.screenshot(path=str(tmp_path / "runs-list.png"), full_page=True)
    await page.reload()
    await expect(page.locator("#run-id")).to_have_text(run_id or "")
    await expect(page.locator("[data-path='gate']")).to_have_value(name)
    await expect(page.locator("#run-arguments-json")).to_contain_text(name)
    await expect(page.locator("#time-left")).to_contain_text("stops if nothing happens for")
    await page.screenshot(path=str(tmp_path / "rejoined.png"), full_page=True)

    # axe-core: no serious or critical violations, mid-run.
    await inject_axe(page, axe_source)
    report = await page.evaluate("axe.run(document, {resultTypes: ['violations']})")
    bad = [(v["id"], v["impact"], [n["target"] for n in v["nodes"]][:3])
           for v in report["violations"] if v["impact"] in ("serious", "critical")]
    assert bad == []
    opened.set()
    await expect(listed.locator(".badge")).to_have_text("ok")

    # The list opens any run: the first one again, by its list entry.
    await page.locator(f"#runs-list button[data-run-id='{first_run}']").click()
    await expect(page.locator("#run-id")).to_have_text(first_run or "")
    await expect(result).to_have_attribute("data-outcome", "OK")
    # Filters: only count runs (none finished OK), then only ok ones.
    await page.select_option("#filter-tool", "count")
    await expect(page.locator("#runs-list li")).to_have_count(0)
    await page.select_option("#filter-tool", "")
    await page.select_option("#filter-outcome", "ok")
    await expect(page.locator("#runs-list li")).to_have_count(2)


async def test_keyboard_only_at_390_pixels(gateway: GatewayUnderTest, browser: Browser,
                                           tmp_path: Path, axe_source: str) -> None:
    page = await open_page(browser, gateway, width=390)
    await page.select_option("#tool", "echo")
    await page.locator("#tool").focus()
    # Tab to the text field, type, then on to Run and press Enter: no mouse.
    for _ in range(10):
        await page.keyboard.press("Tab")
        if await page.evaluate("document.activeElement.dataset.path") == "text":
            break
    await page.keyboard.type("typed by keyboard")
    for _ in range(10):
        await page.keyboard.press("Tab")
        if await page.evaluate("document.activeElement.id") == "run-button":
            break
    outline = await page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert outline != "none"  # focus is visible
    await page.keyboard.press("Enter")
    await expect(page.locator("#result")).to_have_attribute("data-outcome", "OK")
    # Streamed once in its step; the Result's copy of it (for the model) stays folded.
    await expect(page.locator("#steps pre.step-output")).to_have_text("typed by keyboard")
    await expect(page.locator("#result-output")).to_be_empty()
    await expect(page.locator("#result-output-full")).to_have_text("typed by keyboard")
    await expect(page.locator("#announcer")).to_contain_text("Run finished: ok")
    width = await page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390  # nothing overflows sideways on a phone
    await page.screenshot(path=str(tmp_path / "phone.png"), full_page=True)
    await inject_axe(page, axe_source)
    report = await page.evaluate("axe.run(document, {resultTypes: ['violations']})")
    assert [v["id"] for v in report["violations"]
            if v["impact"] in ("serious", "critical")] == []


async def test_enter_in_the_key_field_lists_the_tools_and_runs_nothing(
        make_auth_server: AuthServerFactory, browser: Browser) -> None:
    # On a server that needs a key the tool list is empty until one is given; pressing
    # Enter in the key field submits the run form. It once asked to execute a tool with
    # no name (a 404); it lists the tools instead.
    auth = await make_auth_server(roles=("admin",), http_port=0)
    page = await browser.new_page()
    requests: list[str] = []
    page.on("request", lambda request: requests.append(f"{request.method} {request.url}"))
    await page.goto(f"http://127.0.0.1:{auth.server.http.gateway_port}/")
    await page.fill("#token", auth.key)
    await page.press("#token", "Enter")

    await expect(page.locator("#tool option[value='count']")).to_have_count(1)
    assert not [r for r in requests if r.startswith("POST")]
    await expect(page.locator("#form-error")).to_be_hidden()
    await page.close()


async def test_an_image_at_an_https_url_shows_and_one_over_http_says_why_not(
        gateway: GatewayUnderTest, browser: Browser) -> None:
    """An ``image`` rich message names an https URL (docs/use/http.md): the page's
    Content-Security-Policy lets the browser load it; plain http it refuses, and the page
    says so instead of showing a broken image."""
    import base64

    from tests.gateway.conftest import PIXEL

    fetched: list[str] = []

    async def serve_pixel(route: Any) -> None:  # the "remote" server, inside the browser
        fetched.append(route.request.url)
        await route.fulfill(body=base64.b64decode(PIXEL.split(",", 1)[1]),
                            content_type="image/png")

    page = await open_page(browser, gateway)
    await page.route("https://images.example/**", serve_pixel)
    await page.select_option("#tool", "picture")
    await page.fill("[data-path='url']", "https://images.example/pixel.png")
    await page.click("#run-button")
    await expect(page.locator("#result")).to_have_attribute("data-outcome", "OK")
    image = page.locator("#result-messages img")
    await expect(image).to_have_attribute("src", "https://images.example/pixel.png")
    # Loaded, not blocked: decode() settles once the image has loaded or failed to.
    width = await image.evaluate("img => img.decode().then(() => img.naturalWidth, () => 0)")
    assert width == 2
    assert fetched == ["https://images.example/pixel.png"]

    await page.fill("[data-path='url']", "http://images.example/pixel.png")
    await page.click("#run-button")
    await expect(page.locator("#result-messages")).to_contain_text(
        "not an https or image data URL")
    await expect(page.locator("#result-messages img")).to_have_count(0)


async def test_a_form_on_another_site_cannot_run_a_tool(gateway: GatewayUnderTest,
                                                        browser: Browser) -> None:
    """The attack of a hostile page, in a real browser: a ``text/plain`` form whose body is
    the JSON of a run, posted to the gateway of a server without authentication."""
    target = f"{gateway.base_url}/v1/tools/echo:execute?wait=true"
    # The field's name and value join with "=" into {"arguments": …, "idempotency_key": "="}.
    hostile = (f'<form method="post" enctype="text/plain" action="{target}">'
               '<input type="hidden" name=\'{"arguments": {"text": "pwned"}, '
               '"idempotency_key": "\' value=\'"}\'>'
               '<button id="go">win a prize</button></form>')
    page = await browser.new_page()
    await page.route("http://hostile.test/**", lambda route: route.fulfill(
        body=hostile, content_type="text/html"))
    await page.goto("http://hostile.test/")
    async with page.expect_navigation() as navigation:
        await page.click("#go")
    answer = await navigation.value

    assert answer is not None and answer.status == 403
    listed = (await gateway.http.get("/v1/runs")).json()["runs"]
    assert listed == []  # no run started


#: Holds 64 MiB, burns a second of CPU (so the sandbox's twice-a-second samples of its tree
#: see it) and leaves 100 kB in its output folder.
BURN = """
import os, time
hold = bytearray(64 * 1024 * 1024)
for i in range(0, len(hold), 4096):
    hold[i] = 1
start = time.process_time()
while time.process_time() - start < 1.0:
    pass
time.sleep(0.3)
with open(os.path.join(os.environ["OUTPUT_DIR"], "data.bin"), "wb") as out:
    out.write(b"x" * 100_000)
print("done")
"""


async def receipt(page: Page) -> dict[str, str]:
    """The run view's receipt, term → figure, as shown."""
    figures = page.locator("#result-usage div")
    return {await item.locator("dt").inner_text(): await item.locator("dd").inner_text()
            for item in await figures.all()}


async def test_the_result_shows_what_the_run_used_and_nothing_it_did_not_measure(
        gateway: GatewayUnderTest, browser: Browser, tmp_path: Path, axe_source: str
) -> None:
    page = await open_page(browser, gateway)
    await page.select_option("#tool", "python")
    await page.click("#view-json")
    await page.fill("#arguments", json.dumps({"code": BURN}))
    await page.click("#run-button")
    await expect(page.locator("#result")).to_have_attribute("data-outcome", "OK", timeout=30_000)
    usage_box = page.locator("#usage-box")
    await expect(usage_box).to_be_visible()
    await expect(usage_box).to_have_attribute("aria-label", "What the run used")
    shown = await receipt(page)
    await page.screenshot(path=str(tmp_path / "receipt.png"), full_page=True)
    await inject_axe(page, axe_source)
    report = await page.evaluate("axe.run('#result', {resultTypes: ['violations']})")
    assert [v["id"] for v in report["violations"]
            if v["impact"] in ("serious", "critical")] == []

    # The server's own receipt for the run, as the page received it (proto field names;
    # 64-bit counts as strings).
    run_id = await page.locator("#run-id").text_content()
    stream = (await gateway.http.get(f"/v1/runs/{run_id}/events")).text
    usage = [json.loads(line.removeprefix("data: ")) for line in stream.splitlines()
             if line.startswith("data: ")][-1]["result"]["usage"]
    assert "network_bytes_sent" not in usage  # the snippet's network is not stargrpc's
    # Every measured figure, in human units; nothing for what was not measured (network),
    # nor for the zeros every run has (queued time, child runs).
    assert list(shown) == ["wall", "CPU", "peak memory", "wrote"]
    assert shown["wall"] == f"{usage['wall_seconds']:.2f} s"
    user, system = re.fullmatch(r"([\d.]+) s user / ([\d.]+) s system", shown["CPU"]).groups()
    assert float(user) == pytest.approx(usage["cpu_user_seconds"], abs=0.006)
    assert float(system) == pytest.approx(usage["cpu_system_seconds"], abs=0.006)
    memory = re.fullmatch(r"([\d.]+) MiB", shown["peak memory"])
    assert memory and float(memory[1]) >= 64
    assert float(memory[1]) == pytest.approx(int(usage["peak_rss_bytes"]) / 2**20, abs=0.06)
    wrote = re.fullmatch(r"([\d.]+) KiB", shown["wrote"])
    assert wrote and float(wrote[1]) == pytest.approx(int(usage["bytes_written"]) / 1024,
                                                      abs=0.06)

    # An in-process tool measures its wall time only; the next run's receipt replaces this.
    await page.select_option("#tool", "echo")
    await page.fill("#arguments", json.dumps({"text": "hi"}))
    await page.click("#run-button")
    await expect(page.locator("#result-output-full")).to_have_text("hi")
    await expect(page.locator("#result-usage dt")).to_have_text(["wall"])
    await expect(page.locator("#result-usage dd")).to_have_text(re.compile(r"^\d+\.\d\d s$"))


async def test_a_file_the_tool_calls_html_is_offered_as_a_download_only(
        make_server, browser: Browser) -> None:
    """A sent file's link is a blob URL of this page's origin: opened in a tab (a middle
    click) a blob typed text/html was a page of this origin, the tool's markup rendered
    in it. The blob is typed as bytes whatever the tool says; the page still shows it."""
    from stargrpc import ToolContext, tool
    from stargrpc.registry import Registry, spec_of

    @tool(kind="test")
    async def html_file(ctx: ToolContext) -> str:
        """Send a file that calls itself HTML."""
        ctx.send_file("page.html", b"<h1 id='planted'>planted</h1>", "text/html")
        return "sent"

    spec = spec_of(html_file)
    assert spec is not None
    server = await make_server(registry=Registry([spec]), http_port=0)
    page = await browser.new_page()
    # What the page makes blob URLs of (its CSP keeps fetch() off them).
    await page.add_init_script("""
        window.blobTypes = [];
        const make = URL.createObjectURL;
        URL.createObjectURL = (blob) => { window.blobTypes.push(blob.type); return make(blob); };
    """)
    await page.goto(f"http://127.0.0.1:{server.http.gateway_port}/")
    await expect(page.locator("#tool option[value='html_file']")).to_have_count(1)
    await page.click("#run-button")
    await expect(page.locator("#result")).to_have_attribute("data-outcome", "OK")
    link = page.locator("#result-files a.download")
    await expect(link).to_have_attribute("download", "page.html")
    await expect(page.locator("#result-files")).to_contain_text("text/html")
    assert await page.evaluate("window.blobTypes") == ["application/octet-stream"]
