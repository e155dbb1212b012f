"""optiremat.client: from a JAX function to an exact, optimal checkpoint policy.

Importing this package imports JAX. The JAX-free parts of optiremat (the CLI,
the service) never import it.
"""

from optiremat.client.budget import BudgetError, MemoryBudget, memory_budget
from optiremat.client.errors import ConnectionFailed, ProblemError, RemoteError
from optiremat.client.extract import ExtractionError, extract_graph
from optiremat.client.frontier import Frontier, sweep
from optiremat.client.keys import policy_key
from optiremat.client.memory_cache import CacheWarning
from optiremat.client.peak.placement import PlacementError
from optiremat.client.peak.step_graph import extract_step
from optiremat.client.plan import (
    NamesForm,
    PeakPlan,
    Plan,
    PlanError,
    ResidualPlan,
    Verification,
)
from optiremat.client.planfile import PlanFile, PlanFileError, load_plan
from optiremat.client.planning import PlanRequest, optimize
from optiremat.client.plot import plot_frontier
from optiremat.client.policy import KeyPolicy
from optiremat.client.rates import measured_save_price
from optiremat.client.remote import RematClient
from optiremat.client.schedule import ScheduleWarning
from optiremat.client.sharding import ShardingError
from optiremat.client.step import StepError, measured_peak

__all__ = [
    "BudgetError",
    "CacheWarning",
    "ConnectionFailed",
    "ExtractionError",
    "Frontier",
    "KeyPolicy",
    "MemoryBudget",
    "NamesForm",
    "PeakPlan",
    "Plan",
    "PlanRequest",
    "PlanError",
    "PlacementError",
    "ScheduleWarning",
    "PlanFile",
    "PlanFileError",
    "ProblemError",
    "RematClient",
    "ResidualPlan",
    "RemoteError",
    "ShardingError",
    "StepError",
    "Verification",
    "extract_graph",
    "extract_step",
    "load_plan",
    "measured_peak",
    "measured_save_price",
    "memory_budget",
    "optimize",
    "plot_frontier",
    "policy_key",
    "sweep",
]
