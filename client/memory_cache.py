"""XLA's memory analyses kept on disk, for the processes that plan after this one.

Planning compiles the step under its calibration's built-ins and under each plan it
weighs (``client.step.lowered_memory``), and remembers each figure for the life of the
process. A fresh process planning the same step (a training script launched again, a
sweep's next budget in a process of its own, the hosts of one job sharing a folder)
would compile them all again: minutes each on a large model. Where
``OPTIREMAT_CACHE_DIR`` names a folder, each program's analysis is kept there too, one
small JSON file per program, named by a hash of all the figure depends on: the
program's StableHLO text, the compile options, the platform and its devices, the jax
and jaxlib releases, the backend's own version, the XLA flags of the environment and
the JAX settings that reach the compiler. Only a compile makes an entry, so a hit is
the figure XLA gave for that program; none is ever made up.

A file that cannot be read or parsed is a miss (compiled, and written again); a folder
that cannot be written warns once and planning goes on. Unset, nothing is read or
written.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import tempfile
import warnings
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import jax

CACHE_DIR_ENV = "OPTIREMAT_CACHE_DIR"
# Raised when an entry's fields or their meaning change: older entries are then not read.
FORMAT = 1
# JAX settings that become compile options (``jax._src.compiler.get_compile_options``),
# so that two processes differing in one do not share figures.
_COMPILER_SETTINGS = ("jax_compiler_enable_remat_pass", "jax_exec_time_optimization_effort",
                      "jax_memory_fitting_effort", "jax_xla_profile_version",
                      "jax_enable_x64")
# The environment variables XLA reads its flags from.
_FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


class CacheWarning(UserWarning):
    """The cache folder could not be written: planning compiles as if it were unset."""


def cache_dir() -> Path | None:
    """The folder ``OPTIREMAT_CACHE_DIR`` names, or None where it is unset or empty."""
    folder = os.environ.get(CACHE_DIR_ENV, "")
    return Path(folder) if folder else None


def program_hash(lowered: jax.stages.Lowered) -> str:
    """The hash of ``lowered``'s StableHLO text: what names a program, in this process's
    memory (``client.step``) and in the folder's entries."""
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()


def entry_name(text_hash: str, options: Mapping[str, object] | None) -> str:
    """The file name of the analysis of the program whose StableHLO text hashes to
    ``text_hash`` (``program_hash``), compiled with ``options`` in this process's
    environment."""
    described = json.dumps([FORMAT, text_hash, sorted((options or {}).items()),
                            _environment()], default=str)
    return hashlib.sha256(described.encode()).hexdigest() + ".json"


def kept_figures(name: str) -> dict[str, int] | None:
    """The figures kept under ``name``; None where there are none, or none readable."""
    folder = cache_dir()
    if folder is None:
        return None
    try:
        fields = json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(fields, dict) and fields
            and all(isinstance(v, int) and not isinstance(v, bool) for v in fields.values())):
        return None
    return fields


def keep_figures(name: str, fields: Mapping[str, int]) -> None:
    """Keep ``fields`` under ``name``: written whole or not at all (a reader in another
    process never sees half a file)."""
    folder = cache_dir()
    if folder is None:
        return
    partial = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as f:
            partial = f.name
            json.dump(dict(fields), f)
        os.replace(partial, folder / name)
    except OSError as err:
        if partial is not None:  # a full disk, say: no half-written file is left behind
            Path(partial).unlink(missing_ok=True)
        if str(folder) not in _WARNED:
            _WARNED.add(str(folder))
            warnings.warn(f"{CACHE_DIR_ENV}={folder} cannot be written "
                          f"({err.strerror or err}): what this process compiles is not kept "
                          f"for the next", CacheWarning, stacklevel=2)


_WARNED: set[str] = set()  # the folders warned about, once each


@functools.cache
def _environment() -> list[object]:
    """What a program's memory analysis depends on beyond its text and options. Fixed
    for the life of a process: XLA reads its flags once, when the backend starts."""
    devices = jax.devices()
    settings = {name: getattr(jax.config, name, None) for name in _COMPILER_SETTINGS}
    return [jax.__version__, _release("jaxlib"), jax.default_backend(),
            devices[0].client.platform_version,
            sorted(Counter(d.device_kind for d in devices).items()), settings,
            {name: os.environ.get(name, "") for name in _FLAG_VARIABLES}]


def _release(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""
