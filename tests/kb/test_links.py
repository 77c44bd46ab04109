"""Links in the documents folder: only files really inside it are indexed."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path

from click.testing import CliRunner

from stargrpc.cli import main
from stargrpc.kb import KnowledgeBase
from tests.kb.corpus import write_corpus

SECRET = "# Secret\n\nThe zebra launch codes.\n"


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "secret.md").write_text(SECRET)
    (outside / "deep" / "secret.md").write_text(SECRET)
    return outside


def _links_out(docs: Path, outside: Path) -> None:
    """Every way we know of for a link to lead out of ``docs``."""
    (docs / "leak.md").symlink_to(outside / "secret.md")  # absolute
    (docs / "ops" / "relative.md").symlink_to("../../outside/secret.md")
    (docs / "dotdot.md").symlink_to("ops/../../outside/secret.md")
    (docs / "linked-folder").symlink_to(outside)  # a linked folder
    (docs / "through-folder.md").symlink_to("linked-folder/deep/secret.md")
    (docs / "chain.md").symlink_to("leak.md")  # a link to a link that leaves
    (docs / "ops" / "deep").symlink_to(outside / "deep")


def test_links_out_of_the_folder_are_not_indexed(tmp_path) -> None:
    docs = write_corpus(tmp_path / "docs")
    _links_out(docs, _outside(tmp_path))
    (docs / "latest.md").symlink_to("ops/backups.md")  # inside: indexed under its name
    (docs / "peek.md").symlink_to("notes/.hidden.md")  # inside, but hidden itself
    (docs / "notes" / "api.key").write_text("zebra key")
    (docs / "key.md").symlink_to("notes/api.key")  # inside, but not a document itself
    os.mkfifo(docs / "pipe.md")  # would block a plain open
    (docs / "loop-a.md").symlink_to("loop-b.md")
    (docs / "loop-b.md").symlink_to("loop-a.md")
    (docs / "dangling.md").symlink_to("ops/gone.md")
    kb = KnowledgeBase(tmp_path / "index.sqlite3")

    stats = kb.refresh(docs)

    assert (stats.added, stats.documents) == (5, 5)
    assert kb.search("zebra launch codes") == []
    assert kb.search("secret") == []
    assert {hit.path for hit in kb.search("restore backup", limit=10)} == {
        "ops/backups.md", "latest.md"}


def test_a_link_turned_outwards_is_dropped_on_the_next_refresh(tmp_path) -> None:
    docs = write_corpus(tmp_path / "docs")
    outside = _outside(tmp_path)
    (docs / "moving.md").symlink_to("ops/deploy.md")
    kb = KnowledgeBase(tmp_path / "index.sqlite3")
    kb.refresh(docs)

    (docs / "moving.md").unlink()
    (docs / "moving.md").symlink_to(outside / "secret.md")
    stats = kb.refresh(docs)

    assert (stats.removed, stats.documents) == (1, 4)
    assert kb.search("zebra") == []


def test_files_an_old_index_holds_from_outside_are_dropped(tmp_path) -> None:
    docs = write_corpus(tmp_path / "docs")
    (docs / "leak.md").symlink_to(_outside(tmp_path) / "secret.md")
    index = tmp_path / "index.sqlite3"
    kb = KnowledgeBase(index)
    kb.refresh(docs)
    # What an index built while links were followed holds: the outside file, up to date.
    info = (docs / "leak.md").stat()
    with sqlite3.connect(index) as db:
        db.execute("INSERT OR REPLACE INTO documents VALUES ('leak.md', ?, ?, 'x')",
                   (info.st_mtime_ns, info.st_size))
        db.execute("DELETE FROM passages WHERE path = 'leak.md'")
        db.execute("INSERT INTO passages (path, heading, body, ordinal) VALUES "
                   "('leak.md', 'Secret', 'The zebra launch codes.', 0)")
    assert [hit.path for hit in kb.search("zebra")] == ["leak.md"]

    stats = kb.refresh(docs)

    assert (stats.removed, stats.documents) == (1, 4)
    assert kb.search("zebra") == []


def test_a_folder_swapped_for_a_link_during_a_refresh_is_not_followed(tmp_path) -> None:
    docs = write_corpus(tmp_path / "docs")
    outside = _outside(tmp_path)
    for name in ("secret.md", "deep/secret.md"):
        (outside / name).write_text(SECRET)
    swapped, parked = docs / "swap", docs / "parked"
    swapped.mkdir()
    (swapped / "secret.md").write_text("# Inside\n\nThe zebra is inside.\n")
    link = tmp_path / "link"
    link.symlink_to(outside)
    stop = threading.Event()

    def swap() -> None:
        # `swap` is a real folder, then (briefly missing) a link out, and back again.
        while not stop.is_set():
            swapped.rename(parked)
            link.rename(swapped)
            swapped.rename(link)
            parked.rename(swapped)

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    kb = KnowledgeBase(tmp_path / "index.sqlite3")
    found: set[str] = set()
    try:
        deadline = time.monotonic() + 3
        for _ in range(200):
            if time.monotonic() > deadline:
                break
            kb.refresh(docs)
            found.update(hit.snippet for hit in kb.search("zebra launch codes", limit=10))
    finally:
        stop.set()
        swapper.join(10)

    assert not any("launch" in snippet for snippet in found)


def test_kb_index_command_follows_the_same_rule(tmp_path) -> None:
    docs = write_corpus(tmp_path / "docs")
    _links_out(docs, _outside(tmp_path))
    index = str(tmp_path / "index.sqlite3")
    runner = CliRunner()

    built = runner.invoke(main, ["kb", "index", str(docs), "--index", index])
    found = runner.invoke(main, ["kb", "search", "zebra launch codes", "--index", index])

    assert built.exit_code == 0, built.output
    assert built.output.startswith("4 documents indexed: 4 added,")
    assert (found.exit_code, found.output) == (0, "")


def test_kb_search_shows_what_the_documents_say_without_the_terminal_obeying_it(
        tmp_path) -> None:
    # A document's text (or name) that set the window title or redrew the screen reached
    # the terminal as it was.
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "title\x1b[2J.md").write_text("# Trap\n\nThe walrus \x1b]0;pwned\x07 sings.\n")
    index = str(tmp_path / "index.sqlite3")
    runner = CliRunner()

    assert runner.invoke(main, ["kb", "index", str(docs), "--index", index]).exit_code == 0
    found = runner.invoke(main, ["kb", "search", "walrus", "--index", index])

    assert found.exit_code == 0, found.output
    assert "\x1b" not in found.output and "\x07" not in found.output
    assert "title\\x1b[2J.md > Trap" in found.output
    assert "\\x1b]0;pwned\\x07" in found.output
