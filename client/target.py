"""``MODULE:FUNCTION`` for the command line: a function and the arguments to trace it with.

``MODULE`` is a dotted module name importable from the current directory
(``models.mlp``) or a path to a Python file (``models/mlp.py``). The module
defines ``FUNCTION`` and, next to it, the example arguments: an attribute
(``example_args`` by default, another name with ``--args``) holding either a
tuple of positional arguments or a callable with no parameters that returns
one. A callable is preferred: building arrays only when asked keeps importing
the module cheap. A value that is not a tuple is the single argument.

Example ``model.py``::

    import jax.numpy as jnp

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    def example_args():
        return jnp.ones((64, 64)), jnp.ones((8, 64))

Then ``optiremat extract model.py:loss`` writes ``loss.graph.json``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from optiremat.solver.errors import OptirematError

DEFAULT_ARGS = "example_args"


class TargetError(OptirematError, ValueError):
    """The ``MODULE:FUNCTION`` spec cannot be loaded as described."""


def load_module(module: str) -> ModuleType:
    if module.endswith(".py") or os.sep in module or "/" in module:
        path = Path(module).resolve()
        if not path.is_file():
            raise TargetError(f"no such file: {module}")
        sys.path.insert(0, str(path.parent))  # its sibling modules import as usual
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise TargetError(f"cannot import {module} as a Python module")
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = loaded
        spec.loader.exec_module(loaded)
        return loaded
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # console scripts do not put it there
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise TargetError(f"cannot import {module!r}: {exc}") from exc


def load_target(spec: str, args_name: str = DEFAULT_ARGS) -> tuple[Callable, tuple]:
    """The function and positional arguments that ``spec`` names."""
    module_name, sep, function_name = spec.rpartition(":")
    if not sep or not module_name or not function_name:
        raise TargetError(f"expected MODULE:FUNCTION (like models.py:loss), got {spec!r}")
    module = load_module(module_name)
    fun = getattr(module, function_name, None)
    if not callable(fun):
        raise TargetError(f"{module_name} has no function {function_name!r}")
    if not hasattr(module, args_name):
        raise TargetError(
            f"{module_name} defines no {args_name!r}: add `def {args_name}(): return (...)` "
            "returning the arguments to trace the function with, or name another with --args")
    found: Any = getattr(module, args_name)
    args = found() if callable(found) else found
    return fun, args if isinstance(args, tuple) else (args,)
