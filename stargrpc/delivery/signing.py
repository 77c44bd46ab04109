"""The ``stargrpc-signature`` header of a webhook delivery: ``t=<unix seconds>,v1=<hex>``,
where ``v1`` is the HMAC-SHA256, keyed with the server's delivery key, of ``"<t>.<body>"``
(the timestamp, a dot, then the request body's bytes). A receiver recomputes it with the
same key, compares in constant time, and refuses a timestamp too far from its clock (a
replayed request)."""

from __future__ import annotations

import hashlib
import hmac
import time

#: The header that carries the signature.
SIGNATURE_HEADER = "stargrpc-signature"


def sign(key: bytes, body: bytes, timestamp: int) -> str:
    """The header value signing ``body`` at ``timestamp`` (unix seconds)."""
    digest = hmac.new(key, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def verify(key: bytes, header: str, body: bytes, *, tolerance: float = 300.0,
           now: float | None = None) -> bool:
    """Whether ``header`` is a valid signature of ``body`` made within ``tolerance``
    seconds of ``now`` (default: the current time).

    Args:
        key: The delivery key the server signs with.
        header: The ``stargrpc-signature`` header as received.
        body: The request body, the exact bytes received.
        tolerance: Largest difference between the signature's time and ``now``.
        now: The receiver's clock, in unix seconds.
    """
    fields: dict[str, list[str]] = {}
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        fields.setdefault(name, []).append(value)
    try:
        timestamp = int(fields["t"][0])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance:
        return False
    expected = sign(key, body, timestamp).partition(",v1=")[2]
    return any(hmac.compare_digest(expected, given) for given in fields.get("v1", []))
