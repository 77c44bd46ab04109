"""OpenTelemetry traces (``tracing = true``): a span per call, a span per run, a span per step.

- :class:`~stargrpc.server.interceptors.tracing.TracingInterceptor`, outermost in the gRPC
  interceptor chain, opens the call's SERVER span from the caller's W3C trace context.
- :class:`TracingRunInterceptor`, a stage of the run pipeline
  (:class:`stargrpc.runs.runtime.RunInterceptor`), opens the run's span (``run <tool>``)
  as a child of the call's span and follows the run through ``run.observers``: each step
  the tool opens becomes a child span of its parent step (the top-level step is the run span
  itself), a failed step or run gets status ERROR, notices become span events, and the
  Result ends the run span with its outcome. The run span is also current inside the tool,
  so spans a tool makes (say, an instrumented HTTP client) nest under the run.
- :func:`configure_tracing` installs the SDK tracer provider with the configured exporter,
  once per process; with ``tracing_exporter = "none"`` whatever provider the embedding
  program installed is used (tests install an in-memory one).
"""

from __future__ import annotations

from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from stargrpc.runs.run import Run
from stargrpc.runs.runtime import RunInput, RunInterceptor
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2

log = structlog.get_logger("stargrpc.tracing")

TRACER_NAME = "stargrpc"

def tracer() -> trace.Tracer:
    """stargrpc's tracer, from the global tracer provider."""
    return trace.get_tracer(TRACER_NAME)


def configure_tracing(settings: Settings) -> None:
    """Installs a tracer provider exporting to ``settings.tracing_exporter`` (once per
    process; a provider installed before is kept)."""
    if settings.tracing_exporter == "none":
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )

    if isinstance(trace.get_tracer_provider(), TracerProvider):
        log.info("tracing_provider_kept", reason="a tracer provider is already installed")
        return
    exporter: SpanExporter
    if settings.tracing_exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # endpoint etc. from the OTEL_EXPORTER_OTLP_* variables
    else:
        exporter = ConsoleSpanExporter()
    provider = TracerProvider(
        resource=Resource.create({"service.name": settings.tracing_service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing_on", exporter=settings.tracing_exporter)


# -- runs --------------------------------------------------------------------------------------


class TracingRunInterceptor(RunInterceptor):
    """Traces each run it starts (see the module docstring)."""

    def start(self, input: RunInput) -> Run:
        """Opens the run's span, then starts the run."""
        RunTracer(input.run, tracer())
        return self.next.start(input)


class RunTracer:
    """The spans of one run, driven by its events."""

    run_span: Span
    _tracer: trace.Tracer
    _root_step_id: str
    _steps: dict[str, Span]
    _deltas: dict[str, int]

    def __init__(self, run: Run, run_tracer: trace.Tracer) -> None:
        self._tracer = run_tracer
        self._root_step_id = run.root_step.id
        self._steps = {}
        self._deltas = {}
        attributes: dict[str, Any] = {
            "stargrpc.run_id": run.run_id,
            "stargrpc.tool": run.spec.name,
            "stargrpc.principal": run.principal.id,
        }
        invocation_trace = run.invocation.get("trace_id")
        if invocation_trace:
            attributes["stargrpc.invocation.trace_id"] = str(invocation_trace)[:128]
        self.run_span = run_tracer.start_span(f"run {run.spec.name}", kind=SpanKind.INTERNAL,
                                              attributes=attributes)
        run.observers.append(self.observe)
        # Current from here on in the starting task, whose context the run's task copies
        # when it starts; the call's span (TracingInterceptor) restores its own on exit.
        otel_context.attach(trace.set_span_in_context(self.run_span))

    def observe(self, event: events_pb2.RunEvent) -> None:
        """``run.observers`` callback; never raises into the run."""
        try:
            self._observe(event)
        except Exception:
            log.exception("tracing_observer_failed")

    def _observe(self, event: events_pb2.RunEvent) -> None:
        kind = event.WhichOneof("kind")
        when = event.time.ToNanoseconds() if event.HasField("time") else None
        if kind == "step":
            self._on_step(event.step, when)
        elif kind == "notice":
            self.run_span.add_event("notice", {
                "code": event.notice.code, "message": event.notice.message,
                "level": events_pb2.NoticeLevel.Name(event.notice.level)})
        elif kind == "result":
            self._on_result(event.result)

    def _on_step(self, message: events_pb2.StepEvent, when: int | None) -> None:
        step = message.step
        if step.id == self._root_step_id:  # the top-level step is the run span itself
            if message.phase == events_pb2.STEP_PHASE_END and step.summary:
                self.run_span.set_attribute("stargrpc.summary", step.summary[:500])
            return
        if message.phase == events_pb2.STEP_PHASE_START:
            parent = self._steps.get(step.parent_id, self.run_span)
            self._steps[step.id] = self._tracer.start_span(
                step.title or step.id, context=trace.set_span_in_context(parent),
                start_time=when,
                attributes={"stargrpc.step.id": step.id, "stargrpc.step.kind": step.kind})
        elif message.phase == events_pb2.STEP_PHASE_DELTA:
            self._deltas[step.id] = self._deltas.get(step.id, 0) + 1
        elif message.phase == events_pb2.STEP_PHASE_END:
            span = self._steps.pop(step.id, None)
            if span is None:
                return
            span.set_attribute("stargrpc.step.deltas", self._deltas.pop(step.id, 0))
            if step.status == events_pb2.STEP_STATUS_ERROR:
                span.set_status(Status(StatusCode.ERROR, step.summary or None))
            span.end(end_time=when)

    def _on_result(self, result: events_pb2.Result) -> None:
        for span in self._steps.values():  # the run ends every step first; just in case
            span.end()
        self._steps.clear()
        outcome = events_pb2.Outcome.Name(result.outcome).removeprefix("OUTCOME_").lower()
        self.run_span.set_attribute("stargrpc.outcome", outcome)
        if result.outcome != events_pb2.OUTCOME_OK:
            self.run_span.set_attribute("stargrpc.error_code", result.error.code)
            self.run_span.set_status(Status(StatusCode.ERROR,
                                            f"{result.error.code}: {result.error.message}"))
        self.run_span.end()
