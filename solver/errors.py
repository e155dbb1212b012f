"""``OptirematError``, the root of every error optiremat raises on purpose.

Each domain error also keeps the builtin base it had before the root existed
(``GraphError`` is a ``ValueError``, ``PlanError`` a ``RuntimeError``), so code
catching either one catches it. Here, in the JAX-free solver, because the solver,
the client and the CLI all raise or catch it, and the service never imports JAX.
"""

from __future__ import annotations


class OptirematError(Exception):
    """Base of optiremat's own errors: ``except optiremat.OptirematError`` catches a bad
    graph or budget, a failed extraction, a plan file that does not load and a server
    that could not be reached or said no, and nothing else."""
