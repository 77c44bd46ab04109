"""A sandbox's output folder (``out/``, ``$OUTPUT_DIR``) read back as sent files.

One walker serves a run's folder (read once the run is over) and a session's (read after
each call, and emptied of what was read so the next call does not return it again). The
folder is walked from a descriptor, never by path: whatever the command left there —
links, folders of other owners, names that are not text, more entries than anyone should
read — is skipped and told, never followed.
"""

from __future__ import annotations

import contextlib
import mimetypes
import os
import stat
from dataclasses import dataclass, field

from stargrpc.sandbox import fsops
from stargrpc.text import as_name, is_text

#: Output-folder files returned at most.
MAX_SENT_FILES = 32
#: Most entries of the output folder looked at, and how deep.
MAX_ENTRIES = 10_000
MAX_DEPTH = 64
#: Skipped output files listed one by one at most (the rest are counted).
_MAX_SKIPPED = 64


@dataclass(frozen=True)
class OutputFile:
    """A file the command left in its output folder."""

    name: str
    data: bytes
    mime_type: str


@dataclass
class SentFiles:
    """The files read from an output folder, and why others were not (at most
    ``_MAX_SKIPPED`` reasons listed, the rest counted in the last)."""

    files: list[OutputFile] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    _unlisted: int = 0

    def skip(self, reason: str) -> None:
        """Tells why an entry is not returned."""
        if len(self.skipped) < _MAX_SKIPPED:
            self.skipped.append(reason)
            return
        self._unlisted += 1
        self.skipped[-1] = f"{self._unlisted + 1} more entries not returned"


def read_out(out_fd: int, owner: fsops.Owner, into: SentFiles, *, budget: int,
             take: bool = False) -> None:
    """Reads the plain files under the folder ``out_fd`` into ``into``: at most
    :data:`MAX_SENT_FILES` files and ``budget`` bytes, each owned by ``owner`` (a blocking
    walk: call it in a thread unless the folder is known to be small).

    Args:
        out_fd: The output folder's descriptor (not closed here).
        owner: Who the folder's files and subfolders must belong to.
        into: Where the files and the reasons for skipping others go.
        budget: The byte cap of the files returned, together.
        take: Remove each file once read (a session's folder outlives the call).

    Raises:
        fsops.Moved: The folder changed while it was walked (what was read is kept).
        OSError: Likewise.
    """
    left = budget
    with fsops.walk(out_fd, max_depth=MAX_DEPTH) as tree:
        for seen, (name, entry, info) in enumerate(tree.entries(), 1):
            if seen > MAX_ENTRIES:
                into.skip(f"more than {MAX_ENTRIES} entries in out/; the rest not looked at")
                return
            if not is_text(name):
                # A sent file's name is text: such a name (and a folder's) is told, escaped.
                if stat.S_ISDIR(info.st_mode):
                    tree.skip()
                into.skip(f"{as_name(name)}: the name is not UTF-8")
                continue
            if stat.S_ISDIR(info.st_mode):
                if not owner.is_own(info):
                    tree.skip()
                    into.skip(f"{name}: not a plain folder")
                elif tree.too_deep:
                    into.skip(f"{name}: more than {MAX_DEPTH} folders deep; not looked into")
                continue
            if len(into.files) >= MAX_SENT_FILES:
                into.skip(f"{name}: more than {MAX_SENT_FILES} files")
                continue
            try:
                data = fsops.read_own_file(tree.fd, entry, owner, left)
            except fsops.TooLarge:
                into.skip(f"{name}: over the {budget} byte cap of sent files")
                continue
            if data is None:
                into.skip(f"{name}: not a plain file")
                continue
            left -= len(data)
            if take:
                # Returned all the same if it stays: the next call may return it again.
                with contextlib.suppress(OSError):
                    os.unlink(entry, dir_fd=tree.fd)
            mime = mimetypes.guess_type(name)[0] or "application/octet-stream"
            into.files.append(OutputFile(name, data, mime))
