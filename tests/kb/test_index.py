"""The FTS5 index: BM25 ranking, snippets, incremental refresh."""

from __future__ import annotations

import os
import sqlite3

from stargrpc.kb import KnowledgeBase
from stargrpc.kb.passages import split_document
from tests.kb.corpus import write_corpus


def test_the_obviously_relevant_passage_ranks_first(tmp_path) -> None:
    docs = write_corpus(tmp_path / "docs")
    kb = KnowledgeBase(tmp_path / "index.sqlite3")
    stats = kb.refresh(docs)

    hits = kb.search("how do I restore a backup?", limit=3)

    assert (stats.added, stats.documents) == (4, 4)  # hidden files and .png are skipped
    assert (hits[0].path, hits[0].heading) == ("ops/backups.md", "Backups > Restoring a backup")
    assert "**restore**" in hits[0].snippet
    assert hits[0].score > hits[-1].score
    assert all(h.path != "notes/.hidden.md" for h in hits)


def test_query_syntax_is_just_text(tmp_path) -> None:
    kb = KnowledgeBase(tmp_path / "index.sqlite3")
    kb.refresh(write_corpus(tmp_path / "docs"))

    assert kb.search('soup" OR NEAR(* -', limit=2)[0].path == "team/lunch.txt"
    assert kb.search("?!", limit=2) == []


def test_refresh_reads_only_what_changed(tmp_path) -> None:
    docs = write_corpus(tmp_path / "docs")
    kb = KnowledgeBase(tmp_path / "index.sqlite3")
    kb.refresh(docs)

    (docs / "team/lunch.txt").write_text("Lunch moved to 13:00. Pizza on Tuesdays.\n")
    (docs / "notes/vacation.md").unlink()
    (docs / "ops/new.md").write_text("# Pager\n\nThe pager rotation changes weekly.\n")
    deploy = docs / "ops/deploy.md"
    os.utime(deploy, ns=(deploy.stat().st_atime_ns, deploy.stat().st_mtime_ns + 10**9))
    stats = kb.refresh(docs)

    assert (stats.added, stats.updated, stats.removed, stats.unchanged) == (1, 1, 1, 2)
    assert kb.search("pizza")[0].path == "team/lunch.txt"
    assert kb.search("soup") == []
    assert kb.search("vacation manager") == []
    assert kb.search("pager rotation")[0].path == "ops/new.md"


def test_markdown_is_cut_at_headings_but_not_inside_code() -> None:
    text = "intro\n\n# A\n\ntext a\n\n```\n# not a heading\n```\n\n## B\n\ntext b\n"

    passages = split_document(text, markdown=True)

    assert [(p.heading, p.body.splitlines()[0]) for p in passages] == [
        ("", "intro"), ("A", "text a"), ("A > B", "text b")]


def test_a_new_document_does_not_read_every_passage(tmp_path, monkeypatch) -> None:
    # Each new document first deleted its passages by path, a column FTS5 does not index:
    # a scan of every passage per document, so a first refresh of 20,000 documents took
    # longer than a run may last (knowledge_search never finished it). Only a document
    # indexed before has passages to drop.
    docs = write_corpus(tmp_path / "docs")
    statements: list[str] = []
    connect = sqlite3.connect

    def traced(*args, **kwargs):  # the real connection, its statements written down
        connection = connect(*args, **kwargs)
        connection.set_trace_callback(statements.append)
        return connection

    monkeypatch.setattr(sqlite3, "connect", traced)
    kb = KnowledgeBase(tmp_path / "index.sqlite3")
    assert kb.refresh(docs).added == 4
    assert not [s for s in statements if s.startswith("DELETE FROM passages WHERE")]

    (docs / "team/lunch.txt").write_text("Lunch moved: tacos every Thursday.\n")
    statements.clear()
    assert kb.refresh(docs).updated == 1
    assert [s for s in statements if s.startswith("DELETE FROM passages WHERE")] == [
        "DELETE FROM passages WHERE path = 'team/lunch.txt'"]
    assert kb.search("tacos")[0].path == "team/lunch.txt"
    assert kb.search("soup") == []
