"""What an audit record shows of a run's arguments and result.

One computation for the audit interceptor and for :func:`stargrpc.testing.run_tool`, so a
tool author sees in a test exactly what the audit of a real server would keep: the tool's
own ``ctx.audit_view(...)`` when it gave one, else the arguments and the result, redacted
of secrets and cut to the configured lengths.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from stargrpc.audit.redact import RedactionLimits, redacted_json, scrub_and_cut
from stargrpc.runs.usage import usage_json
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2

#: Longest ``detail`` kept in a record.
MAX_DETAIL_CHARS = 300


@dataclass(frozen=True)
class AuditLimits:
    """How much of a run's arguments and result the audit keeps.

    Attributes:
        values: The limits for arguments (and structured results).
        max_result_chars: Longest result text kept.
    """

    values: RedactionLimits
    max_result_chars: int

    @classmethod
    def from_settings(cls, settings: Settings) -> AuditLimits:
        """The limits ``settings`` configure."""
        return cls(RedactionLimits(max_value_chars=settings.audit_max_value_chars,
                                   max_total_chars=settings.audit_max_arguments_chars),
                   settings.audit_max_result_chars)

    def arguments_text(self, arguments: Mapping[str, Any] | None) -> str:
        """The arguments as the audit records them (redacted JSON; empty for none)."""
        return redacted_json(arguments, self.values) if arguments is not None else ""

    def invocation_text(self, invocation: Mapping[str, Any] | None) -> str:
        """The invocation context as the audit records it (redacted JSON; empty for none)."""
        return redacted_json(invocation, self.values) if invocation else ""

    @staticmethod
    def detail_text(detail: str) -> str:
        """The detail as the audit records it: scrubbed of secrets, cut."""
        return scrub_and_cut(detail, MAX_DETAIL_CHARS)

    @staticmethod
    def usage_text(result: events_pb2.Result | None) -> str:
        """What the run used, as the audit records it: the measured figures of the
        Result's ``usage`` as compact JSON ("" without a Result or a usage). Numbers only,
        so nothing to redact."""
        return usage_json(result)

    def result_text(self, result: events_pb2.Result | None, substitute: str | None) -> str:
        """The result as the audit records it: ``substitute`` when the tool (or the call)
        chose what the audit shows, else the structured output or the output text."""
        # Text is scrubbed of the secrets written inside it (a DSN's password, a token in
        # a URL), whoever chose it: a tool's own audit view may quote what it was given.
        if substitute is not None:
            return scrub_and_cut(substitute, self.max_result_chars)
        if result is None:
            return ""
        if result.HasField("structured_output"):
            structured = json_format.MessageToDict(result.structured_output)
            limits = RedactionLimits(self.values.max_value_chars, self.values.max_items,
                                     self.values.max_depth, self.max_result_chars)
            return redacted_json(structured, limits)
        return scrub_and_cut(result.output, self.max_result_chars)


@dataclass(frozen=True)
class AuditView:
    """What the audit record of one run shows.

    Attributes:
        arguments_text: The arguments, as redacted JSON text.
        result: The result text.
    """

    arguments_text: str
    result: str

    @property
    def arguments(self) -> Any:
        """The recorded arguments, parsed (None when none were recorded)."""
        return json.loads(self.arguments_text) if self.arguments_text else None
