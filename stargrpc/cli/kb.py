"""``stargrpc kb``: build, refresh and query the knowledge-base index locally."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from stargrpc.cli.client_commands import terminal_safe
from stargrpc.kb import KnowledgeBase, default_index_path
from stargrpc.settings import Settings

index_option = click.option(
    "--index", "index_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
    help="The index file [env STARGRPC_KB_INDEX_PATH; default <state_dir>/kb/index.sqlite3].")
config_option = click.option(
    "--config", "config_file", type=click.Path(path_type=Path, exists=True), default=None,
    help="A TOML settings file [env STARGRPC_CONFIG].")


def _knowledge_base(index_path: Path | None, config_file: Path | None) -> tuple[KnowledgeBase,
                                                                                 Settings]:
    settings = Settings.load(config_file, kb_index_path=index_path)
    return KnowledgeBase(default_index_path(settings)), settings


@click.group()
def kb() -> None:
    """The knowledge base that the knowledge_search tool searches."""


@kb.command("index")
@click.argument("folder", required=False, type=click.Path(path_type=Path, file_okay=False))
@index_option
@config_option
def index_command(folder: Path | None, index_path: Path | None,
                  config_file: Path | None) -> None:
    """Build or refresh (incrementally) the index of FOLDER [default: kb_dir]."""
    knowledge, settings = _knowledge_base(index_path, config_file)
    folder = folder or settings.kb_dir
    if folder is None:
        raise click.UsageError("give FOLDER or set kb_dir (STARGRPC_KB_DIR)")
    try:
        stats = knowledge.refresh(folder)
    except FileNotFoundError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(f"{stats.describe()} ({knowledge.index_path})")


@kb.command("search")
@click.argument("query")
@click.option("--limit", type=click.IntRange(1, 50), default=5, show_default=True)
@index_option
@config_option
def search_command(query: str, limit: int, index_path: Path | None,
                   config_file: Path | None) -> None:
    """Search the index (as it is; run `kb index` first) and print the best passages."""
    knowledge, _ = _knowledge_base(index_path, config_file)
    for rank, hit in enumerate(knowledge.search(query, limit), 1):
        where = f"{hit.path} > {hit.heading}" if hit.heading else hit.path
        # The documents' names and text are shown, never obeyed by the terminal.
        click.echo(terminal_safe(f"{rank}. {where}  ({hit.score:.3f})\n   {hit.snippet}"))
