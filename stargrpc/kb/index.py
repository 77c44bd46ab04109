"""The knowledge-base index: SQLite FTS5 over passages, ranked with BM25, refreshed
incrementally.

:meth:`KnowledgeBase.refresh` walks the documents folder and re-indexes only files whose
size or modification time changed (and whose content hash then differs); files that are
gone are dropped. :meth:`KnowledgeBase.search` turns free text into an FTS5 query (every
word, any of them may match, so BM25 ranks the passages with more of the rarer words
first) and returns passages with a highlighted snippet. Paths are stored relative to the
folder. The methods block; call them off the event loop.

Only files that really are inside the folder are read: a symbolic link is indexed when
its target (all links resolved) is an indexable file inside the folder, linked folders
are not walked into, and each file is then opened one path component at a time from the
folder's descriptor with ``O_NOFOLLOW``, so a folder or file swapped for a link between
the check and the open is skipped rather than followed out.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sqlite3
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stargrpc.kb.passages import INDEXED_SUFFIXES, MARKDOWN_SUFFIXES, split_document
from stargrpc.settings import Settings
from stargrpc.text import as_name

#: Files larger than this are skipped (a knowledge base holds documents, not dumps).
MAX_DOCUMENT_BYTES = 5 * 1024 * 1024
#: Weights of the FTS columns (path, heading, body) in BM25: a word in a heading counts more.
_BM25_WEIGHTS = (0.0, 3.0, 1.0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: O_NONBLOCK: opening a FIFO must not wait for a writer (it is then refused as not regular).
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: Snippet highlighting and length (in tokens).
SNIPPET_OPEN, SNIPPET_CLOSE, SNIPPET_TOKENS = "**", "**", 24

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS documents (
    path TEXT PRIMARY KEY, mtime_ns INTEGER NOT NULL, size INTEGER NOT NULL,
    sha256 TEXT NOT NULL);
CREATE VIRTUAL TABLE IF NOT EXISTS passages USING fts5(
    path UNINDEXED, heading, body, ordinal UNINDEXED, tokenize = 'porter unicode61');
"""


@dataclass(frozen=True)
class RefreshStats:
    """What a refresh changed."""

    added: int = 0
    updated: int = 0
    removed: int = 0
    unchanged: int = 0

    @property
    def documents(self) -> int:
        """Documents in the index after the refresh."""
        return self.added + self.updated + self.unchanged

    def describe(self) -> str:
        """One line for people."""
        return (f"{self.documents} documents indexed: {self.added} added, {self.updated} "
                f"updated, {self.removed} removed, {self.unchanged} unchanged")


@dataclass(frozen=True)
class Hit:
    """One ranked passage.

    Attributes:
        path: The document, relative to the documents folder.
        heading: The heading trail of the passage ("" for none).
        snippet: The matching part, matches wrapped in ``**``.
        score: BM25 relevance; higher is better.
        passage: The passage's position in its document (0-based).
    """

    path: str
    heading: str
    snippet: str
    score: float
    passage: int


def default_index_path(settings: Settings) -> Path:
    """Where the index lives: ``kb_index_path`` or ``<state_dir>/kb/index.sqlite3``."""
    return settings.kb_index_path or settings.state_dir / "kb" / "index.sqlite3"


