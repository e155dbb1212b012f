"""mypy on optiremat under the module names the package installs them as.

pyproject.toml maps `optiremat.solver` to solver/ (and client/, service/) with setuptools'
package-dir, and mypy does not read that mapping: plain `mypy` resolves none of
`optiremat.solver.*`, and `mypy solver/graph.py` names the file `solver.graph`, outside
the strict `optiremat.solver.*` override. This hands mypy every module of every package
pyproject.toml lists, each under its installed name, with the settings of [tool.mypy]:

    python tools/typecheck.py                   # every module (what `make test` runs)
    python tools/typecheck.py solver/graph.py   # the same check, reporting these files only
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def package_folders(repo: Path = REPO) -> dict[str, Path]:
    """Each package pyproject.toml lists, and its folder: a package without its own
    package-dir entry lies under its nearest mapped parent's folder, as setuptools puts it."""
    setuptools = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = setuptools.get("package-dir", {})
    folders = {}
    for package in setuptools["packages"]:
        parts = package.split(".")
        cut = next((cut for cut in range(len(parts), 0, -1) if ".".join(parts[:cut]) in mapping),
                   0)
        base = mapping[".".join(parts[:cut])] if cut else ""
        folders[package] = repo.joinpath(base, *parts[cut:])
    return folders


def module_paths(repo: Path = REPO) -> dict[str, Path]:
    """Every module of every listed package (its name, its file)."""
    modules = {}
    for package, folder in package_folders(repo).items():
        for path in sorted(folder.glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def main(argv: list[str]) -> int:
    from mypy import build
    from mypy.errors import CompileError
    from mypy.main import process_options
    from mypy.modulefinder import BuildSource

    asked = {Path(arg).resolve() for arg in argv}
    os.chdir(REPO)  # mypy reports paths as given; give them relative to the repository
    modules = {name: path.relative_to(REPO) for name, path in module_paths().items()}
    unknown = asked - {REPO / path for path in modules.values()}
    if unknown:
        print(f"not a module of a listed package: {', '.join(map(str, sorted(unknown)))}",
              file=sys.stderr)
        return 2
    # The options mypy itself takes from pyproject.toml; the targets are these.
    _, options = process_options(["--config-file", "pyproject.toml"], require_targets=False)
    sources = [BuildSource(str(path), name, None, str(REPO)) for name, path in modules.items()]
    try:
        messages = build.build(sources, options).errors
    except CompileError as error:
        messages = error.messages
    if asked:  # every module is still checked, so that imports resolve; report the asked
        shown = {str(path.relative_to(REPO)) for path in asked}
        messages = [message for message in messages if message.split(":")[0] in shown]
    print("\n".join(messages) or f"Success: no issues found in {len(asked or sources)} files")
    return 1 if any(": error:" in message for message in messages) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
