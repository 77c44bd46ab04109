"""The FTS5 index: BM25 ranking, snippets, incremental refresh."""

from __future__ import annotations

import os

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
