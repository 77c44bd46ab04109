"""Reading and editing a fleet assertion (stargrpc.auth.fleet) the way an attacker would:
its payload decoded, changed, and put back beside the signature it had."""

from __future__ import annotations

import base64
import json
from typing import Any


def b64(data: bytes) -> str:
    """URL-safe base64 without padding, as assertions carry their parts."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def payload_of(assertion: str) -> dict[str, Any]:
    """The payload of ``assertion``, decoded (its signature not checked)."""
    encoded = assertion.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))))


def edited(assertion: str, **changes: Any) -> str:
    """``assertion`` with its payload changed and its signature kept."""
    version, _, signature = assertion.split(".")
    payload = {**payload_of(assertion), **changes}
    encoded = b64(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode())
    return f"{version}.{encoded}.{signature}"
