"""http_fetch: GET or POST a URL on the allowlist, with every hop's address vetted.

Configuration (settings): ``http_fetch_allowlist`` (hosts; empty refuses all),
``http_fetch_allowed_networks`` (private networks allowed anyway), ``http_fetch_max_bytes``,
``http_fetch_timeout_seconds``, ``http_fetch_max_redirects``. Private, loopback, link-local
and metadata addresses are refused after DNS resolution, on every redirect hop, and the
connection goes to the address that was checked (see ``stargrpc.egress``). A redirect
to another origin (scheme, host or port) goes without the caller's headers and the
cookies collected so far.

The run's receipt (``Result.usage``) counts the HTTP messages of every hop: the requests
sent (request line, headers, body) and the responses received (status line, headers, and
the body as it came, before decompression); TLS and TCP/IP framing are not counted.
"""

from __future__ import annotations

import asyncio
import codecs
import re
import unicodedata
import zlib
from collections.abc import Iterator
from typing import Any, Literal

import httpx
from pydantic import BaseModel, Field, field_validator

from stargrpc import ToolContext, ToolDenied, ToolFailed, ToolResult, tool
from stargrpc.egress import (
    BadRedirect,
    HttpPolicy,
    Refused,
    origin,
    redirect_target,
    vet_url,
)

#: Headers a caller may not set: the server decides where the request goes.
_RESERVED_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}
#: Caller headers never sent past the first hop: a credential for a proxy this client
#: does not use.
_FIRST_HOP_HEADERS = {"proxy-authorization"}
#: A heartbeat at most every this many bytes received.
_PROGRESS_EVERY = 64 * 1024
#: Bytes a decompressor hands on at a time: what a body inflates to is produced piece by
#: piece, so that the byte cap stops it however much one compressed chunk would make.
_PIECE = 64 * 1024
#: Content codings decoded (as httpx does: others are left as they came), and how many
#: layers of them at most.
_CODINGS = {"gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}
_MAX_CODINGS = 4
#: Charsets a body is never decoded with: not encodings of text on the web, and
#: punycode's decoder takes time quadratic in the body (a 5 MB body would hold the
#: server's event loop for minutes).
_UNDECODED_CHARSETS = {"punycode", "idna"}
#: What HTTP/1.1 allows in a header name (a token) and value (visible ASCII, space, tab).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")


class HttpFetchArgs(BaseModel):
    url: str = Field(max_length=8192, description="http:// or https:// URL on the allowlist.")
    method: Literal["GET", "POST", "HEAD"] = Field("GET", description="HTTP method.")
    headers: dict[str, str] = Field(default_factory=dict, description="Request headers.")
    body: str = Field("", max_length=1_000_000, description="Request body (POST).")

    @field_validator("headers")
    @classmethod
    def _sendable(cls, headers: dict[str, str]) -> dict[str, str]:
        for name, value in headers.items():
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError(f"header name {name!r:.100} is not an HTTP token")
            if not _HEADER_VALUE.fullmatch(value):
                raise ValueError(f"header {name} holds a line break, a control character "
                                 "or non-ASCII text")
        return headers


@tool(kind="http", categories=("web",), open_world=True, read_only=True)
async def http_fetch(ctx: ToolContext, args: HttpFetchArgs) -> ToolResult:
    """Fetch a URL from an allowlisted host: status, headers and body (text, or a file).

    GET, POST or HEAD; private, loopback, link-local and metadata addresses are refused,
    on every redirect hop; size, time and redirects are capped.
    """
    settings = ctx.settings
    policy = HttpPolicy.from_settings(settings)
    headers = {k: v for k, v in args.headers.items() if k.lower() not in _RESERVED_HEADERS}
    method, body, url = args.method, args.body, args.url
    redirects: list[str] = []
    hop = 0  # the redirect hop being handled, for the reason of a refusal
    ctx.usage.add_network()  # measured from here on, even if no request goes out
    # trust_env=False: no proxy from the environment may take the request elsewhere.
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False,
                                 timeout=settings.http_fetch_timeout_seconds,
                                 event_hooks={"response": [_stop_at_redirect]}) as client:
        try:
            async with asyncio.timeout(settings.http_fetch_timeout_seconds):
                for _ in range(settings.http_fetch_max_redirects + 1):
                    async with ctx.step(f"{method} {url}", kind="http") as step:
                        target = await vet_url(url, policy)
                        request = client.build_request(
                            method, target.request_url, content=body.encode() or None,
                            headers={**headers, "Host": target.host_header},
                            extensions=target.extensions)
                        response = await _send(client, request)
                        ctx.usage.add_network(sent=_request_bytes(request),
                                              received=_response_head_bytes(response))
                        try:
                            await step.delta(f"HTTP {response.status_code} "
                                             f"{response.reason_phrase}\n")
                            if response.is_redirect:
                                hop += 1
                                following = redirect_target(target.url,
                                                            response.headers["location"])
                                redirects.append(str(following))
                                headers = {k: v for k, v in headers.items()
                                           if k.lower() not in _FIRST_HOP_HEADERS}
                                if origin(following) != origin(target.url):
                                    # Any caller header may be a credential for its origin.
                                    headers = {}
                                    client.cookies.clear()
                                if response.status_code in (301, 302, 303) and method == "POST":
                                    method, body = "GET", ""
                                url = str(following)
                                continue
                            data = (b"" if method == "HEAD" else  # a length, no body
                                    await _read_body(ctx, response,
                                                     settings.http_fetch_max_bytes))
                        finally:
                            await response.aclose()
                            ctx.usage.add_network(received=response.num_bytes_downloaded)
                    return _result(ctx, target.url, response, data, redirects)
        except Refused as exc:
            raise ToolDenied(f"{exc}{_hop(hop)}", code=exc.code) from exc
        except BadRedirect as exc:
            raise ToolFailed(f"{exc}{_hop(hop)}", code="HTTP_BAD_REDIRECT") from exc
        except TimeoutError as exc:
            raise ToolFailed(f"timed out after {settings.http_fetch_timeout_seconds:g} s",
                             code="HTTP_TIMEOUT") from exc
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise ToolFailed(f"request failed: {type(exc).__name__}: {exc}",
                             code="HTTP_ERROR") from exc
    raise ToolFailed(f"more than {settings.http_fetch_max_redirects} redirects",
                     code="TOO_MANY_REDIRECTS")


