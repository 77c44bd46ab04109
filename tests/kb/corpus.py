"""A small corpus the knowledge-base tests index."""

from __future__ import annotations

from pathlib import Path

DOCS = {
    "ops/backups.md": (
        "# Backups\n\nNightly backups of the PostgreSQL database run at 02:00.\n\n"
        "## Restoring a backup\n\nTo restore a backup, stop the service and run "
        "pg_restore against the newest dump. Restoring takes about ten minutes.\n"),
    "ops/deploy.md": (
        "# Deploying\n\nDeploys go through the pipeline; a deploy needs two approvals.\n\n"
        "## Rollback\n\nRoll back by redeploying the previous tag.\n"),
    "team/lunch.txt": "Lunch is at noon. The cafeteria serves soup on Fridays.\n",
    "notes/vacation.md": "# Vacation\n\nAsk your manager two weeks before.\n",
    "notes/.hidden.md": "# Secret\n\nrestore restore restore backup backup\n",
    "image.png": "not a document",
}


def write_corpus(root: Path) -> Path:
    """Writes :data:`DOCS` under ``root``; returns it."""
    for name, text in DOCS.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root
