"""scripts/render_docs.py: the docs' results tables are their sources' (bench and evaluation outputs), checked."""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import render_docs  # noqa: E402

SOURCE = "# a bench\n\ntext\n\n| a | b |\n|---|---|\n| 1 | 2.5 |\n\nmore\n\n| c |\n|---|\n| 7 |\n"


def tree(tmp_path, doc: str):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "sweeps").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "x_cpu.md").write_text(SOURCE)
    (tmp_path / "README.md").write_text("# readme\n")
    (tmp_path / "docs" / "sweeps" / "own.md").write_text("<!-- table nowhere.md -->\n<!-- end table -->\n")  # a source
    (tmp_path / "docs" / "page.md").write_text(doc)
    return tmp_path / "docs" / "page.md"


def test_the_committed_docs_match_their_sources(capsys):
    assert render_docs.main(["--check"]) == 0
    assert "every marked table matches its source" in capsys.readouterr().out


def test_a_number_edited_by_hand_is_caught_and_rendering_restores_the_source(tmp_path, capsys):
    first, second = "<!-- table bench/results/x_cpu.md -->\n", "<!-- table bench/results/x_cpu.md 2 -->\n"
    doc = f"intro\n{first}<!-- end table -->\nmiddle\n{second}<!-- end table -->\n"
    page = tree(tmp_path, doc)
    assert render_docs.main([], root=tmp_path) == 0
    rendered = page.read_text()
    tables = "| a | b |\n|---|---|\n| 1 | 2.5 |\n", "| c |\n|---|\n| 7 |\n"
    assert rendered == f"intro\n{first}{tables[0]}<!-- end table -->\nmiddle\n{second}{tables[1]}<!-- end table -->\n"
    assert render_docs.main(["--check"], root=tmp_path) == 0
    page.write_text(rendered.replace("2.5", "2.6"))
    assert render_docs.main(["--check"], root=tmp_path) == 1
    said = "tables differ from their sources in: docs/page.md; run python scripts/render_docs.py"
    assert said in capsys.readouterr().err
    assert render_docs.main([], root=tmp_path) == 0 and page.read_text() == rendered


@pytest.mark.parametrize(
    "marker, error",
    [
        ("bench/results/gone.md", "docs/page.md: the table's source bench/results/gone.md does not exist"),
        ("bench/results/x_cpu.md 3", "docs/page.md: bench/results/x_cpu.md has 2 table(s), not a table 3"),
    ],
)
def test_a_marker_without_its_table_is_one_line_naming_it(tmp_path, marker, error):
    tree(tmp_path, f"<!-- table {marker} -->\n<!-- end table -->\n")
    with pytest.raises(ValueError, match=f"^{error}$".replace("(", r"\(").replace(")", r"\)")):
        render_docs.main(["--check"], root=tmp_path)
