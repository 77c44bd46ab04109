"""Files that travelled as chunks, put back together.

A large sent file comes as FileChunk events (``file_id``, ``offset``, ``data``) before the
Result that lists it with ``streamed`` set and its ``size``. The client, the test harness
and the MCP endpoint all rebuild it here, by offset, and only when the chunks cover the
whole file exactly and, when the Result gives its sha256, hash to it: a file with a chunk
missing (a stream resumed past it, say) or with bytes that are not the file's is never
handed on as if it were whole.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass
class StreamedFiles:
    """The chunks of a run's streamed files, by file id, until the Result names them."""

    _chunks: dict[str, dict[int, bytes]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self._chunks)

    def add(self, file_id: str, offset: int, data: bytes) -> None:
        """Keeps one chunk; the same chunk seen twice (a replay) is kept once."""
        self._chunks.setdefault(file_id, {})[offset] = bytes(data)

    def content(self, file_id: str, size: int, sha256: str = "") -> bytes | None:
        """The whole file ``file_id`` of ``size`` bytes; None unless its chunks, in offset
        order, follow one another from 0 to ``size`` with no gap and no overlap, and (when
        ``sha256`` is given, the hex digest the Result lists) hash to ``sha256``."""
        pieces = []
        position = 0
        for offset, data in sorted(self._chunks.get(file_id, {}).items()):
            if offset != position:
                return None
            pieces.append(data)
            position += len(data)
        if position != size:
            return None
        data = b"".join(pieces)
        if sha256 and hashlib.sha256(data).hexdigest() != sha256.lower():
            return None
        return data
