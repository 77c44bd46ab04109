"""What a browser may ask of the server's HTTP front ends (the gateway and the MCP endpoint).

A web page on another origin can make a browser send requests to ``127.0.0.1``: a
``<form>`` or a ``fetch(…, {mode: "no-cors"})`` POSTs ``text/plain`` or form bodies without
any preflight, and DNS rebinding lets a page of ``attacker.example`` read the answers (its
name is made to resolve to the loopback address, the browser then sends
``Host: attacker.example``). Credentials do not protect a server started with
``insecure_no_auth``. :class:`RequestGuard` refuses, on every route and whatever the
authentication:

- a ``Host`` that is not this server's (``421``): an IP address and ``localhost`` always are
  (no page can bring its own name to them), other names only when allowed
  (``http_allowed_hosts``); so a rebound name is refused on reads too;
- an ``Origin`` other than the request's own (``403``), unless allowed
  (``http_allowed_origins``): browsers name the origin of every cross-origin POST;
- with ``json_only``, a POST whose body is not ``application/json`` (``415``): the only
  types a page may POST cross-origin without asking first are ``text/plain``, form data
  and url-encoded forms.

The page served by the gateway passes: its own fetches are same-origin and POST JSON.
Clients that are not browsers send no ``Origin`` and pass as long as they name the server
in ``Host`` (as every HTTP client does by itself) and send JSON.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

#: Host names that always reach this machine, whatever DNS says.
LOOPBACK_NAMES = frozenset({"localhost"})

_DEFAULT_PORTS = {"http": 80, "https": 443}


def split_host(authority: str) -> tuple[str, int | None]:
    """``host[:port]`` (IPv6 in brackets) → (lower-case host without brackets, port or None).

    Raises:
        ValueError: ``authority`` is not a host with an optional port.
    """
    authority = authority.strip().lower()
    if authority.startswith("["):
        host, _, rest = authority[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(f"not a host: {authority!r}")
        port_text = rest[1:]
    else:
        host, _, port_text = authority.partition(":")
    if not host or any(c in host for c in "/@?# \\"):
        raise ValueError(f"not a host: {authority!r}")
    if not port_text:
        return host, None
    if not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"not a port: {port_text!r}")
    return host, int(port_text)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class HostRule:
    """One entry of ``http_allowed_hosts``: ``name``, ``name:port``, ``*.domain`` (any name
    below it) or ``*`` (any host: for a proxy that checks ``Host`` itself)."""

    any_host: bool
    host: str
    port: int | None
    subdomains: bool

    def __init__(self, entry: str) -> None:
        """Raises:
            ValueError: ``entry`` is none of the forms above.
        """
        entry = entry.strip().lower()
        self.any_host = entry == "*"
        self.subdomains = entry.startswith("*.")
        self.host, self.port = ("", None) if self.any_host else split_host(
            entry[2:] if self.subdomains else entry)
        if "*" in self.host:
            raise ValueError(f"a wildcard only as '*' or '*.domain': {entry!r}")

    def matches(self, host: str, port: int | None) -> bool:
        """Whether ``host`` (lower case) on ``port`` is allowed by this entry."""
        if self.any_host:
            return True
        if self.port is not None and port != self.port:
            return False
        return host.endswith("." + self.host) if self.subdomains else host == self.host


def normal_origin(origin: str) -> str:
    """An origin as ``scheme://host:port`` (lower case, default port spelled out).

    Raises:
        ValueError: ``origin`` is not ``scheme://host[:port]``.
    """
    parts = urlsplit(origin.strip())
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or parts.path not in ("", "/") or parts.query \
            or parts.username is not None:
        raise ValueError(f"not an http(s) origin: {origin!r}")
    host, port = split_host(parts.netloc)
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port or _DEFAULT_PORTS[scheme]}"


class RequestGuard:
    """ASGI middleware refusing requests a browser was made to send from elsewhere (see
    the module docstring).

    Attributes:
        host_rules: The allowed names besides IP addresses and ``localhost``.
        origins: The allowed origins besides the request's own (:func:`normal_origin`).
        json_only: Refuse a POST whose body is not JSON.
    """

    host_rules: list[HostRule]
    origins: frozenset[str]
    json_only: bool

    def __init__(self, app: ASGIApp, *, allowed_hosts: Iterable[str] = (),
                 allowed_origins: Iterable[str] = (), json_only: bool = True) -> None:
        """Raises:
            ValueError: An allowed host or origin is malformed.
        """
        self.app = app
        self.host_rules = [HostRule(entry) for entry in allowed_hosts]
        self.origins = frozenset(normal_origin(entry) for entry in allowed_origins)
        self.json_only = json_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope["method"], Headers(scope=scope))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, code, message = refusal
        # The error shape of the gateway (stargrpc.gateway.http_errors), which this module
        # may not import: settings check the allowlists with it.
        body = {"error": {"code": status, "status": code, "message": message, "details": []}}
        await JSONResponse(body, status_code=status)(scope, receive, send)

    def refusal(self, method: str, headers: Headers) -> tuple[int, str, str] | None:
        """Why a request with ``method`` and ``headers`` is refused (HTTP status, status
        name, message), or None when it may go on."""
        authority = headers.get("host", "")
        try:
            host, port = split_host(authority)
        except ValueError:
            return 421, "PERMISSION_DENIED", "the request names no valid Host"
        if not self._host_allowed(host, port):
            return (421, "PERMISSION_DENIED", f"this server does not answer to the host "
                    f"{host[:100]!r} (add it to http_allowed_hosts if it is this server's)")
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, authority):
            return (403, "PERMISSION_DENIED", f"requests from the origin {origin[:100]!r} are "
                    "refused (add it to http_allowed_origins to allow it)")
        if self.json_only and method == "POST" and not _json_or_empty(headers):
            return (415, "INVALID_ARGUMENT",
                    "the body must be JSON: send Content-Type: application/json")
        return None

    def _host_allowed(self, host: str, port: int | None) -> bool:
        if _is_ip(host) or host in LOOPBACK_NAMES:
            return True
        return any(rule.matches(host, port) for rule in self.host_rules)

    def _origin_allowed(self, origin: str, authority: str) -> bool:
        try:
            given = normal_origin(origin)  # "null" (a sandboxed or local page) is refused
        except ValueError:
            return False
        if given in self.origins:
            return True
        # The scheme is the origin's own: behind a proxy ending TLS the page is https and
        # this server plain http on the same Host; and no other page can be served from
        # this host and port under the other scheme while this server holds the port.
        scheme = given.partition("://")[0]
        try:
            own = normal_origin(f"{scheme}://{authority}")
        except ValueError:
            return False
        return given == own


def _json_or_empty(headers: Headers) -> bool:
    """Whether a POST carries a JSON body, or no body and no type at all."""
    content_type = headers.get("content-type")
    if content_type is None:
        return (headers.get("content-length", "0").strip() == "0"
                and "transfer-encoding" not in headers)
    media_type = content_type.partition(";")[0].strip().lower()
    return media_type == "application/json"
