"""The protocol between the server and a session's kernel (:mod:`stargrpc.sessions.kernel`).

A frame is a 4-byte big-endian length and that many bytes of a UTF-8 JSON object, at most
:data:`MAX_FRAME` bytes, on the kernel's stdin (server to kernel) and stdout (kernel to
server). What the session's code prints never reaches these descriptors as frames (the
kernel relays it inside ``out`` frames); the server still reads every frame as untrusted:
a frame too large, not JSON, not an object or of an unknown type is a broken protocol, and
the session is closed (:class:`ProtocolError`).
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

#: Largest frame either way (the kernel keeps to the same bound).
MAX_FRAME = 1 << 20

_HEADER = struct.Struct(">I")

#: Frame types the kernel may send.
KERNEL_FRAMES = frozenset({"ready", "out", "done", "error"})


class ProtocolError(Exception):
    """The kernel sent something that is not a frame of the protocol."""


def encode(frame: dict[str, Any]) -> bytes:
    """``frame`` as bytes on the wire.

    Raises:
        ProtocolError: It is larger than :data:`MAX_FRAME`.
    """
    data = json.dumps(frame, ensure_ascii=False).encode("utf-8", "surrogatepass")
    if len(data) > MAX_FRAME:
        raise ProtocolError(f"a frame of {len(data)} bytes is over {MAX_FRAME}")
    return _HEADER.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next frame from the kernel, or None at the end of its output.

    Raises:
        ProtocolError: A frame over the size bound, not a JSON object, or of an unknown
            type; or the stream ended inside a frame.
    """
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("the kernel's output ended inside a frame header") from exc
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ProtocolError(f"the kernel announced a frame of {size} bytes (over {MAX_FRAME})")
    try:
        data = await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError("the kernel's output ended inside a frame") from exc
    try:
        frame = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError("the kernel sent a frame that is not JSON") from exc
    if not isinstance(frame, dict) or frame.get("t") not in KERNEL_FRAMES:
        raise ProtocolError("the kernel sent a frame of no known type")
    return frame
