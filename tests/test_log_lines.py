"""Log lines stay whole when several processes share one stream (the workers of
``stargrpc serve --workers N`` write to the supervisor's stdout): each JSON line is written
with its newline in one write, so no line of one process lands inside another's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_EMIT = """
import sys
from stargrpc.logs import configure_logging
import structlog
configure_logging("info", "json")
log = structlog.get_logger("t")
for i in range(1500):
    log.info("line", writer=sys.argv[1], i=i, pad="x" * 200)
"""


def test_two_unbuffered_writers_never_interleave_within_a_line() -> None:
    read, write = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # every write goes straight to the pipe
    writers = [subprocess.Popen([sys.executable, "-c", _EMIT, name], stdout=write, env=env)
               for name in ("a", "b")]
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    for writer in writers:
        assert writer.wait(60) == 0

    lines = data.decode().splitlines()
    parsed = [json.loads(line) for line in lines]  # a torn line fails here
    assert sorted((p["writer"], p["i"]) for p in parsed) == sorted(
        (name, i) for name in ("a", "b") for i in range(1500))


_FAIL = """
import logging, sys
from stargrpc.logs import configure_logging
import structlog
configure_logging("info", sys.argv[1])

def handler(metadata):
    token = "Bearer sgk_" + "s3cr3t" * 4
    raise ValueError("out of range")

for log in (structlog.get_logger("t"), logging.getLogger("uvicorn.error")):
    try:
        handler((("authorization", "Bearer sgk_" + "s3cr3t" * 4),))
    except ValueError:
        log.exception("failed")
"""


def test_a_logged_traceback_shows_no_local_variable() -> None:
    # A frame's locals hold what its call carried (metadata with an API key): a traceback
    # in the log, from structlog or from a library through the standard logging, names
    # the frames and the error only.
    for fmt in ("json", "console"):
        out = subprocess.run([sys.executable, "-c", _FAIL, fmt], capture_output=True,
                             text=True, timeout=60, check=True).stdout
        assert out.count("out of range") >= 2, out
        assert "s3cr3t" not in out, out