class KnowledgeBase:
    """An FTS5 index of one folder of documents, stored in one SQLite file."""

    index_path: Path

    def __init__(self, index_path: Path) -> None:
        self.index_path = index_path

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        self.index_path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.index_path, timeout=30, isolation_level=None)
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.executescript(_SCHEMA)
            yield connection
        finally:
            connection.close()

    def refresh(self, folder: Path) -> RefreshStats:
        """Brings the index up to date with ``folder``; only changed files are re-read.

        Raises:
            FileNotFoundError: The folder does not exist.
        """
        root = folder.resolve()
        if not root.is_dir():
            raise FileNotFoundError(f"documents folder {folder} does not exist")
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")  # one refresher at a time
            try:
                stats = self._refresh(db, root)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        return stats

    def _refresh(self, db: sqlite3.Connection, root: Path) -> RefreshStats:
        known_root = db.execute("SELECT value FROM meta WHERE key = 'root'").fetchone()
        if known_root is None or known_root[0] != as_name(str(root)):
            # Another folder: start over rather than mix two collections.
            db.execute("DELETE FROM documents")
            db.execute("DELETE FROM passages")
            db.execute("INSERT OR REPLACE INTO meta VALUES ('root', ?)", (as_name(str(root)),))
        known = {row[0]: (row[1], row[2], row[3]) for row in
                 db.execute("SELECT path, mtime_ns, size, sha256 FROM documents")}
        added = updated = unchanged = 0
        seen: set[str] = set()
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for relative, inside in _documents(root):
                fd = _open_inside(root_fd, inside)
                if fd is None:
                    continue
                with os.fdopen(fd, "rb") as file:
                    info = os.fstat(file.fileno())
                    previous = known.get(relative)
                    if previous is not None and previous[:2] == (info.st_mtime_ns,
                                                                   info.st_size):
                        seen.add(relative)
                        unchanged += 1
                        continue
                    data = file.read(MAX_DOCUMENT_BYTES + 1)
                if len(data) > MAX_DOCUMENT_BYTES:
                    continue
                seen.add(relative)
                digest = hashlib.sha256(data).hexdigest()
                if previous is not None and previous[2] == digest:
                    unchanged += 1
                else:
                    self._index_document(db, relative, Path(relative).suffix.lower(), data,
                                         replacing=previous is not None)
                    if previous is None:
                        added += 1
                    else:
                        updated += 1
                db.execute("INSERT OR REPLACE INTO documents VALUES (?, ?, ?, ?)",
                           (relative, info.st_mtime_ns, info.st_size, digest))
        finally:
            os.close(root_fd)
        gone = set(known) - seen
        for relative in gone:
            db.execute("DELETE FROM passages WHERE path = ?", (relative,))
            db.execute("DELETE FROM documents WHERE path = ?", (relative,))
        return RefreshStats(added, updated, len(gone), unchanged)

    @staticmethod
    def _index_document(db: sqlite3.Connection, relative: str, suffix: str,
                        data: bytes, *, replacing: bool) -> None:
        if replacing:
            # ``path`` is not indexed: this reads every passage. Only a document that was
            # indexed before has passages to drop (a new one made a first refresh
            # quadratic: 20,000 documents took longer than a run may last).
            db.execute("DELETE FROM passages WHERE path = ?", (relative,))
        text = data.decode("utf-8", errors="replace")
        passages = split_document(text, markdown=suffix in MARKDOWN_SUFFIXES)
        db.executemany("INSERT INTO passages (path, heading, body, ordinal) VALUES (?, ?, ?, ?)",
                       [(relative, p.heading, p.body, i) for i, p in enumerate(passages)])

    def search(self, query: str, limit: int = 5) -> list[Hit]:
        """The passages that best match ``query``, best first (empty for no words)."""
        words = re.findall(r"\w+", query.lower())
        if not words:
            return []
        # Each word quoted (so FTS5 syntax in the query is just text), any may match.
        expression = " OR ".join('"' + word.replace('"', '""') + '"' for word in words)
        with self._connect() as db:
            rows = db.execute(
                "SELECT path, heading, snippet(passages, 2, ?, ?, '…', ?), "
                "bm25(passages, ?, ?, ?) AS rank, ordinal FROM passages "
                "WHERE passages MATCH ? ORDER BY rank LIMIT ?",
                (SNIPPET_OPEN, SNIPPET_CLOSE, SNIPPET_TOKENS, *_BM25_WEIGHTS, expression,
                 limit)).fetchall()
        # FTS5's bm25() is "lower is better"; flip it so a higher score means more relevant.
        return [Hit(path, heading, snippet or heading, -rank, int(ordinal))
                for path, heading, snippet, rank, ordinal in rows]


def _documents(root: Path) -> Iterator[tuple[str, tuple[str, ...]]]:
    """Each document's path relative to ``root`` and, for opening, the components of its
    real path below ``root``; links whose target is outside or would not be indexed
    itself are left out."""
    for folder, filenames in _walk(root):
        for name in filenames:
            path = folder / name
            if not _indexable(path.relative_to(root)):
                continue
            try:
                real = Path(os.path.realpath(path))
            except OSError:  # changing under us; the next refresh sees it settled
                continue
            if real.is_relative_to(root) and _indexable(real.relative_to(root)):
                # A name whose bytes are not UTF-8 is stored and shown with them spelt out
                # (``\xff``): as it was, SQLite refused it and the whole refresh with it.
                yield as_name(path.relative_to(root).as_posix()), real.relative_to(root).parts


def _walk(root: Path) -> Iterator[tuple[Path, list[str]]]:
    """Each folder at or below ``root``, top down, with the names in it that are not
    folders (links included), sorted; hidden folders and linked ones are not walked into,
    and a folder that cannot be listed is passed over. Iterative: ``os.walk`` recurses, and
    on Python 3.11 a folder nested a thousand deep raised RecursionError (the refresh, and
    every knowledge_search, failing with it)."""
    pending = [root]
    while pending:
        folder = pending.pop()
        folders: list[str] = []
        files: list[str] = []
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    try:
                        linked_or_file = not entry.is_dir(follow_symlinks=False)
                    except OSError:
                        continue
                    (files if linked_or_file else folders).append(entry.name)
        except OSError:
            continue
        yield folder, sorted(files)
        pending.extend(folder / name for name in sorted(folders, reverse=True)
                       if not name.startswith("."))


def _indexable(relative: Path) -> bool:
    return (relative.suffix.lower() in INDEXED_SUFFIXES
            and not any(part.startswith(".") for part in relative.parts))


def _open_inside(root_fd: int, parts: tuple[str, ...]) -> int | None:
    """A descriptor of the regular file ``parts`` below ``root_fd``, opened without
    following a link at any component; None when something on the way is a link, is
    missing or unreadable, or the file is not a regular file of at most the size cap."""
    # One folder descriptor held at a time: a file nested deeper than the descriptor
    # limit is still opened, and the server's other descriptors are not crowded out.
    folder: int | None = None
    try:
        for part in parts[:-1]:
            inner = os.open(part, _DIR_FLAGS, dir_fd=root_fd if folder is None else folder)
            if folder is not None:
                os.close(folder)
            folder = inner
        fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=root_fd if folder is None else folder)
    except OSError:
        return None
    finally:
        if folder is not None:
            os.close(folder)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_DOCUMENT_BYTES:
        os.close(fd)
        return None
    return fd
