"""The package's shape: imports inside kvlab go one way (no cycle, function-level imports included), units a
reader can hold in their head (functions <= 60 lines, files <= 400, tests' too; the CLIs <= 150), compact records."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imported(path: Path, package: str) -> set[str]:
    """Every module name an import statement in the file names (a `from a import b` names a and a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
    return names


def import_graph() -> dict[str, set[str]]:
    """kvlab module -> the kvlab modules it imports."""
    paths = {module_name(p): p for p in (ROOT / "kvlab").rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = {m for m in imported(path, package) if m in paths and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None: depth-first search for an edge back into the path."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        for dep in sorted(graph[node]):
            if dep in path:
                return path[path.index(dep) :] + [dep]
            if dep not in done:
                cycle = visit(dep, path + [dep])
                if cycle:
                    return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = None if start in done else visit(start, [start])
        if cycle:
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_inside_kvlab_go_one_way():
    graph = import_graph()
    assert {"kvlab.config", "kvlab.cache", "kvlab.model", "kvlab.engine", "kvlab.kernels"} <= set(graph)
    assert "kvlab.checkpoint" in graph["kvlab.convert"]  # the graph sees imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def long_functions(path: Path, most: int) -> list[str]:
    """'file:function (n lines)' for every function or method in the file longer than `most` lines."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return [
        f"{path.name}:{f.name} ({f.end_lineno - f.lineno + 1} lines)"
        for f in functions
        if f.end_lineno - f.lineno + 1 > most
    ]


def test_long_functions_finds_the_one_over_the_limit(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def short():\n    return 1\n\n\nclass A:\n    def long(self):\n" + "        x = 1\n" * 60)
    assert long_functions(path, 60) == ["m.py:long (61 lines)"]


def test_functions_fit_a_screen_and_files_stay_short():
    sources = [
        *(ROOT / "kvlab").rglob("*.py"),
        *(ROOT / "scripts").rglob("*.py"),
        *(ROOT / "bench").glob("*.py"),
        ROOT / "generate.py",
        ROOT / "eval.py",
    ]
    assert len(sources) > 60
    tests = sorted((ROOT / "tests").glob("*.py"))
    too_long = [entry for path in [*sources, *tests] for entry in long_functions(path, 60)]
    assert not too_long, too_long
    lines = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in [*sources, *tests]}
    long_files = [
        f"{p.relative_to(ROOT)} ({n} lines)" for p, n in lines.items() if n > (150 if p.parent == ROOT else 400)
    ]
    assert not long_files, long_files


MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|root|Users|tmp|mnt|srv|opt)/\w")


def test_committed_records_and_docs_hold_no_machines_paths():
    """Records (runs.json, summaries), docs and code name checkpoints and files by name or relative path."""
    roots = (
        [ROOT / d for d in ("docs", "configs", "bench", "scripts", "kvlab", "tests/data")]
        + list(ROOT.glob("*.md"))
        + list(ROOT.glob("*.py"))
    )
    files = [
        p
        for r in roots
        for p in ([r] if r.is_file() else r.rglob("*"))
        if p.is_file() and p.suffix in (".json", ".jsonl", ".md", ".csv", ".yaml", ".py")
    ]
    assert len(files) > 250  # every committed record, doc, config and source file
    found = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in files
        for m in [MACHINE_PATH.search(p.read_text(encoding="utf-8", errors="replace"))]
        if m
    ]
    assert not found, found[:5]


def test_committed_sweeps_keep_their_records_compactly():
    """docs/sweeps: one records.jsonl and runs.json per config, no directory per run, under 300 files in all."""
    sweeps = ROOT / "docs/sweeps"
    files = [p for p in sweeps.rglob("*") if p.is_file()]
    assert 100 < len(files) < 300
    assert not [p for p in files if p.name.endswith(".jsonl") and p.name != "records.jsonl"]
    assert sorted(p.parent for p in sweeps.glob("*/*/*/records.jsonl")) == sorted(
        p.parent for p in sweeps.glob("*/*/*/runs.json")
    )


def test_results_are_an_index_of_pages_by_question_without_work_history():
    """docs/results.md answers the main questions in one screen and links a page for each; the pages stay readable
    (<= 400 lines) and say what holds, not which issue changed it; every page is linked from the index."""
    index = (ROOT / "docs" / "results.md").read_text()
    pages = sorted((ROOT / "docs" / "results").glob("*.md"))
    assert len(index.splitlines()) <= 150 and pages
    for page in [ROOT / "docs" / "results.md", *pages]:
        text = page.read_text()
        assert len(text.splitlines()) <= 400, page.name
        assert not re.search(r"\bissue \d", text), page.name
    assert all(f"(results/{page.name}" in index for page in pages)
