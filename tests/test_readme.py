"""The README's Python code runs as written (against a real server), and so do the examples."""

from __future__ import annotations

import os
import re
import runpy
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service_harness import REPO, Server, running_server

BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running_server(tmp_path_factory)


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
