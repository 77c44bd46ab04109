"""``stargrpc tools``, ``call``, ``watch``, ``cancel`` and ``steer``: talk to a running
server through the Python SDK (:mod:`stargrpc.client`), so the CLI gets its retries,
catalog reload and stream resume for free."""

from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TextIO, TypeVar

import click
from google.protobuf import json_format

from stargrpc.client import CallError, Client, ClientError, Event, Result
from stargrpc.runs.outcome import Outcome
from stargrpc.v1 import events_pb2

#: Exit status of ``stargrpc call`` per outcome; 0 only for OK.
EXIT_CODES = {
    Outcome.OK: 0,
    Outcome.DENIED: 3,
    Outcome.FAILED: 4,
    Outcome.ERROR: 5,
    Outcome.TIMEOUT: 6,
    Outcome.CANCELLED: 7,
}
EXIT_RPC_ERROR = 1
EXIT_INTERRUPTED = 130


class Seconds(click.ParamType):
    """A deadline in seconds: a number above 0 and at most a year (not NaN, not infinite:
    gRPC takes those, and the call fails DEADLINE_EXCEEDED at once)."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not 0 < seconds <= 365 * 24 * 3600:  # False for NaN too
            self.fail(f"{value!r} is not in 0 < seconds <= 31536000", param, ctx)
        return seconds

F = TypeVar("F", bound=Callable[..., Any])


def connection_options(command: F) -> F:
    """The options every command that talks to a server takes, collected into a
    ``client_options`` dict for :class:`~stargrpc.client.Client`."""
    options = [
        click.option("--target", envvar="STARGRPC_TARGET", default="localhost:50051",
                     show_default=True, help="Server address [env STARGRPC_TARGET]."),
        click.option("--api-key", envvar="STARGRPC_API_KEY", default=None,
                     help="API key or JWT, sent as a bearer token [env STARGRPC_API_KEY]."),
        click.option("--tls", is_flag=True, help="Connect with TLS (system root certificates "
                     "unless --ca-file)."),
        click.option("--ca-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     default=None, help="PEM root certificates to verify the server; implies "
                     "--tls."),
        click.option("--cert-file", type=click.Path(exists=True, dir_okay=False,
                                                    path_type=Path),
                     default=None, help="Client certificate (PEM) for mutual TLS."),
        click.option("--key-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     default=None, help="The client certificate's private key (PEM)."),
    ]

    @functools.wraps(command)
    def wrapper(*args: Any, target: str, api_key: str | None, tls: bool,
                ca_file: Path | None, cert_file: Path | None, key_file: Path | None,
                **kwargs: Any) -> Any:
        if (cert_file is None) != (key_file is None):
            raise click.UsageError("--cert-file and --key-file go together")
        client_options = {"target": target, "api_key": api_key or None, "tls": tls,
                          "ca_file": ca_file, "cert_file": cert_file, "key_file": key_file}
        return command(*args, client_options=client_options, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper  # type: ignore[return-value]


def _fail(error: ClientError) -> NoReturn:
    click.echo(terminal_safe(f"error: {error}"), err=True)
    if isinstance(error, CallError):
        for violation in error.violations:
            click.echo(terminal_safe(f"  {violation.field}: {violation.description}"), err=True)
    sys.exit(EXIT_RPC_ERROR)


@click.command()
@connection_options
@click.option("--json", "as_json", is_flag=True, help="Print the catalog as JSON.")
def tools(client_options: dict[str, Any], as_json: bool) -> None:
    """List the tools of a running server."""
    with Client(**client_options) as client:
        try:
            catalog = client.list_tools(timeout=30)
        except ClientError as exc:
            _fail(exc)
    if as_json:
        click.echo(json.dumps({
            "tools": [json_format.MessageToDict(t.raw, preserving_proto_field_name=True)
                      for t in catalog.tools],
            "catalog_hash": catalog.catalog_hash,
        }, indent=2))
        return
    width = max((len(t.name) for t in catalog.tools), default=4)
    for item in catalog.tools:
        flags = " [privileged]" if item.privileged else ""
        flags += "" if item.callable else " [not allowed]"
        click.echo(terminal_safe(f"{item.name.ljust(width)}  {item.description}{flags}"))
    click.echo(f"catalog {catalog.catalog_hash}", err=True)


@click.command()
@connection_options
@click.argument("tool_name")
@click.argument("positional_arguments", metavar="[ARGUMENTS]", required=False)
@click.option("--args", "arguments", default=None,
              help="Arguments as a JSON object (or give them after the tool's name; - reads "
                   "them from standard input). Default: {}.")
@click.option("--json", "as_json", is_flag=True, help="Print each event as one JSON line.")
@click.option("--idempotency-key", default="",
              help="Repeat a key to attach to or replay a run; one is generated when empty.")
@click.option("--timeout", type=Seconds(), default=None, help="gRPC deadline in seconds.")
@click.option("--session", "session_id", default="",
              help="Run in this session (stargrpc session create): python or shell in its "
                   "sandbox, with its files and live interpreter.")
@click.option("--session-no-wait", is_flag=True,
              help="With --session: fail (SESSION_BUSY) rather than wait while the session "
                   "runs another call.")
@click.option("--lane", default="", help="Run in this lane instead of the tool's (needs the "
              "server's lane_override_role).")
@click.option("--priority", type=click.IntRange(0, 1000), default=0, show_default=True,
              help="Priority in the lane's queue (higher starts first; 0: the default).")
@click.option("--max-wait", "max_wait", type=float, default=0.0, show_default=True,
              help="Refuse at once (LANE_BUSY) rather than wait longer than this many "
              "seconds in the lane's queue; 0 waits.")
def call(client_options: dict[str, Any], tool_name: str, positional_arguments: str | None,
         arguments: str | None, as_json: bool, idempotency_key: str, timeout: float | None,
         session_id: str, session_no_wait: bool, lane: str, priority: int,
         max_wait: float) -> None:
    """Run a tool and show its steps and output live. Exits 0 only when the outcome is OK.

    ARGUMENTS is a JSON object (as --args): stargrpc call echo '{"text": "hi"}'; - reads it
    from standard input. A broken connection is resumed where it left off; Ctrl-C cancels
    the run.
    """
    if positional_arguments is not None and arguments is not None:
        raise click.UsageError("give the arguments once: after the tool's name or with --args")
    hint = "ARGUMENTS" if positional_arguments is not None else "--args"
    arguments = positional_arguments if positional_arguments is not None else arguments
    if arguments is None:
        arguments = "{}"
    elif arguments == "-":
        arguments = sys.stdin.read()
    try:
        parsed = json.loads(arguments)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint=hint) from exc
    except RecursionError:
        raise click.BadParameter("not valid JSON: nested too deeply", param_hint=hint) from None
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object", param_hint=hint)
    with Client(**client_options) as client:
        _follow(client, client.execute(tool_name, arguments,
                                       idempotency_key=idempotency_key or None,
                                       timeout=timeout, session_id=session_id or None,
                                       session_no_wait=session_no_wait, lane=lane,
                                       priority=priority, max_wait_seconds=max_wait), as_json)


@click.command()
@connection_options
@click.argument("run_id")
@click.option("--after-seq", type=click.IntRange(0, 2**64 - 1), default=0, show_default=True,
              help="Show only the events after this seq.")
@click.option("--json", "as_json", is_flag=True, help="Print each event as one JSON line.")
def watch(client_options: dict[str, Any], run_id: str, after_seq: int, as_json: bool) -> None:
    """Replay a run's events, then follow it live until its Result. Exits like ``call``;
    exits 0 when the run had already ended at or before --after-seq (nothing to show)."""
    with Client(**client_options) as client:
        _follow(client, client.watch(run_id, after_seq), as_json, cancel_on_interrupt=False,
                past_end=f"run {run_id} has ended: nothing follows seq {after_seq}")


@click.command()
@connection_options
@click.argument("run_id")
@click.option("--reason", default="", help="Why; shown in the run's Result.")
def cancel(client_options: dict[str, Any], run_id: str, reason: str) -> None:
    """Ask a run to stop. Exits 0 when it was still going, 2 when it had already ended."""
    with Client(**client_options) as client:
        try:
            stopped = client.cancel(run_id, reason, timeout=30)
        except ClientError as exc:
            _fail(exc)
    click.echo("cancelled" if stopped else "already ended", err=True)
    sys.exit(0 if stopped else 2)


@click.command()
@connection_options
@click.argument("run_id")
@click.argument("message")
def steer(client_options: dict[str, Any], run_id: str, message: str) -> None:
    """Send a steering message to a running tool (it reads it from ctx.steering())."""
    with Client(**client_options) as client:
        try:
            client.steer(run_id, message, timeout=30)
        except ClientError as exc:
            _fail(exc)
    click.echo("steered", err=True)


def _follow(client: Client, events: Iterator[Event], as_json: bool, *,
            cancel_on_interrupt: bool = True, past_end: str = "") -> NoReturn:
    """Renders a stream and exits with the status of its outcome.

    A stream that ends without a Result is one that asked for events after the end of a
    finished run (the SDK ends such a watch quietly): ``past_end`` is said, and it exits 0.
    """
    renderer = JsonRenderer(sys.stdout) if as_json else TextRenderer(sys.stdout)
    run_id = ""
    result: Result | None = None
    try:
        for event in events:
            if not run_id:
                run_id = event.run_id
                if not as_json:
                    click.echo(f"run {run_id}", err=True)
            renderer.render(event.raw)
            if isinstance(event, Result):
                result = event
    except ClientError as exc:
        renderer.close()
        _fail(exc)
    except KeyboardInterrupt:
        renderer.close()
        # Runs outlive their stream: stop this one rather than leave it running unseen.
        if cancel_on_interrupt and run_id:
            with contextlib.suppress(ClientError):
                client.cancel(run_id, "interrupted from the command line", timeout=5)
            click.echo(f"interrupted; run {run_id} cancelled", err=True)
        sys.exit(EXIT_INTERRUPTED)
    renderer.close()
    if result is None and past_end:
        click.echo(past_end, err=True)
        sys.exit(0)
    sys.exit(EXIT_CODES.get(result.outcome, EXIT_RPC_ERROR) if result else EXIT_RPC_ERROR)


def usage_line(usage: events_pb2.Usage) -> str:
    """The run's receipt on one line: what was measured, nothing for what was not.

    ``usage: wall 1.02s, cpu 0.71s (0.23s user + 0.48s system), peak memory 58.0 MiB,
    wrote 12.0 KiB``
    """
    parts = []
    if usage.HasField("wall_seconds"):
        parts.append(f"wall {_seconds(usage.wall_seconds)}")
    if usage.queued_seconds:
        parts.append(f"queued {_seconds(usage.queued_seconds)}")
    if usage.HasField("cpu_user_seconds") or usage.HasField("cpu_system_seconds"):
        user, system = usage.cpu_user_seconds, usage.cpu_system_seconds
        parts.append(f"cpu {_seconds(user + system)} ({_seconds(user)} user + "
                     f"{_seconds(system)} system)")
    if usage.HasField("peak_rss_bytes"):
        parts.append(f"peak memory {_size(usage.peak_rss_bytes)}")
    if usage.HasField("bytes_written"):
        parts.append(f"wrote {_size(usage.bytes_written)}")
    if usage.HasField("network_bytes_sent") or usage.HasField("network_bytes_received"):
        parts.append(f"network {_size(usage.network_bytes_sent)} sent, "
                     f"{_size(usage.network_bytes_received)} received")
    if usage.child_runs:
        parts.append(f"{usage.child_runs} child runs")
    return "usage: " + ", ".join(parts)


def _seconds(value: float) -> str:
    """A duration for people: 1.50s, 0.25s; under 10 ms in ms (3.2ms, 0.4ms), which two
    decimals of a second would show as 0.00s; 0s for nothing measured."""
    if value <= 0:
        return "0s"
    if value < 0.01:
        return f"{value * 1000:.1f}ms"
    return f"{value:.2f}s"


def _size(count: int) -> str:
    """``count`` bytes for people: 512 B, 12.0 KiB, 58.0 MiB, 1.5 GiB."""
    if count < 1024:
        return f"{count} B"
    value = float(count)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


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


#: What a terminal would act on rather than show: the C0 controls but tab and newline
#: (ESC starts the sequences that set a window's title, write the clipboard or redraw the
#: screen), DEL, the C1 controls, and the bidirectional overrides that reorder what is
#: shown ("Trojan source"). A tool's output may come from anywhere (a fetched page).
_TERMINAL_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f"
                              "\u202a-\u202e\u2066-\u2069]")


def _spelt(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def terminal_safe(text: str) -> str:
    """``text`` with every character a terminal would act on (:data:`_TERMINAL_UNSAFE`)
    spelt out as an escape (``\\x1b``), so that what a run sends is shown, never obeyed."""
    return _TERMINAL_UNSAFE.sub(_spelt, text)


class TextRenderer:
    """Steps as an indented tree, deltas as they arrive, then the outcome and output.

    What the server sends — titles, file names, messages and, on a terminal, the output
    too — is shown through :func:`terminal_safe`: a run cannot move the cursor, retitle the
    window or write the clipboard of whoever watches it. Piped, the output is written as it
    came (``--json`` gives every event exactly)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.depth: dict[str, int] = {}
        self.at_line_start = True
        self.streamed: list[str] = []  # the text of every DELTA shown, stderr aside
        self.tty = out.isatty()

    def _line(self, text: str, output: bool = False) -> None:
        """Writes ``text`` on a line of its own; ``output`` (the run's own text, not its
        metadata) is written as it came when piped."""
        if not self.at_line_start:
            self.out.write("\n")
        self.out.write((text if output and not self.tty else terminal_safe(text)) + "\n")
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
            if step_event.channel != "stderr":
                self.streamed.append(text)
            if self.tty:
                text = terminal_safe(text)
                if step_event.channel == "stderr":
                    text = click.style(text, fg="red")
            self.out.write(text)
            self.at_line_start = text.endswith("\n")
            self.out.flush()
        elif step_event.phase == events_pb2.STEP_PHASE_END:
            depth = self.depth.pop(step.id, 0)
            ok = step.status == events_pb2.STEP_STATUS_COMPLETE
            took = ""
            if step.HasField("started_at") and step.HasField("ended_at"):
                seconds = (step.ended_at.ToNanoseconds() - step.started_at.ToNanoseconds()) / 1e9
                took = f" ({_seconds(seconds)})"
            summary = f": {step.summary}" if step.summary else ""
            self._line(f"{'  ' * depth}{'✓' if ok else '✗'} {step.title}{took}{summary}")

    def _result(self, result: events_pb2.Result) -> None:
        outcome = events_pb2.Outcome.Name(result.outcome).removeprefix("OUTCOME_")
        if result.HasField("usage"):  # the receipt, just above the outcome
            self._line(usage_line(result.usage))
        self._line(f"= {outcome}")
        unseen = self._not_streamed(result.output)
        if unseen:
            self._line(unseen, output=True)
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

    def _not_streamed(self, output: str) -> str:
        """The part of the Result's output not already shown as deltas: a tool that
        streams what it returns (echo, a shell command's stdout) is not printed twice."""
        streamed = "".join(self.streamed).rstrip("\n")
        if streamed and output.startswith(streamed):
            rest = output[len(streamed):]
            if not rest or rest.startswith("\n"):  # whole lines only
                return rest.strip("\n")
        return output

    def close(self) -> None:
        if not self.at_line_start:
            self.out.write("\n")
        self.out.flush()