class _Redirected(Exception):
    """Raised by the response hook to hand a redirect back before httpx parses it."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code)
        self.response = response


async def _stop_at_redirect(response: httpx.Response) -> None:
    # Even when not following, httpx builds the next request from the Location itself
    # (and raises on a data: or malformed one); this hook returns the response first so
    # that redirect_target alone judges it.
    if response.is_redirect:
        raise _Redirected(response)


async def _send(client: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
    """The response, streaming; a redirect comes back closed (its body is not needed)."""
    try:
        return await client.send(request, stream=True)
    except _Redirected as redirected:
        return redirected.response


def _request_bytes(request: httpx.Request) -> int:
    """The size of ``request`` as HTTP/1.1 writes it: request line, headers, body."""
    line = len(request.method) + len(request.url.raw_path) + len(b"  HTTP/1.1\r\n")
    headers = sum(len(name) + len(value) + 4 for name, value in request.headers.raw)
    return line + headers + 2 + len(request.content)


def _response_head_bytes(response: httpx.Response) -> int:
    """The size of ``response``'s status line and headers as they came."""
    line = (len(response.http_version) + len(str(response.status_code))
            + len(response.reason_phrase) + 4)
    headers = sum(len(name) + len(value) + 4 for name, value in response.headers.raw)
    return line + headers + 2


def _hop(hop: int) -> str:
    """Which redirect hop a refusal is about ("" for the URL asked for)."""
    return f" (redirect hop {hop})" if hop else ""


async def _read_body(ctx: ToolContext, response: httpx.Response, cap: int) -> bytes:
    total = int(response.headers.get("content-length", "0") or 0) or None
    if total is not None and total > cap:
        raise ToolFailed(f"the response body ({total} bytes) is over the {cap} byte cap",
                         code="HTTP_TOO_LARGE")
    # Decompressed here, bounded, not by httpx: its decoders inflate a whole chunk at
    # once, so a few hundred bytes of "Content-Encoding: gzip, gzip" became gigabytes in
    # the server's memory (and its event loop) before any cap could be checked.
    inflate = _Inflater(response.headers.get_list("content-encoding", split_commas=True))
    chunks: list[bytes] = []
    received = reported = 0
    async for raw in response.aiter_raw():
        for chunk in inflate.feed(raw):
            received += len(chunk)
            if received > cap:
                raise ToolFailed(f"the response body is over the {cap} byte cap",
                                 code="HTTP_TOO_LARGE")
            chunks.append(chunk)
        if received - reported >= _PROGRESS_EVERY:
            reported = received
            # The share of the body as it comes (Content-Length counts it before decoding).
            await ctx.heartbeat(f"received {received} bytes",
                                progress=(min(response.num_bytes_downloaded / total, 1.0)
                                          if total else None))
    for chunk in inflate.end():
        received += len(chunk)
        if received > cap:
            raise ToolFailed(f"the response body is over the {cap} byte cap",
                             code="HTTP_TOO_LARGE")
        chunks.append(chunk)
    await ctx.heartbeat(f"received {received} bytes", progress=1.0)
    return b"".join(chunks)


