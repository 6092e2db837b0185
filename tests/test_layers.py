"""The package's imports point one way (DESIGN.md, "Layers"): no module imports, even for type checking
only, a module that imports it back, directly or through others."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "impala"


def imports_of(path: Path) -> set[str]:
    """The package modules `path` imports anywhere in it (inside functions and `if TYPE_CHECKING:` too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module == "impala":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("impala."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("impala."))
    return found - {path.stem}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> modules it imports) as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for other in sorted(graph.get(module, ())):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state and (cycle := visit(other)) is not None:
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_find_cycle_finds_one_through_three_modules() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_imports_of_reads_type_checking_and_function_level_imports(tmp_path: Path) -> None:
    module = tmp_path / "learner.py"
    module.write_text("from typing import TYPE_CHECKING\nfrom impala import losses, vtrace\n"
                      "if TYPE_CHECKING:\n    from impala.distributed import X\n"
                      "def f():\n    import impala.model\n")
    assert imports_of(module) == {"losses", "vtrace", "distributed", "model"}


def test_the_package_has_no_import_cycle() -> None:
    graph = {path.stem: imports_of(path) for path in PACKAGE.glob("*.py")}
    assert {"learner", "distributed", "training"} <= set(graph)
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"
