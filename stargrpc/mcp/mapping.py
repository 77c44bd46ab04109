"""stargrpc's messages as MCP's: catalog tools, run events as progress, Results as
``CallToolResult``s, refused calls as tool errors or JSON-RPC errors.

A Result becomes a ``CallToolResult`` that says what the tool said, each part where MCP
clients look for it (a model is often shown ``structuredContent`` instead of the text when
there is one, as the specification allows):

- ``content``: the output text, whole up to :data:`MAX_TEXT_CHARS`; a longer one shows its
  beginning, a line saying how much was left out, and a ``resource_link`` to the whole
  text, :data:`OUTPUT_URI` of the run, which ``resources/read`` answers with the caller's
  own credentials for as long as the run is kept. Then each sent file as an embedded
  resource.
- ``structuredContent``: the structured output, only when it is the tool's result — the
  tool declares an output schema (MCP then requires it), or the text is that object as
  JSON. Otherwise (a sandboxed tool's exit status and verdict, an HTTP response's
  headers: facts about the run beside its text) it is ``_meta``'s
  :data:`STRUCTURED_META_KEY`.
- ``_meta``: the run's id, outcome, error code, write-back and, when the text was cut,
  :data:`OUTPUT_META_KEY`.

Pure functions: nothing here talks to a network.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field
from typing import Any

import grpc
import mcp_types as types
from google.protobuf import json_format
from mcp.shared.exceptions import MCPError

from stargrpc.client._files import StreamedFiles
from stargrpc.client.errors import CallError
from stargrpc.runs.event_sizes import OUTPUT_FILE_NAME
from stargrpc.runs.result_fit import moved_file_id
from stargrpc.v1 import catalog_pb2, events_pb2

#: ``_meta`` key of a ``tools/call`` request: the run's idempotency key (a repeated key from
#: the same caller attaches to the first run or replays its Result instead of running again).
IDEMPOTENCY_META_KEY = "stargrpc.dev/idempotency-key"

#: A listed tool's ``execution`` (2025-11-25): every call may be a task (every run is one).
TASK_SUPPORT = types.ToolExecution(task_support="optional")

#: ``_meta`` keys of a ``CallToolResult``.
RUN_ID_META_KEY = "stargrpc.dev/run-id"
OUTCOME_META_KEY = "stargrpc.dev/outcome"
ERROR_CODE_META_KEY = "stargrpc.dev/error-code"
WRITEBACK_META_KEY = "stargrpc.dev/writeback"
#: The structured output when it is not the tool's result but facts about the run.
STRUCTURED_META_KEY = "stargrpc.dev/structured-output"
#: Set when the text was cut: ``{"uri", "chars", "shown_chars"}`` of the whole output.
OUTPUT_META_KEY = "stargrpc.dev/output"

#: The longest output text a ``CallToolResult`` carries whole, in characters. About 25,000
#: tokens: what MCP clients such as Claude Code take into a model's context by default
#: before they cut or refuse a tool's answer themselves, without saying what was lost.
MAX_TEXT_CHARS = 100_000

#: The resource that holds the whole output of a run (``resources/read``).
OUTPUT_URI = "stargrpc://runs/{run_id}/output"
_OUTPUT_URI = re.compile(r"stargrpc://runs/([A-Za-z0-9_.:-]{1,200})/output")
#: The run's receipt (Result.usage): its measured figures by field name, as numbers.
USAGE_META_KEY = "stargrpc.dev/usage"

#: JSON-RPC error code of a call refused for missing or rejected credentials (the
#: implementation-defined range of JSON-RPC; MCP defines none for this).
UNAUTHENTICATED = -32001

#: JSON-RPC error code of a session refused because its principal holds as many as
#: ``mcp_max_sessions_per_principal`` (answered with HTTP 429).
TOO_MANY_SESSIONS = -32003

#: The longest part of the latest delta shown in a progress message.
MAX_DELTA_CHARS = 200

_OUTCOMES = {value: name.removeprefix("OUTCOME_")
             for name, value in events_pb2.Outcome.items()}


def mcp_tool(tool: catalog_pb2.Tool) -> types.Tool:
    """A catalog tool as MCP lists it (schemas, annotations from the tool's declaration)."""
    notes = tool.annotations
    # Whole numbers as integers: a Struct holds every number as a double, and a schema's
    # "minimum": 1.0 on an integer is what a strictly typed client may refuse.
    output_schema = (_whole_numbers(json_format.MessageToDict(tool.output_schema))
                     if tool.HasField("output_schema") else None)
    if output_schema is not None and output_schema.get("type") != "object":
        output_schema = None  # MCP only takes object schemas; the text output still says it
    meta: dict[str, Any] = {"stargrpc.dev/kind": tool.kind}
    if tool.categories:
        meta["stargrpc.dev/categories"] = list(tool.categories)
    return types.Tool(
        name=tool.name,
        description=tool.description,
        input_schema=_whole_numbers(json_format.MessageToDict(tool.input_schema))
        or {"type": "object"},
        output_schema=output_schema,
        annotations=types.ToolAnnotations(
            read_only_hint=notes.read_only, destructive_hint=notes.destructive,
            idempotent_hint=notes.idempotent, open_world_hint=notes.open_world),
        _meta=meta,
    )


@dataclass
class ProgressView:
    """What a run has shown so far, turned into one progress line per event.

    ``progress`` is the event's seq: it grows with every event, as MCP requires.
    """

    titles: dict[str, str] = field(default_factory=dict)
    current: str = ""
    files: StreamedFiles = field(default_factory=StreamedFiles)

    def message(self, event: events_pb2.RunEvent) -> str | None:
        """The progress message of ``event``; None for events that show nothing (file
        chunks, which are kept for the Result instead)."""
        kind = event.WhichOneof("kind")
        if kind == "step":
            step = event.step
            title = step.step.title or self.titles.get(step.step.id, "") or step.step.kind
            if step.phase == events_pb2.STEP_PHASE_START:
                self.titles[step.step.id] = title
                self.current = title
                return title
            if step.phase == events_pb2.STEP_PHASE_DELTA:
                text = step.delta.strip()
                if len(text) > MAX_DELTA_CHARS:
                    text = "…" + text[-MAX_DELTA_CHARS:]
                return f"{title}: {text}" if text else title
            status = events_pb2.StepStatus.Name(step.step.status).removeprefix("STEP_STATUS_")
            return f"{title}: {status.lower()}"
        if kind == "heartbeat":
            beat = event.heartbeat
            text = beat.message or (f"{self.current}: working" if self.current else "working")
            if beat.HasField("progress"):
                text += f" ({beat.progress:.0%})"
            return text
        if kind == "notice":
            return f"{event.notice.code}: {event.notice.message}"
        if kind == "file_chunk":
            chunk = event.file_chunk
            self.files.add(chunk.file_id, chunk.offset, chunk.data)
        return None


def call_result(final: events_pb2.RunEvent, view: ProgressView | None = None, *,
                declares_output_schema: bool = False) -> types.CallToolResult:
    """The ``CallToolResult`` of a run's final event.

    Args:
        final: The run's last event (its ``result``).
        view: What the run streamed before: the content of files sent in chunks.
        declares_output_schema: The tool lists an (object) output schema over MCP, so its
            structured output is its structured content.
    """
    result = final.result
    run_id = final.run_id
    outcome = _OUTCOMES.get(result.outcome, "UNSPECIFIED")
    ok = result.outcome == events_pb2.OUTCOME_OK
    chunks = view.files if view is not None else StreamedFiles()
    whole = output_text(result, run_id, chunks)
    shown, link = _shown_output(whole, run_id)
    if ok:
        text = shown
    else:
        text = f"{outcome} [{result.error.code or outcome}]: {result.error.message}".rstrip(": ")
        if shown:
            text += f"\n{shown}"
    content: list[types.ContentBlock] = [types.TextContent(text=text)]
    meta: dict[str, Any] = {RUN_ID_META_KEY: run_id, OUTCOME_META_KEY: outcome}
    if link is not None:
        content.append(link)
        meta[OUTPUT_META_KEY] = {"uri": link.uri, "chars": len(whole),
                                 "shown_chars": MAX_TEXT_CHARS}
    moved = moved_file_id(run_id, OUTPUT_FILE_NAME)
    for sent in result.writeback.sent_files:
        if sent.file_id == moved and sent.streamed:
            continue  # the output text itself, shown above (and linked when cut)
        data = (chunks.content(sent.file_id, sent.size, sent.sha256) or b"") if sent.streamed \
            else sent.content
        content.append(_file_content(run_id, sent, data))
    structured = None
    if result.HasField("structured_output"):
        value = _whole_numbers(json_format.MessageToDict(result.structured_output))
        if isinstance(value, dict) and ok and (declares_output_schema
                                               or _is_json_of(result.output, value)):
            structured = value
        else:
            meta[STRUCTURED_META_KEY] = value
    if not ok:
        meta[ERROR_CODE_META_KEY] = result.error.code or outcome
    if result.writeback.injected_tools or result.writeback.sent_rich_messages:
        shown_writeback = events_pb2.WriteBack()
        shown_writeback.CopyFrom(result.writeback)
        del shown_writeback.sent_files[:]
        meta[WRITEBACK_META_KEY] = json_format.MessageToDict(shown_writeback)
    if result.HasField("usage"):  # the run's receipt: its measured figures, as numbers
        meta[USAGE_META_KEY] = {field.name: value for field, value in result.usage.ListFields()}
    return types.CallToolResult(content=content, structured_content=structured,
                                is_error=not ok, _meta=meta)


def output_text(result: events_pb2.Result, run_id: str, chunks: StreamedFiles) -> str:
    """The whole output text of a Result: ``output``, or, when it was too large for the
    Result, the sent file it moved into (put back together from ``chunks``; what the
    Result kept, its beginning and a marker, if the chunks are not all there)."""
    moved = moved_file_id(run_id, OUTPUT_FILE_NAME)
    for sent in result.writeback.sent_files:
        if sent.file_id == moved and sent.streamed:
            data = chunks.content(sent.file_id, sent.size, sent.sha256)
            if data is not None:
                return data.decode("utf-8", errors="replace")
    return result.output


def output_uri(run_id: str) -> str:
    """The URI of the resource holding the whole output of run ``run_id``."""
    return OUTPUT_URI.format(run_id=run_id)


def run_of_output_uri(uri: str) -> str | None:
    """The run whose output ``uri`` names, or None when it names none."""
    found = _OUTPUT_URI.fullmatch(uri)
    return found.group(1) if found else None


def _shown_output(whole: str, run_id: str) -> tuple[str, types.ResourceLink | None]:
    """The output as the text content shows it and, when it is cut, the link to all of it."""
    if len(whole) <= MAX_TEXT_CHARS:
        return whole, None
    uri = output_uri(run_id)
    size = len(whole.encode())
    note = (f"\n[output truncated: these are the first {MAX_TEXT_CHARS} of {len(whole)} "
            f"characters; the whole output is the resource {uri} (resources/read)]")
    link = types.ResourceLink(
        uri=uri, name="output", title="The whole output", mime_type="text/plain",
        size=size, description=f"All {len(whole)} characters ({size} bytes) of the output "
        f"of run {run_id}")
    return whole[:MAX_TEXT_CHARS] + note, link


def _is_json_of(text: str, value: dict[str, Any]) -> bool:
    """Whether ``text`` is ``value`` as JSON: what a tool that returns data gives as text."""
    if not text.startswith("{"):
        return False
    try:
        parsed = json.loads(text)
    except ValueError:
        return False
    return bool(_whole_numbers(parsed) == value)


def _whole_numbers(value: Any) -> Any:
    """``3.0`` → ``3`` at any depth: a protobuf Value holds every number as a double, and
    an output schema that says "integer" must still accept what the tool returned."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _whole_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    return value


def _file_content(run_id: str, sent: events_pb2.SentFile, data: bytes
                  ) -> types.EmbeddedResource:
    uri = f"stargrpc://runs/{run_id}/files/{sent.file_id or sent.name}/{sent.name}"
    mime = sent.mime_type or "application/octet-stream"
    resource: types.TextResourceContents | types.BlobResourceContents
    if mime.startswith("text/"):
        try:
            resource = types.TextResourceContents(uri=uri, mime_type=mime,
                                                  text=data.decode("utf-8"))
        except UnicodeDecodeError:
            resource = types.BlobResourceContents(
                uri=uri, mime_type=mime, blob=base64.b64encode(data).decode())
    else:
        resource = types.BlobResourceContents(uri=uri, mime_type=mime,
                                              blob=base64.b64encode(data).decode())
    return types.EmbeddedResource(resource=resource, _meta={"stargrpc.dev/sha256": sent.sha256})


def refusal(error: CallError, tool_name: str) -> types.CallToolResult:
    """A call refused before its run started, as the tool error the model reads.

    Raises:
        MCPError: The refusals that are protocol errors, not tool errors: an unknown tool
            (INVALID_PARAMS, as MCP specifies) and missing or rejected credentials.
    """
    reason = error.reason or error.code.name
    data = {"grpc_code": error.code.name, "reason": reason}
    if error.code is grpc.StatusCode.NOT_FOUND:
        raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {tool_name}", data)
    if error.code is grpc.StatusCode.UNAUTHENTICATED:
        raise MCPError(UNAUTHENTICATED, error.message or "unauthenticated", data)
    lines = [f"{error.code.name} [{reason}]: {error.message}"]
    lines += [f"- {v.field}: {v.description}" for v in error.violations]
    if error.retry_delay is not None:
        lines.append(f"retry after {error.retry_delay:g} s")
    return types.CallToolResult(
        content=[types.TextContent(text="\n".join(lines))], is_error=True,
        _meta={OUTCOME_META_KEY: "REFUSED", ERROR_CODE_META_KEY: reason})


def protocol_error(error: CallError) -> MCPError:
    """A refused ListTools / WatchCatalog as the JSON-RPC error of the MCP request."""
    data = {"grpc_code": error.code.name, "reason": error.reason or error.code.name}
    code = (UNAUTHENTICATED if error.code is grpc.StatusCode.UNAUTHENTICATED
            else types.INTERNAL_ERROR)
    return MCPError(code, error.message or error.code.name, data)
