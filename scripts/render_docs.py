"""Rebuild the results tables the docs copy from generated files, so a rerun that changes numbers changes the docs.

    python scripts/render_docs.py           # rewrite every marked table in README.md and docs/
    python scripts/render_docs.py --check   # exit 1, naming each table that differs from its source

A marked table sits between `<!-- table SOURCE -->` (or `<!-- table SOURCE N -->`) and `<!-- end table -->`:
it is the Nth Markdown table (default: the first) of SOURCE, a file a bench or an evaluation wrote (a path from
the repository root: `bench/results/*.md`, `docs/sweeps/*/leaderboard.md`).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- table (\S+)(?: (\d+))? -->\n)(.*?)(<!-- end table -->)", re.DOTALL)


def tables(text: str) -> list[str]:
    """The Markdown tables of `text` (runs of lines starting with "|"), each with its final newline."""
    found, current = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            found.append("\n".join(current) + "\n")
            current = []
    return found


def render(text: str, root: Path, where: str) -> str:
    """`text` with every marked table replaced by its source's; `where` names the document in errors."""

    def table(match: re.Match) -> str:
        source, n = root / match[2], int(match[3] or 1)
        if not source.is_file():
            raise ValueError(f"{where}: the table's source {match[2]} does not exist")
        found = tables(source.read_text())
        if not 1 <= n <= len(found):
            raise ValueError(f"{where}: {match[2]} has {len(found)} table(s), not a table {n}")
        return match[1] + found[n - 1] + match[5]

    return BLOCK.sub(table, text)


def documents(root: Path) -> list[Path]:
    """README.md and the Markdown under docs/ but the sweeps' own files (which are sources)."""
    docs = [p for p in sorted((root / "docs").rglob("*.md")) if "sweeps" not in p.relative_to(root).parts]
    return [root / "README.md", *docs]


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs from its source")
    args = p.parse_args(argv)
    stale = []
    for path in documents(root):
        text = path.read_text()
        rendered = render(text, root, str(path.relative_to(root)))
        if rendered != text:
            stale.append(str(path.relative_to(root)))
            if not args.check:
                path.write_text(rendered)
    if args.check and stale:
        fix = "run python scripts/render_docs.py"
        print(f"tables differ from their sources in: {', '.join(stale)}; {fix}", file=sys.stderr)
        return 1
    print("every marked table matches its source" if args.check else f"rewrote: {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        sys.exit(f"error: {e}")
