"""The README's Python code runs as written (against a real server), and so do the examples."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service_harness import REPO, Server

# Among the suite's longest: handed out first (tests/conftest.py).
pytestmark = pytest.mark.slow

BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
SHELL = re.compile(r"^```sh\n(.*?)^```", re.DOTALL | re.MULTILINE)


def test_readme_python_blocks_run_in_order(server: Server, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = BLOCK.findall((REPO / "README.md").read_text())
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPTIREMAT_SERVER", server.url)
    namespace: dict = {"__name__": "readme"}
    for number, code in enumerate(blocks, 1):
        exec(compile(code, f"README.md python block {number}", "exec"), namespace)
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("example,needs", [("scan_jax.py", "jax"), ("flax_nnx.py", "flax"),
                                           ("equinox_mlp.py", "equinox")])
def test_examples_run(example: str, needs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip(needs)  # in the dev extra; skipped only where it cannot install
    monkeypatch.chdir(REPO)
    runpy.run_path(os.fspath(REPO / "examples" / example), run_name="__main__")


def test_readme_cli_block_runs_as_written_and_its_outputs_are_ignored(tmp_path: Path) -> None:
    (block,) = [b for b in SHELL.findall((REPO / "README.md").read_text())
                if "optiremat extract" in b]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands and all(c.startswith(".venv/bin/optiremat ") for c in commands)
    # A repository root of its own: the venv this suite runs in, the examples.
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "bin").symlink_to(Path(sys.executable).parent)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    for command in commands:
        result = subprocess.run(command, shell=True, cwd=tmp_path, text=True,
                                capture_output=True, timeout=300)
        assert result.returncode == 0, f"{command}: {result.stderr}"
    written = sorted(p.name for p in tmp_path.iterdir() if p.name not in (".venv", "examples"))
    assert {"loss.graph.json", "plan.json", "frontier.png"} <= set(written)
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=REPO,
                             text=True, capture_output=True).stdout.split()
    assert ignored == written, "README outputs git would list as untracked"
    for name in ("frontier.png", "levers.png", "x.plan.json"):  # the Python blocks', bench's
        assert subprocess.run(["git", "check-ignore", "-q", "--no-index", name],
                              cwd=REPO).returncode == 0, name
