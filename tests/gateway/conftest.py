"""Gateway fixtures: a real server with the HTTP gateway on an ephemeral port, an HTTP
client to it, and a tool that waits at a gate the test opens (so "while the run is still
going" is a fact of the test, not a matter of timing)."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from enum import StrEnum

import httpx
import pytest
from playwright.async_api import Browser, async_playwright
from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool
from stargrpc.registry import Registry, load_registry, spec_of
from stargrpc.server.grpc_server import StargrpcServer
from tests.conftest import ServerFactory

#: Gates by name; a test opens its gate to let the ``staged`` tool finish.
GATES: dict[str, asyncio.Event] = {}

#: A file too big to travel inline with the gateway fixture's settings (4 FileChunk events).
NUMBERS = ("n\n" + "\n".join(str(i) for i in range(800)) + "\n").encode()


class StagedArgs(BaseModel):
    gate: str = Field(description="The gate to wait at between the second and third step.")


@tool(kind="test")
async def staged(ctx: ToolContext, args: StagedArgs) -> str:
    """Two steps, a wait (inside the second) until the test opens the gate, a third step,
    then two files."""
    async with ctx.step("Fetching sources") as step:
        await step.delta("fetched 3 sources\n")
    async with ctx.step("Thinking") as step:
        await step.delta("considering…\n")
        await GATES[args.gate].wait()
        await step.delta("decided\n")
    async with ctx.step("Writing the report") as step:
        await step.delta("report written\n")
    ctx.send_file("report.txt", b"the report\n", "text/plain")
    ctx.send_file("numbers.csv", NUMBERS, "text/csv")  # over the inline limit: streamed
    return "staged run done"


class Mode(StrEnum):
    brief = "brief"
    full = "full"


class Limits(BaseModel):
    rows: int = Field(3, ge=1, le=10, description="Rows in the table.")
    strict: bool = Field(False, description="Fail on anything odd.")


class ReportArgs(BaseModel):
    title: str = Field(description="The report's title.")
    tags: list[str] = Field(default_factory=list, description="Labels for the report.")
    mode: Mode = Field(Mode.brief, description="How much to say.")
    draft: bool = Field(True, description="Mark it as a draft.")
    limits: Limits = Field(default_factory=Limits, description="Bounds of the report.")
    note: str | None = Field(None, description="An optional note.")


@tool(kind="test")
async def report(ctx: ToolContext, args: ReportArgs) -> dict[str, object]:
    """Post a report as rich messages: markdown, a table, an image and a link card."""
    async with ctx.step("Composing") as step:
        await step.delta("composing the report\n")
    ctx.send_rich_message("markdown", {"markdown": f"# {args.title}\n\nAll **{args.mode.value}** "
                                       "checks passed.\n\n- fast\n- *calm*\n\n"
                                       "<script>alert(1)</script>"})
    ctx.send_rich_message("table", {"title": "Scores", "columns": ["name", "score"],
                                    "rows": [[f"row {i}", i * 10]
                                             for i in range(args.limits.rows)]})
    ctx.send_rich_message("image", {"url": PIXEL, "alt": "a green square"})
    ctx.send_rich_message("link", {"url": "https://example.com/report", "title": "Full report",
                                   "description": "Everything in one place."})
    return {"title": args.title, "tags": args.tags, "nested": {"rows": args.limits.rows}}


class PictureArgs(BaseModel):
    url: str = Field(description="Where the image is (https://… or data:image/…).")


@tool(kind="test")
async def picture(ctx: ToolContext, args: PictureArgs) -> str:
    """Post one image rich message."""
    ctx.send_rich_message("image", {"url": args.url, "alt": "a picture"})
    return "posted"


#: A 2x2 green PNG.
PIXEL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAEklEQVR4nGNg"
         "YGD4z8DAwMDAAAAOAgHvt0VGSgAAAABJRU5ErkJggg==")


def gateway_registry() -> Registry:
    """The bundled tools plus ``staged``, ``report`` and ``picture``."""
    bundled = load_registry(bundled=True, entry_points=False)
    extra = [spec_of(staged), spec_of(report), spec_of(picture)]
    assert None not in extra
    return Registry([*bundled.values(), *extra])  # type: ignore[list-item]


@dataclass
class GatewayUnderTest:
    server: StargrpcServer
    base_url: str
    http: httpx.AsyncClient


@pytest.fixture
async def gateway(make_server: ServerFactory) -> AsyncIterator[GatewayUnderTest]:
    """A server with the gateway on, and an HTTP client pointed at it."""
    server = await make_server(registry=gateway_registry(), http_port=0,
                               inline_file_bytes=1024, file_chunk_bytes=1024)
    base_url = f"http://127.0.0.1:{server.http.gateway_port}"
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        yield GatewayUnderTest(server, base_url, http)


@pytest.fixture
def gate() -> Iterator[tuple[str, asyncio.Event]]:
    """A fresh gate for the ``staged`` tool; opened at teardown so no run is left waiting."""
    name = uuid.uuid4().hex
    event = GATES[name] = asyncio.Event()
    yield name, event
    event.set()
    GATES.pop(name, None)


#: Debian's Chromium, which the page tests drive (scripts/test.sh installs it).
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking"]


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    """A headless Chromium (Playwright drives Debian's; its own browser download is never
    used)."""
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM,
                                                   args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            await browser.close()
