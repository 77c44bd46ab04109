"""Where ``http_fetch`` may connect: a host allowlist, then address checks AFTER DNS.

:func:`vet_url` checks the URL's scheme and host against the allowlist, resolves the host,
refuses it if ANY of its addresses is private, loopback, link-local, a cloud metadata
address or otherwise not globally routable (unless an explicitly allowed network holds it),
and returns a :class:`VettedTarget` that connects to the vetted IP itself — the URL is
rewritten to the IP, with the original name kept in the Host header and as the TLS server
name (SNI and certificate check). No second lookup happens, so a DNS answer that changes
between the check and the connection (DNS rebinding) cannot slip in. Every redirect hop
goes through :func:`vet_url` again.
"""

from __future__ import annotations

import asyncio
import fnmatch
import ipaddress
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


class Refused(Exception):
    """A URL http_fetch must not fetch; the message says why, for the caller.

    Attributes:
        code: HOST_NOT_ALLOWED, ADDRESS_REFUSED, BAD_URL or DNS_FAILED.
    """

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class HttpPolicy:
    """Which hosts and addresses http_fetch may reach.

    Attributes:
        allowlist: Host names or IP literals; ``*.example.com`` matches subdomains.
        allowed_networks: Networks allowed although not public (the escape hatch).
    """

    allowlist: tuple[str, ...] = ()
    allowed_networks: tuple[IPNetwork, ...] = field(default_factory=tuple)

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpPolicy:
        """The policy the server is configured with."""
        return cls(tuple(h.lower().rstrip(".") for h in settings.http_fetch_allowlist),
                   tuple(ipaddress.ip_network(n, strict=False)
                         for n in settings.http_fetch_allowed_networks))

    def host_allowed(self, host: str) -> bool:
        """Whether ``host`` is on the allowlist."""
        name = host.lower().rstrip(".")
        return any(name == pattern or (pattern.startswith("*.") and
                                       fnmatch.fnmatchcase(name, pattern))
                   for pattern in self.allowlist)

    def address_problem(self, address: IPAddress) -> str | None:
        """Why ``address`` may not be reached, or None when it may."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if any(address in network for network in self.allowed_networks):
            return None
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
    except (httpx.InvalidURL, TypeError) as exc:
        raise Refused(f"not a valid URL: {exc}", "BAD_URL") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise Refused(f"only http and https URLs with a host can be fetched, not {url!s:.200}",
                      "BAD_URL")
    host = parsed.host
    if parsed.userinfo:
        raise Refused("URLs with credentials in them are not fetched", "BAD_URL")
    if not policy.host_allowed(host):
        raise Refused(f"refused: {host} is not on the http_fetch allowlist", "HOST_NOT_ALLOWED")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
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
