"""knowledge_search: full-text search over the configured folder of documents.

The folder is ``kb_dir`` (Markdown and text files); the index is SQLite FTS5 at
``kb_index_path`` (default ``<state_dir>/kb/index.sqlite3``). Each call first refreshes the
index incrementally (only changed files are re-read), so edits show up without a restart;
``stargrpc kb index DIR`` does the same from the command line.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pydantic import BaseModel, Field

from stargrpc import ToolContext, ToolFailed, tool
from stargrpc.kb import KnowledgeBase, default_index_path

#: The threads the index's work runs in: not asyncio's default executor, whose handful of
#: threads the server's own work shares (a sandbox's folder, a session's files). Calls that
#: wait for the index's write lock while another refreshes it (up to SQLite's 30 s) wait
#: here, holding none of those.
_KB_THREADS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="knowledge-base")


class KnowledgeSearchArgs(BaseModel):
    query: str = Field(min_length=1, max_length=1000, description="What to look for, in "
                       "plain words.")
    limit: int = Field(5, ge=1, le=50, description="Most passages to return.")


class Passage(BaseModel):
    rank: int
    path: str = Field(description="The document, relative to the knowledge-base folder.")
    heading: str = Field(description="Heading trail of the passage.")
    snippet: str = Field(description="The matching text, matches wrapped in **.")
    score: float = Field(description="BM25 relevance; higher is better.")


class KnowledgeSearchResult(BaseModel):
    query: str
    passages: list[Passage]


@tool(kind="search", categories=("knowledge",), read_only=True, idempotent=True,
      output_model=KnowledgeSearchResult)
async def knowledge_search(ctx: ToolContext, args: KnowledgeSearchArgs) -> KnowledgeSearchResult:
    """Search the knowledge base and return the best passages with paths and snippets.

    Full-text search (BM25) over the configured folder of Markdown/text documents; the
    index is refreshed incrementally first, so edited files are found.
    """
    folder = ctx.settings.kb_dir
    if folder is None:
        raise ToolFailed("no knowledge base is configured (set kb_dir)", code="KB_NOT_CONFIGURED")
    kb = KnowledgeBase(default_index_path(ctx.settings))
    async with ctx.step("Refreshing the index", kind="search") as step:
        try:
            stats = await asyncio.get_running_loop().run_in_executor(
                _KB_THREADS, kb.refresh, folder)
        except FileNotFoundError as exc:
            raise ToolFailed(str(exc), code="KB_MISSING") from exc
        await step.delta(stats.describe() + "\n")
    async with ctx.step(f"Searching for {args.query[:80]!r}", kind="search") as step:
        hits = await asyncio.get_running_loop().run_in_executor(
            _KB_THREADS, kb.search, args.query, args.limit)
        for rank, hit in enumerate(hits, 1):
            where = f"{hit.path} > {hit.heading}" if hit.heading else hit.path
            await step.delta(f"{rank}. {where}\n")
        step.summary = f"{len(hits)} passages"
    return KnowledgeSearchResult(query=args.query, passages=[
        Passage(rank=rank, path=h.path, heading=h.heading, snippet=h.snippet, score=h.score)
        for rank, h in enumerate(hits, 1)])
