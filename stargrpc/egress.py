"""Where ``http_fetch`` may connect: a host allowlist, then address checks AFTER DNS.

:func:`vet_url` checks the URL's scheme and host against the allowlist, resolves the host,
refuses it if ANY of its addresses is private, loopback, link-local, a cloud metadata
address or otherwise not globally routable (unless an explicitly allowed network holds it),
and returns a :class:`VettedTarget` that connects to the vetted IP itself — the URL is
rewritten to the IP, with the original name kept in the Host header and as the TLS server
name (SNI and certificate check). No second lookup happens, so a DNS answer that changes
between the check and the connection (DNS rebinding) cannot slip in. Every redirect hop
goes through :func:`redirect_target` (only an absolute or path-relative http(s) Location
is followed) and then :func:`vet_url` again; :func:`origin` says whether a hop left the
origin the caller's headers were meant for.

Hosts are compared in one canonical form (IDNA ASCII, lower case, no trailing dot, IP
literals compressed), so the allowlist, the address checks and the connection all see
the same name. IPv4 written in the legacy numeric forms (``2130706433``, ``0x7f.1``,
``0``) and IPv6 zone ids are refused: parsers disagree on what they mean. An IPv6 address
that carries an IPv4 address (IPv4-mapped/-compatible, NAT64, 6to4, Teredo) is judged by
the IPv4 address it reaches.
"""

from __future__ import annotations