class _Inflater:
    """Undoes a body's content codings (gzip, deflate; the others are left as they came,
    as httpx leaves them), yielding at most :data:`_PIECE` bytes at a time at every layer:
    the caller stops pulling at its cap, so what one compressed chunk would inflate to is
    never held at once."""

    def __init__(self, codings: list[str]) -> None:
        # Listed in the order they were applied: undone in the reverse order.
        names = [c.strip().lower() for c in codings if c.strip().lower() in _CODINGS]
        if len(names) > _MAX_CODINGS:
            raise ToolFailed(f"the response has {len(names)} layers of content coding; at "
                             f"most {_MAX_CODINGS} are decoded", code="HTTP_ERROR")
        self._layers = [_Layer(name) for name in reversed(names)]

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The decoded pieces of ``data``, the next raw bytes of the body."""
        return self._through(0, data)

    def end(self) -> Iterator[bytes]:
        """What the decompressors still hold at the end of the body."""
        for index, layer in enumerate(self._layers):
            for piece in layer.flush():
                yield from self._through(index + 1, piece)

    def _through(self, index: int, data: bytes) -> Iterator[bytes]:
        if index == len(self._layers):
            if data:
                yield data
            return
        for piece in self._layers[index].pieces(data):
            yield from self._through(index + 1, piece)


class _Layer:
    """One content coding being undone, its output in bounded pieces."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._first = name == "deflate"  # zlib-wrapped, else raw deflate (as httpx tries)
        self._inflate = zlib.decompressobj(_CODINGS[name])

    def pieces(self, data: bytes) -> Iterator[bytes]:
        while True:
            try:
                piece = self._inflate.decompress(data, _PIECE)
            except zlib.error as exc:
                if self._first:
                    self._first = False
                    self._inflate = zlib.decompressobj(-zlib.MAX_WBITS)
                    continue
                raise ToolFailed(f"request failed: the body's {self.name} coding is broken "
                                 f"({exc})", code="HTTP_ERROR") from exc
            self._first = False
            data = self._inflate.unconsumed_tail
            if piece:
                yield piece
            if not data and len(piece) < _PIECE:
                return

    def flush(self) -> Iterator[bytes]:
        # Every input was drained by pieces(): what is left is at most a last short piece.
        try:
            rest = self._inflate.flush()
        except zlib.error as exc:
            raise ToolFailed(f"request failed: the body's {self.name} coding is broken "
                             f"({exc})", code="HTTP_ERROR") from exc
        for start in range(0, len(rest), _PIECE):
            yield rest[start:start + _PIECE]


def _result(ctx: ToolContext, url: httpx.URL, response: httpx.Response, data: bytes,
            redirects: list[str]) -> ToolResult:
    content_type = response.headers.get("content-type", "")
    text = _as_text(data, content_type, response.charset_encoding)
    structured: dict[str, Any] = {
        "url": str(url),
        "status": response.status_code,
        "headers": dict(response.headers),
        "redirects": redirects,
        "bytes": len(data),
        "body": text,
        "file": None,
    }
    status_line = f"HTTP {response.status_code} {response.reason_phrase}"
    if text is not None:
        output = f"{status_line}\n\n{text}"
    else:
        sent = ctx.send_file(_file_name(url.path), data, content_type.split(";")[0].strip() or None)
        structured["file"] = sent.name
        output = (f"{status_line}\n\nbinary body ({sent.mime_type}, {len(data)} bytes) "
                  f"sent as file {sent.name}")
    return ToolResult(output=output, structured=structured)


def _file_name(path: str) -> str:
    """The name a body is sent under: the URL path's last segment (percent-decoded), made
    one that a caller saving the file by its name cannot be led astray by: a backslash
    (``%5C``) or a control character (``%00``, ``%0A``) becomes ``_``, and ``.``, ``..``
    or nothing becomes ``download`` (a decoded ``%2F`` already ends the segment)."""
    name = "".join("_" if char in "/\\" or unicodedata.category(char) == "Cc" else char
                   for char in path.rsplit("/", 1)[-1]).strip()
    return "download" if name in ("", ".", "..") else name


def _as_text(data: bytes, content_type: str, charset: str | None) -> str | None:
    """The body as text when it is textual and decodes cleanly, else None."""
    kind = content_type.split(";")[0].strip().lower()
    textual = (not kind or kind.startswith("text/") or kind.endswith(("+json", "+xml"))
               or kind in ("application/json", "application/xml", "application/javascript"))
    if not textual or b"\0" in data:
        return None
    try:
        if codecs.lookup(charset or "utf-8").name in _UNDECODED_CHARSETS:
            return None
        return data.decode(charset or "utf-8")
    except (LookupError, UnicodeDecodeError):
        return None
