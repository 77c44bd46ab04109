"""``stargrpc kb index`` / ``kb search``: the same index the tool uses, from a shell."""

from __future__ import annotations

from click.testing import CliRunner

from stargrpc.cli import main
from tests.kb.corpus import write_corpus


def test_index_then_refresh_then_search(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("STARGRPC_STATE_DIR", str(tmp_path / "state"))
    docs = write_corpus(tmp_path / "docs")
    runner = CliRunner()

    first = runner.invoke(main, ["kb", "index", str(docs)])
    (docs / "ops/deploy.md").write_text("# Deploying\n\nCanary first, then everyone.\n")
    second = runner.invoke(main, ["kb", "index", str(docs)])
    found = runner.invoke(main, ["kb", "search", "canary"])

    index = tmp_path / "state" / "kb" / "index.sqlite3"
    assert first.exit_code == 0, first.output
    assert first.output == (f"4 documents indexed: 4 added, 0 updated, 0 removed, "
                            f"0 unchanged ({index})\n")
    assert "1 updated, 0 removed, 3 unchanged" in second.output
    assert found.exit_code == 0
    assert found.output.startswith("1. ops/deploy.md > Deploying  (")
    assert "**Canary**" in found.output


def test_index_of_a_missing_folder_says_so(tmp_path) -> None:
    result = CliRunner().invoke(main, ["kb", "index", str(tmp_path / "nope"),
                                       "--index", str(tmp_path / "i.sqlite3")])

    assert result.exit_code == 2
    assert "does not exist" in result.output
