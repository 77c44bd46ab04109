"""The knowledge base behind ``knowledge_search``: Markdown/text documents in SQLite FTS5.

- :mod:`stargrpc.kb.passages` — cutting documents into passages.
- :mod:`stargrpc.kb.index` — :class:`KnowledgeBase`: incremental refresh, BM25 search.

``stargrpc kb index DIR`` builds or refreshes the index from the command line.
"""

from __future__ import annotations

from stargrpc.kb.index import Hit, KnowledgeBase, RefreshStats, default_index_path

__all__ = ["Hit", "KnowledgeBase", "RefreshStats", "default_index_path"]
