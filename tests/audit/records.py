"""Audit records for tests."""

from __future__ import annotations

import uuid
from typing import Any

from stargrpc.audit.record import AuditRecord, utc_now


def make_record(**fields: Any) -> AuditRecord:
    """A plausible Execute record; ``fields`` override."""
    values: dict[str, Any] = {
        "id": uuid.uuid4().hex, "time": utc_now(), "method": "/stargrpc.v1.ToolService/Execute",
        "peer": "ipv4:127.0.0.1:5555", "principal": "alice", "auth_method": "api_key",
        "tool": "echo", "run_id": uuid.uuid4().hex, "arguments": '{"text":"hi"}',
        "result": "hi", "outcome": "ok", "duration_ms": 1.5,
    }
    values.update(fields)
    return AuditRecord(**values)
