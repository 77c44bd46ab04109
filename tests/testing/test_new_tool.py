"""``stargrpc new-tool NAME`` scaffolds a tool and a test that passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from stargrpc.cli import main


def test_the_scaffold_passes_its_own_test(tmp_path: Path) -> None:
    project = tmp_path / "project"
    result = CliRunner().invoke(main, ["new-tool", "word_count",
                                       "--tools-dir", str(project / "tools")])
    assert result.exit_code == 0, result.output
    assert (project / "tools" / "word_count.py").is_file()
    test_file = project / "tests" / "test_word_count.py"
    assert test_file.is_file()

    # Run from elsewhere: the test finds the tool by its path, not by the current directory.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(test_file)], cwd=elsewhere, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout


def test_it_refuses_to_overwrite_and_writes_nothing(tmp_path: Path) -> None:
    tests_dir = tmp_path / "tests"
    tests_dir.mkdir()
    mine = tests_dir / "test_word_count.py"
    mine.write_text("# mine\n")

    result = CliRunner().invoke(main, ["new-tool", "word_count",
                                       "--tools-dir", str(tmp_path / "tools")])

    assert result.exit_code == 1
    assert "not overwriting" in result.output
    assert mine.read_text() == "# mine\n"
    assert not (tmp_path / "tools" / "word_count.py").exists()


def test_it_refuses_a_name_that_is_not_an_identifier(tmp_path: Path) -> None:
    for name in ("Bad-Name", "class", "_private", "../escape"):
        result = CliRunner().invoke(main, ["new-tool", name,
                                           "--tools-dir", str(tmp_path / "tools")])
        assert result.exit_code == 2, (name, result.output)
    assert not (tmp_path / "tools").exists()
