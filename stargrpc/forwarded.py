"""The HTTP client behind a call that the server's own HTTP front ends make.

The HTTP gateway and the MCP endpoint turn each HTTP request into a gRPC call of the same
server (in-process: :mod:`stargrpc.server.inprocess`), so the call's peer is the front end
itself (``inproc:gateway``, ``inproc:mcp``; ``127.0.0.1`` over a loopback channel). The
front end therefore vouches for the HTTP client's address in the call's metadata, and the
audit interceptor records that address instead — but only when the voucher checks out: it is
an HMAC of the address under a key that only the server's processes hold (derived from the
audit key, which every worker of one server reads; a random one when the audit store was
handed over without a key). Metadata any other gRPC caller sends, ``x-forwarded-for``
included, never changes the recorded peer.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable

#: The metadata naming the HTTP client, and the voucher for it.
CLIENT_METADATA = "stargrpc-http-client"
VOUCHER_METADATA = "stargrpc-http-client-voucher"

_LABEL = b"stargrpc http client voucher\0"


def peer_of(host: str) -> str:
    """An HTTP client's address as gRPC spells a peer, without the port: ``ipv4:1.2.3.4``,
    ``ipv6:[::1]``. (Without it, the streams of one client's tabs ask the same question
    and share one poll: :mod:`stargrpc.gateway.runs_watch`.)"""
    return f"ipv6:[{host}]" if ":" in host else f"ipv4:{host}"


class ForwardedClient:
    """Vouches for the HTTP client of a call (front ends) and checks the voucher (audit)."""

    _key: bytes

    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def from_secret(cls, secret: bytes) -> ForwardedClient:
        """The vouchers of a server whose processes share ``secret`` (the audit key's)."""
        return cls(hmac.new(secret, _LABEL, hashlib.sha256).digest())

    @classmethod
    def of_this_process(cls) -> ForwardedClient:
        """Vouchers only this process can make and check."""
        return cls(secrets.token_bytes(32))

    def _voucher(self, peer: str) -> str:
        return hmac.new(self._key, peer.encode(), hashlib.sha256).hexdigest()

    def metadata(self, peer: str) -> list[tuple[str, str]]:
        """The metadata that names ``peer`` (as :func:`peer_of` spells it) as the client."""
        return [(CLIENT_METADATA, peer), (VOUCHER_METADATA, self._voucher(peer))]

    def client_of(self, metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
        """The HTTP client a call's ``metadata`` names, if vouched for by this server's
        front ends; None otherwise (a gRPC caller's own call, or a forged name)."""
        peer = voucher = None
        for name, value in metadata:
            if name == CLIENT_METADATA:
                if peer is not None:
                    return None  # named twice: not what a front end sends
                peer = value
            elif name == VOUCHER_METADATA:
                voucher = value
        if not isinstance(peer, str) or not isinstance(voucher, str):
            return None
        return peer if hmac.compare_digest(voucher, self._voucher(peer)) else None
