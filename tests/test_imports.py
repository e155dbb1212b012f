"""optiremat's modules import no module that imports them back; the solver never JAX.

With a cycle, what a module holds while it runs depends on which module of the
cycle was imported first. The walk reads every import statement of every module
of the package (optiremat/ and the solver/, client/ and service/ folders
pyproject.toml maps under it), at module level and inside functions alike; only the imports a type
checker alone sees (``if TYPE_CHECKING:``) are left out. ``from package import
module`` goes through the package's ``__init__`` and counts as importing it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tools.typecheck import module_paths


def _modules(part: str | None = None) -> dict[str, Path]:
    """Module -> its file, for the whole package or for one part of it."""
    return {name: path for name, path in module_paths().items()
            if part is None or name == part or name.startswith(f"{part}.")}


def _run_time(nodes: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of ``nodes``, less the bodies of ``if TYPE_CHECKING:``."""
    for node in nodes:
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith(
            "TYPE_CHECKING"
        ):
            yield from _run_time(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _run_time(getattr(node, field, []))


def _imported(path: Path) -> set[str]:
    """Every name an import statement of the module names (modules and their members)."""
    names = set()
    for node in _run_time(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import"
            base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports."""
    modules = _modules()
    return {name: {m for m in _imported(path) if m in modules and m != name}
            for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return None
        path.append(module)
        for target in sorted(graph[module]):
            if (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if (cycle := visit(module)) is not None:
            return cycle
    return None


def test_the_walk_sees_imports_in_functions_and_skips_type_checking_ones() -> None:
    graph = _graph()
    assert "optiremat.solver.search" in graph["optiremat.solver.solve"]
    # make_backend imports each backend when first asked for it
    assert "optiremat.solver.backends.scip" in graph["optiremat.solver.backends"]
    # repeats names the search it wraps for type checkers only
    assert "optiremat.solver.search" not in graph["optiremat.solver.repeats"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert _cycle(_graph()) is None


def test_the_solver_never_imports_jax() -> None:
    for name, path in _modules("optiremat.solver").items():
        jax = {m for m in _imported(path) if m == "jax" or m.startswith(("jax.", "jaxlib"))}
        assert not jax, f"{name} imports {sorted(jax)}"
