"""What optiremat relies on in JAX's remat, pinned on the installed JAX.

CI runs the suite on the oldest and the newest supported JAX, so each of these
holds on both (docs/design.md, "Adding a JAX version"). Offload's
``device_put`` pairs are pinned in ``tests/test_offload.py`` (``_copies_to``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

from optiremat.client import _jax_internals as jx


def _two_named(x, w):
    a = checkpoint_name(jnp.sin(x @ w), "a")
    b = checkpoint_name(jnp.cos(a @ w), "b")
    return jnp.sum(jnp.tanh(b @ w))


ARGS = (jnp.ones((8, 8)), jnp.full((8, 8), 0.1))


@pytest.fixture(params=[False, True], ids=["remat2", "remat3"])
def remat3(request) -> Iterator[bool]:
    before = jax.config.jax_remat3
    jax.config.update("jax_remat3", request.param)
    try:
        yield request.param
    finally:
        jax.config.update("jax_remat3", before)


def _padded(version: str) -> tuple[int, ...]:
    return (*jx._version_tuple(version), 0, 0)[:3]


def test_the_client_checks_the_range_pyproject_installs() -> None:
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    client = project["project"]["optional-dependencies"]["client"]
    for package in ("jax", "jaxlib"):
        spec = next(d for d in client if re.match(rf"{package}[<>=]", d))
        bounds = re.fullmatch(rf"{package}>=([\d.]+),<([\d.]+)", spec)
        assert bounds is not None, spec
        assert (_padded(bounds[1]), _padded(bounds[2])) == jx.SUPPORTED_JAX, spec


def test_a_jax_outside_the_range_is_refused_naming_the_range() -> None:
    script = ("import jax; jax.__version__ = '0.13.0'\n"
              "import optiremat.client._jax_internals")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    assert "ImportError: optiremat supports jax >= 0.10.0 and < 0.13.0; found jax 0.13.0" \
        in run.stderr, run.stderr


def test_remat3_is_off_by_default() -> None:
    """A key policy (a callable over (prim, avals, params)) is what jax.checkpoint consults
    by default; where remat3 is switched on, a plan still builds its checkpoints on this
    path (tests/test_remat3.py)."""
    assert jax.config.jax_remat3 is False


def test_a_names_policy_saves_exactly_its_names_on_both_remat_paths(remat3: bool) -> None:
    policy = jax.checkpoint_policies.save_only_these_names("a")
    residuals = jx.saved_residuals(jax.checkpoint(_two_named, policy=policy), *ARGS)
    named = [note for _, note in residuals if note.startswith("named")]
    arguments = [note for _, note in residuals if "argument" in note]
    assert len(named) == 1 and named[0].startswith("named 'a'"), residuals
    assert len(arguments) == 2 and len(residuals) == 3, residuals


def test_the_default_path_offers_a_key_policy_every_known_equation() -> None:
    offered: list[tuple[str, tuple, dict]] = []

    def recompute_all(prim, *avals, **params):
        offered.append((prim.name, avals, params))
        return False

    residuals = jx.saved_residuals(jax.checkpoint(_two_named, policy=recompute_all), *ARGS)
    names = {name for name, _, _ in offered}
    assert {"dot_general", "sin", "cos", "name"} <= names, names
    assert all(hasattr(aval, "shape") for _, avals, _ in offered for aval in avals)
    # Recomputing everything leaves only the two arguments the backward pass reads.
    assert [note for _, note in residuals if not note.startswith("from the argument")] == []
