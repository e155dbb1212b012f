"""The repository's layout: one installed package, optiremat, from four real folders.

pyproject.toml maps optiremat.solver, optiremat.client and optiremat.service to the
solver/, client/ and service/ folders (setuptools' package-dir) and lists every package;
no symbolic link joins them (a Windows checkout turns one into a small text file). Code
outside the package imports it as optiremat.*: `import solver.graph` from the repository
root would load a second copy of every module, with a second CostGraph class.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import tomllib
from pathlib import Path

from mypy import build
from mypy.main import process_options
from mypy.modulefinder import BuildSource

from tests.service_harness import REPO
from tools.typecheck import module_paths, package_folders

# The package's parts and the folder each one is.
PARTS = {"optiremat": "optiremat", "optiremat.solver": "solver", "optiremat.client": "client",
         "optiremat.service": "service"}
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_package_dir_maps_each_part_to_its_folder() -> None:
    assert {"optiremat": "optiremat", **SETUPTOOLS["package-dir"]} == PARTS


def test_the_package_list_is_every_folder_with_modules() -> None:
    on_disk = set()
    for part, folder in PARTS.items():
        # optiremat/ holds only the package's own modules; its parts are the other folders
        found = [] if part == "optiremat" else (REPO / folder).rglob("*")
        for path in [REPO / folder, *found]:
            if path.is_dir() and path.name != "__pycache__" and any(path.glob("*.py")):
                on_disk.add(".".join((part, *path.relative_to(REPO / folder).parts)))
    assert set(SETUPTOOLS["packages"]) == on_disk
    for package, folder in package_folders().items():
        assert (folder / "__init__.py").is_file(), f"{package}: no __init__.py in {folder}"


def test_the_installed_package_finds_each_package_in_its_folder() -> None:
    # The editable install (make's) imports each package from its folder: the names
    # tools/typecheck.py gives mypy are the ones Python imports.
    for package, folder in package_folders().items():
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations is not None, package
        assert [Path(p).resolve() for p in spec.submodule_search_locations] == [folder]


def test_no_tracked_file_is_a_symbolic_link() -> None:
    listing = subprocess.run(["git", "ls-files", "-s"], cwd=REPO, capture_output=True,
                             text=True, check=True, timeout=60).stdout.splitlines()
    assert len(listing) > 100  # it listed the repository
    links = [line.split("\t")[1] for line in listing if line.startswith("120000 ")]
    assert links == []


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_code_outside_the_package_imports_only_optiremat() -> None:
    scripts = [path for folder in ("tests", "bench", "examples", "tools")
               for path in sorted((REPO / folder).rglob("*.py"))]
    assert REPO / "tests" / "test_layout.py" in scripts
    assert "tests" in _top_level_imports(REPO / "tests" / "test_layout.py")  # the walk reads
    parts = {folder for part, folder in PARTS.items() if part != "optiremat"}
    wrong = {str(path.relative_to(REPO)): sorted(_top_level_imports(path) & parts)
             for path in scripts if _top_level_imports(path) & parts}
    assert wrong == {}


def test_mypy_gets_every_module_under_its_installed_name() -> None:
    modules = module_paths()
    assert modules["optiremat.solver.graph"] == REPO / "solver" / "graph.py"
    assert modules["optiremat.service.api.routes"] == REPO / "service/api/routes/__init__.py"
    on_disk = {path for folder in PARTS.values() for path in (REPO / folder).rglob("*.py")
               if path.parent == REPO / "optiremat" or folder != "optiremat"}
    assert set(modules.values()) == on_disk


def test_the_strict_override_applies_to_the_solver_under_its_installed_name(
        tmp_path: Path) -> None:
    # The same untyped function is an error as a solver module and allowed as a module of
    # optiremat itself: the override keys on the name tools/typecheck.py gives.
    probe = tmp_path / "probe.py"
    probe.write_text("def untyped(x):\n    return x\n")
    _, options = process_options(["--config-file", str(REPO / "pyproject.toml")],
                                 require_targets=False)
    options.cache_dir = str(tmp_path / "cache")
    for module, errors in (("optiremat.solver.probe", 1), ("optiremat.probe", 0)):
        result = build.build([BuildSource(str(probe), module, None)], options)
        assert len([m for m in result.errors if "missing a type annotation" in m]) == errors, (
            module, result.errors)


def test_only_what_solves_installs_or_tools() -> None:
    """The base install and the `remote` client (a training host planning through a server)
    go without OR-Tools; the local client and the service solve, so they have it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def solves(requirements: list[str]) -> bool:
        return any(r.partition(">")[0].strip() == "ortools" for r in requirements)

    assert not solves(project["dependencies"]) and not solves(extras["remote"])
    assert solves(extras["client"]) and solves(extras["service"])
    assert set(extras["remote"]) < set(extras["client"])
