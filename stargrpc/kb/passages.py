"""Splitting a document into passages: the unit the knowledge base ranks and returns.

Markdown is cut at its headings (each passage carries its heading trail, e.g.
``Install > Linux``); plain text at blank lines. Long sections are cut again at paragraph
boundaries so a passage stays short enough to quote.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Longest passage, in characters (a single longer paragraph is kept whole).
MAX_PASSAGE_CHARS = 2000
#: File suffixes read as Markdown; other indexed suffixes are plain text.
MARKDOWN_SUFFIXES = (".md", ".markdown")
#: Every suffix the knowledge base indexes.
INDEXED_SUFFIXES = (*MARKDOWN_SUFFIXES, ".txt", ".rst")

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Passage:
    """One searchable piece of a document."""

    heading: str
    body: str


def split_document(text: str, *, markdown: bool) -> list[Passage]:
    """The passages of a document, in order; empty sections are dropped."""
    sections = _markdown_sections(text) if markdown else [("", text)]
    passages: list[Passage] = []
    for heading, body in sections:
        for chunk in _chunks(body):
            passages.append(Passage(heading, chunk))
        if heading and not body.strip():
            passages.append(Passage(heading, ""))
    return passages


def _markdown_sections(text: str) -> list[tuple[str, str]]:
    sections: list[tuple[str, str]] = []
    trail: list[str] = []
    lines: list[str] = []
    heading = ""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        match = None if fenced else _HEADING.match(line)
        if match is None:
            lines.append(line)
            continue
        sections.append((heading, "\n".join(lines)))
        level = len(match.group(1))
        trail = [*trail[:level - 1], match.group(2)]
        heading = " > ".join(t for t in trail if t)
        lines = []
    sections.append((heading, "\n".join(lines)))
    return sections


def _chunks(body: str) -> list[str]:
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", body) if p.strip()]
    chunks: list[str] = []
    current = ""
    for paragraph in paragraphs:
        if current and len(current) + len(paragraph) + 2 > MAX_PASSAGE_CHARS:
            chunks.append(current)
            current = paragraph
        else:
            current = f"{current}\n\n{paragraph}" if current else paragraph
    if current:
        chunks.append(current)
    return chunks