import asyncio
import fnmatch
import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from stargrpc.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Instance-metadata endpoints of the big clouds (AWS/GCP/Azure/OpenStack, AWS IPv6,
#: Alibaba), named as such in refusals.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "100.100.100.200"))


#: The NAT64 well-known prefix (RFC 6052): the IPv4 address is the last 32 bits.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
#: The local-use NAT64 prefix (RFC 8215): where the IPv4 address sits is the operator's
#: choice, so it cannot be judged and is refused.
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")
#: IPv4-compatible IPv6 (deprecated, RFC 4291): ``::a.b.c.d``.
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
#: A host whose last label is a number is an IPv4 address to URL parsers (WHATWG).
_NUMERIC_LABEL = re.compile(r"(0x[0-9a-f]*|[0-9]+)", re.IGNORECASE)


class Refused(Exception):
    """A URL http_fetch must not fetch; the message says why, for the caller.

    Attributes:
        code: HOST_NOT_ALLOWED, ADDRESS_REFUSED, BAD_URL or DNS_FAILED.
    """

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class BadRedirect(Exception):
    """A redirect whose ``Location`` is not a well-formed URL; the message says why."""


@dataclass(frozen=True)
class HttpPolicy:
    """Which hosts and addresses http_fetch may reach.

    Attributes:
        allowlist: Host names or IP literals; ``*.example.com`` matches subdomains. Kept
            in the canonical form of :func:`canonical_host`.
        allowed_networks: Networks allowed although not public (the escape hatch).
    """

    allowlist: tuple[str, ...] = ()
    allowed_networks: tuple[IPNetwork, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowlist",
                           tuple(_allowlist_entry(h) for h in self.allowlist))

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpPolicy:
        """The policy the server is configured with."""
        return cls(tuple(settings.http_fetch_allowlist),
                   tuple(ipaddress.ip_network(n, strict=False)
                         for n in settings.http_fetch_allowed_networks))

    def host_allowed(self, host: str) -> bool:
        """Whether ``host`` (any spelling of it) is on the allowlist."""
        name = canonical_host(host)
        return any(name == pattern or (pattern.startswith("*.") and
                                       fnmatch.fnmatchcase(name, pattern))
                   for pattern in self.allowlist)

    def address_problem(self, address: IPAddress) -> str | None:
        """Why ``address`` may not be reached, or None when it may.

        ``allowed_networks`` must hold the address connected to (for an IPv4-mapped one,
        the IPv4 address the kernel connects to); the IPv4 address inside a NAT64, 6to4,
        Teredo or IPv4-compatible address reaches another host and is always judged by
        the default rules.
        """
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if any(address in network for network in self.allowed_networks):
            return None
        if isinstance(address, ipaddress.IPv6Address):
            if address in _NAT64_LOCAL:
                return "a local-use NAT64 address"
            kind, embedded = _embedded_ipv4(address)
            for inner in embedded:
                problem = _public_problem(inner)
                if problem is not None:
                    return f"{kind} address embedding {inner} ({problem})"
        return _public_problem(address)


def _public_problem(address: IPAddress) -> str | None:
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_private:
        return "a private address"
    if not address.is_global or address.is_multicast:
        return "not a public address"
    return None


def _embedded_ipv4(address: ipaddress.IPv6Address
                   ) -> tuple[str, tuple[ipaddress.IPv4Address, ...]]:
    """The IPv4 addresses an IPv6 transition address leads to, with its kind."""
    if address.teredo is not None:
        return "a Teredo", address.teredo  # the relay server and the client
    if address.sixtofour is not None:
        return "a 6to4", (address.sixtofour,)
    low32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address in _NAT64:
        return "a NAT64", (low32,)
    if address in _IPV4_COMPATIBLE and int(address) > 1:  # not :: or ::1
        return "an IPv4-compatible", (low32,)
    return "", ()


def canonical_host(host: str) -> str:
    """``host`` as compared everywhere: IDNA ASCII, lower case, no trailing dot; an IP
    literal in its compressed form (no brackets)."""
    name = host.strip().lower().removeprefix("[").removesuffix("]")
    name = name[:-1] if name.endswith(".") else name
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    try:
        return httpx.URL(f"http://{name}/").raw_host.decode("ascii")
    except (httpx.InvalidURL, UnicodeError):
        return name


def _allowlist_entry(entry: str) -> str:
    entry = entry.strip().lower()
    if entry.startswith("*."):
        return "*." + canonical_host(entry[2:])
    return canonical_host(entry)


def origin(url: httpx.URL) -> tuple[str, str, int]:
    """Scheme, canonical host and port (the scheme's default when none is written)."""
    port = url.port or (443 if url.scheme == "https" else 80)
    return url.scheme, canonical_host(url.raw_host.decode("ascii")), port


def redirect_target(base: httpx.URL, location: str) -> httpx.URL:
    """The URL a redirect's ``Location`` leads to from ``base``, if it may be followed.

    Raises:
        BadRedirect: The Location is empty, holds whitespace, a control character or a
            backslash, or does not parse.
        Refused: It names a scheme other than http/https, is scheme-relative (``//host``)
            or carries credentials (code BAD_URL).
    """
    if not location:
        raise BadRedirect("the redirect has an empty Location")
    if any(ord(c) <= 0x20 or ord(c) == 0x7F or c == "\\" for c in location):
        raise BadRedirect(f"the redirect's Location {location!r:.200} holds whitespace, a "
                          "control character or a backslash")
    if location.startswith("//"):
        raise Refused(f"refused: a scheme-relative redirect ({location:.200}) is not followed",
                      "BAD_URL")
    try:
        following = base.join(location)
        _check_port(following)
    except httpx.InvalidURL as exc:
        raise BadRedirect(f"the redirect's Location {location!r:.200} is not a valid URL: "
                          f"{exc}") from exc
    if following.scheme not in ("http", "https"):
        raise Refused(f"refused: a redirect to a {following.scheme}: URL is not followed "
                      "(only http and https)", "BAD_URL")
    if following.userinfo:
        raise Refused("refused: a redirect to a URL with credentials in it is not followed",
                      "BAD_URL")
    return following


@dataclass(frozen=True)
class VettedTarget:
    """A URL whose connection goes to one vetted address.

    Attributes:
        url: The URL as given (with the host name).
        address: The vetted IP it connects to.
        request_url: The URL with the host replaced by ``address``.
        host_header: The Host header to send.
        extensions: httpx request extensions (the TLS server name).
    """

    url: httpx.URL
    address: IPAddress
    request_url: httpx.URL
    host_header: str
    extensions: dict[str, Any]


async def vet_url(url: str | httpx.URL, policy: HttpPolicy) -> VettedTarget:
    """Checks a URL and pins it to a vetted address.

    Raises:
        Refused: The scheme, host or any address of the host is not allowed.
    """
    try:
        parsed = httpx.URL(url)
        _check_port(parsed)
    except (httpx.InvalidURL, TypeError) as exc:
        raise Refused(f"not a valid URL: {exc}", "BAD_URL") from exc
    if parsed.scheme not in ("http", "https") or not parsed.raw_host:
        raise Refused(f"only http and https URLs with a host can be fetched, not {url!s:.200}",
                      "BAD_URL")
    _, host, port = origin(parsed)
    if parsed.userinfo:
        raise Refused("URLs with credentials in them are not fetched", "BAD_URL")
    _check_literal(host)
    if not policy.host_allowed(host):
        raise Refused(f"refused: {host} is not on the http_fetch allowlist", "HOST_NOT_ALLOWED")
    addresses = await _resolve(host, port)
    for address in addresses:
        problem = policy.address_problem(address)
        if problem is None:
            continue
        if host == str(address):
            raise Refused(f"refused: {host} is {problem}", "ADDRESS_REFUSED")
        raise Refused(f"refused: {host} resolves to {address}, {problem}", "ADDRESS_REFUSED")
    address = addresses[0]
    shown_host = f"[{host}]" if ":" in host else host
    host_header = shown_host if parsed.port is None else f"{shown_host}:{port}"
    return VettedTarget(
        url=parsed, address=address,
        request_url=parsed.copy_with(host=str(address)),
        host_header=host_header,
        extensions={"sni_hostname": host} if parsed.scheme == "https" else {})


def _check_port(url: httpx.URL) -> None:
    if url.port is not None and not 0 < url.port < 65536:
        raise httpx.InvalidURL(f"port {url.port} is out of range")


def _check_literal(host: str) -> None:
    """Refuses host spellings that parsers read differently."""
    if "%" in host:
        raise Refused(f"refused: {host} has a zone id; IPv6 zone ids are not fetched",
                      "BAD_URL")
    if ":" not in host and _NUMERIC_LABEL.fullmatch(host.rsplit(".", 1)[-1]):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise Refused(f"refused: {host} is not an IPv4 address in the standard dotted "
                          "form (a.b.c.d in decimal)", "BAD_URL") from None


async def _resolve(host: str, port: int) -> list[IPAddress]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise Refused(f"cannot resolve {host}: {exc.strerror or exc}", "DNS_FAILED") from exc
    addresses = _unique(ipaddress.ip_address(info[4][0]) for info in infos)
    if not addresses:
        raise Refused(f"cannot resolve {host}: no addresses", "DNS_FAILED")
    return addresses


def _unique(addresses: Iterable[IPAddress]) -> list[IPAddress]:
    seen: list[IPAddress] = []
    for address in addresses:
        if address not in seen:
            seen.append(address)
    return seen
