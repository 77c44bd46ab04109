"""``stargrpc tools`` and ``stargrpc call``: talk to a running server."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

import click
import grpc
from google.protobuf import json_format

from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc

#: Exit status of ``stargrpc call`` per outcome; 0 only for OK.
EXIT_CODES = {
    events_pb2.OUTCOME_OK: 0,
    events_pb2.OUTCOME_DENIED: 3,
    events_pb2.OUTCOME_FAILED: 4,
    events_pb2.OUTCOME_ERROR: 5,
    events_pb2.OUTCOME_TIMEOUT: 6,
    events_pb2.OUTCOME_CANCELLED: 7,
}
EXIT_RPC_ERROR = 1

target_option = click.option(
    "--target", envvar="STARGRPC_TARGET", default="localhost:50051", show_default=True,
    help="Server address [env STARGRPC_TARGET].")


def _rpc_error(exc: grpc.RpcError) -> None:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    click.echo(f"error: {code.name if code else 'RPC'}: {details}", err=True)
    sys.exit(EXIT_RPC_ERROR)


@click.command()
@target_option
@click.option("--json", "as_json", is_flag=True, help="Print the catalog as JSON.")
def tools(target: str, as_json: bool) -> None:
    """List the tools of a running server."""
    with grpc.insecure_channel(target) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        try:
            reply = stub.ListTools(tool_service_pb2.ListToolsRequest(), timeout=30)
        except grpc.RpcError as exc:
            _rpc_error(exc)
            return
    if as_json:
        click.echo(json_format.MessageToJson(reply, preserving_proto_field_name=True))
        return
    width = max((len(t.name) for t in reply.tools), default=4)
    for item in reply.tools:
        flags = " [privileged]" if item.permissions.privileged else ""
        click.echo(f"{item.name.ljust(width)}  {item.description}{flags}")
    click.echo(f"catalog {reply.catalog_hash}", err=True)


@click.command()
@target_option
@click.argument("tool_name")
@click.option("--args", "arguments", default="{}", show_default=True,
              help="Arguments as a JSON object.")
@click.option("--json", "as_json", is_flag=True, help="Print each event as one JSON line.")
@click.option("--idempotency-key", default="", help="Repeat a key to attach to or replay a run.")
@click.option("--timeout", type=float, default=None, help="gRPC deadline in seconds.")
def call(target: str, tool_name: str, arguments: str, as_json: bool, idempotency_key: str,
         timeout: float | None) -> None:
    """Run a tool and show its steps and output live. Exits 0 only when the outcome is OK."""
    try:
        parsed = json.loads(arguments)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint="--args") from exc
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--args")
    request = tool_service_pb2.ExecuteRequest(tool_name=tool_name, arguments_json=arguments,
                                              idempotency_key=idempotency_key)
    renderer = JsonRenderer(sys.stdout) if as_json else TextRenderer(sys.stdout)
    outcome = None
    with grpc.insecure_channel(target) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        try:
            for response in stub.Execute(request, timeout=timeout):
                renderer.render(response.event)
                if response.event.HasField("result"):
                    outcome = response.event.result.outcome
        except grpc.RpcError as exc:
            renderer.close()
            _rpc_error(exc)
            return
    renderer.close()
    sys.exit(EXIT_CODES.get(outcome, EXIT_RPC_ERROR) if outcome is not None else EXIT_RPC_ERROR)


class JsonRenderer:
    """One JSON object per event, per line."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def render(self, event: events_pb2.RunEvent) -> None:
        data = json_format.MessageToDict(event, preserving_proto_field_name=True)
        self.out.write(json.dumps(data, separators=(",", ":")) + "\n")
        self.out.flush()

    def close(self) -> None:
        self.out.flush()


class TextRenderer:
    """Steps as an indented tree, deltas as they arrive, then the outcome and output."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.depth: dict[str, int] = {}
        self.at_line_start = True

    def _line(self, text: str) -> None:
        if not self.at_line_start:
            self.out.write("\n")
        self.out.write(text + "\n")
        self.at_line_start = True
        self.out.flush()

    def render(self, event: events_pb2.RunEvent) -> None:
        kind = event.WhichOneof("kind")
        if kind == "step":
            self._step(event.step)
        elif kind == "heartbeat":
            hb = event.heartbeat
            progress = f" {hb.progress:.0%}" if hb.HasField("progress") else ""
            self._line(f"{self._indent_last()}· {hb.message or 'alive'}{progress}")
        elif kind == "notice":
            self._line(f"! {event.notice.message}")
        elif kind == "result":
            self._result(event.result)

    def _indent_last(self) -> str:
        return "  " * (max(self.depth.values(), default=0))

    def _step(self, step_event: events_pb2.StepEvent) -> None:
        step = step_event.step
        if step_event.phase == events_pb2.STEP_PHASE_START:
            depth = self.depth.get(step.parent_id, -1) + 1
            self.depth[step.id] = depth
            self._line(f"{'  ' * depth}▶ {step.title}")
        elif step_event.phase == events_pb2.STEP_PHASE_DELTA:
            text = step_event.delta
            if step_event.channel == "stderr":
                text = click.style(text, fg="red") if self.out.isatty() else text
            self.out.write(text)
            self.at_line_start = text.endswith("\n")
            self.out.flush()
        elif step_event.phase == events_pb2.STEP_PHASE_END:
            depth = self.depth.pop(step.id, 0)
            ok = step.status == events_pb2.STEP_STATUS_COMPLETE
            took = ""
            if step.HasField("started_at") and step.HasField("ended_at"):
                seconds = (step.ended_at.ToNanoseconds() - step.started_at.ToNanoseconds()) / 1e9
                took = f" ({seconds:.2f}s)"
            summary = f": {step.summary}" if step.summary else ""
            self._line(f"{'  ' * depth}{'✓' if ok else '✗'} {step.title}{took}{summary}")

    def _result(self, result: events_pb2.Result) -> None:
        outcome = events_pb2.Outcome.Name(result.outcome).removeprefix("OUTCOME_")
        self._line(f"= {outcome}")
        if result.output:
            self._line(result.output)
        if result.HasField("error"):
            self._line(f"error {result.error.code}: {result.error.message}")
        for sent in result.writeback.sent_files:
            self._line(f"file {sent.name} ({sent.mime_type}, {sent.size} bytes, "
                       f"sha256 {sent.sha256[:12]}…)")
        for injected in result.writeback.injected_tools:
            self._line(f"inject tool {injected.name}: {injected.description}")
        for message in result.writeback.sent_rich_messages:
            payload: dict[str, Any] = json_format.MessageToDict(message.payload)
            self._line(f"message {message.kind}: {json.dumps(payload)}")

    def close(self) -> None:
        if not self.at_line_start:
            self.out.write("\n")
        self.out.flush()
