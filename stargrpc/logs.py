"""Logging: structlog, JSON lines on stdout (a console renderer on a terminal).

``merge_contextvars`` comes first so interceptors and runs can
``structlog.contextvars.bind_contextvars(run_id=…, tool=…)`` and every line of a call
carries them.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure_logging(level: str = "info", fmt: str = "auto", stream: Any = None, *,
                      cache: bool = False) -> None:
    """Configures structlog (and routes the standard library's logging through it).

    Args:
        level: Minimum level: debug, info, warning or error.
        fmt: "json", "console", or "auto" (console when the stream is a terminal).
        stream: Where to write; standard output by default.
        cache: Let each logger keep its processor chain after first use. A server process
            configures logging once, so it saves rebuilding the chain on every log call;
            leave it off where the configuration changes later (tests capturing logs).
    """
    out = stream if stream is not None else sys.stdout
    console = fmt == "console" or (fmt == "auto" and hasattr(out, "isatty") and out.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    # Tracebacks never show the frames' local variables: they hold what a call carried
    # (its metadata: an API key, a bearer token; its arguments), which must not reach a log.
    if console:
        renderer = structlog.dev.ConsoleRenderer(
            exception_formatter=structlog.dev.plain_traceback)
    else:
        shared.append(structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)))
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        # One write per line (the line and its newline together), so that processes sharing
        # the stream (--workers) never interleave within a line.
        logger_factory=structlog.WriteLoggerFactory(out),
        cache_logger_on_first_use=cache,
    )
    # grpc and other libraries log through the standard library: give them the same sink.
    handler = logging.StreamHandler(out)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processor=renderer, foreign_pre_chain=shared))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(_LEVELS[level], logging.WARNING))


# The processors of the configuration an embedded server made, to tell it from one the
# embedding program made (or a test's capture_logs swapped in), which a server leaves alone.
_server_made: tuple[list[Any], tuple[Any, ...]] | None = None


def configure_embedded_logging(level: str, fmt: str) -> bool:
    """Configures logging for an embedded server from its settings, unless the embedding
    program configured structlog itself (a later server replaces an earlier server's
    configuration, so its ``log_level`` holds too).

    Returns:
        Whether logging was configured.
    """
    global _server_made
    if structlog.is_configured():
        current = structlog.get_config()["processors"]
        if _server_made is None or current is not _server_made[0] \
                or tuple(current) != _server_made[1]:
            return False
    configure_logging(level, fmt)
    processors = structlog.get_config()["processors"]
    _server_made = (processors, tuple(processors))
    return True
