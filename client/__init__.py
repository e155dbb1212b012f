"""optiremat.client: from a JAX function to an exact, optimal checkpoint policy.

The public surface is imported lazily so that ``client.cli`` (and through it the
service) can start without importing JAX.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "extract_graph": "client.extract",
    "ExtractionError": "client.extract",
    "optimize": "client.plan",
    "Plan": "client.plan",
    "PlanError": "client.plan",
    "NamesForm": "client.plan",
    "Verification": "client.plan",
    "KeyPolicy": "client.policy",
    "policy_key": "client.keys",
    "RematClient": "client.remote",
    "RemoteError": "client.errors",
    "ProblemError": "client.errors",
    "ConnectionFailed": "client.errors",
    "memory_budget": "client.budget",
    "MemoryBudget": "client.budget",
    "BudgetError": "client.budget",
    "sweep": "client.frontier",
    "Frontier": "client.frontier",
    "plot_frontier": "client.plot",
    "PlanFile": "client.planfile",
    "load_plan": "client.planfile",
    "OffloadOptions": "solver.offload",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'client' has no attribute {name!r}")
    return getattr(import_module(module), name)
