"""``optimize``: from a JAX function and a budget to a plan.

``optimize`` reads its keyword arguments into one ``PlanRequest``, traces the
function once, and hands both to the planner of the budget's meaning: the peak
planner (``client.peak.planner``: the compiled step's peak, a ``PeakPlan``) or
the residual planner below (one checkpoint's residuals, a ``ResidualPlan``).
``RematClient`` calls the same ``plan_for`` with the server's solve.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

import jax
from pydantic import ValidationError

from optiremat.client.budget import resolve_budget, split_auto_keywords
from optiremat.client.extract import Traced, graph_of_traced, trace
from optiremat.client.frameworks import Framework, Saveable
from optiremat.client.peak.priced import price_problem
from optiremat.client.plan import (
    OFFLOAD_DST,
    Plan,
    PlanError,
    ResidualPlan,
    names_form,
)
from optiremat.client.schedule import SCHEDULES, Schedule
from optiremat.client.step import Step
from optiremat.solver.graph import CostGraph
from optiremat.solver.out_of_process import local_solve
from optiremat.solver.solution import InfeasibleBudgetError, SolveOptions
from optiremat.solver.solve import Solver
from optiremat.solver.step import Memory
from optiremat.solver.validation_message import validation_message


@dataclass(frozen=True)
class PlanRequest:
    """What ``optimize`` was asked for, read once from its keyword arguments."""

    budget: int | str  # bytes, "12MiB", or "auto"
    memory: Memory  # what the budget means
    step: Step  # argnums and donate_argnums of the training step
    tie: bool  # decide per policy key (else per equation: residual plans only)
    refine: bool  # fit a peak plan to its own measured peak
    auto: dict[str, Any]  # budget="auto"'s keywords (client.budget)
    options: SolveOptions  # validated here, once: every solve takes them as they are
    scopes: tuple[str, ...] = ()  # name scopes whose equations are the blocks (regions=)
    layer_groups: bool = True  # layers may be planned apart (client.peak.apart)
    schedule: Schedule = "process"  # the compile the budget holds under (client.schedule)
    saveable: Saveable = Saveable()  # what the plan may save (client.frameworks)
    save_price: Fraction | None = None  # FLOPs per saved byte (client.peak.priced)

    @classmethod
    def of(cls, budget: int | str, tie: bool, keywords: dict[str, Any]) -> PlanRequest:
        options, auto = split_auto_keywords(keywords)
        memory = Memory(options.pop("memory", Memory.PEAK))
        step = Step.of(options.pop("argnums", 0), options.pop("donate_argnums", ()))
        refine, scopes = options.pop("refine", True), options.pop("regions", None)
        saveable = Saveable.of(options.pop("saveable", "all"))
        layer_groups = options.pop("layer_groups", saveable.framework is None)
        if not isinstance(layer_groups, bool):
            raise PlanError(f"layer_groups= takes True or False, not {layer_groups!r}")
        if saveable.framework is not None:
            options = _as_framework_takes(saveable.framework, options, layer_groups)
        save_price = _save_price(options.pop("save_price", None), memory, options)
        schedule = options.pop("schedule", "process")
        if schedule not in SCHEDULES:
            raise PlanError(f"schedule= takes one of {', '.join(map(repr, SCHEDULES))}, not "
                            f"{schedule!r}")
        return cls(budget=budget, memory=memory,
                   step=step, tie=tie, refine=refine, auto=auto,
                   options=_solve_options(options), scopes=_scopes(scopes, memory),
                   layer_groups=layer_groups, schedule=schedule, saveable=saveable,
                   save_price=save_price)

    @property
    def offload(self) -> bool:
        return self.options.offload is not None

    def tied(self) -> SolveOptions:
        """The options of a solve tied by policy key."""
        return self.options.model_copy(update={"tie": True})

    def budget_bytes(self, traced: Traced, graph: CostGraph | None = None) -> int:
        """The budget in bytes (``"auto"`` sized for ``traced``; a residual budget's
        ``"auto"`` also reads ``graph``)."""
        return resolve_budget(self.budget, traced, graph, self.auto, self.step, self.memory)


def _as_framework_takes(framework: Framework, options: dict[str, Any],
                        layer_groups: bool) -> dict[str, Any]:
    """The solve options of a plan for ``framework``'s config: one policy per stack, not
    nested where the framework does not nest. Asking otherwise is refused here, before
    any trace, rather than answered with a plan its export refuses."""
    if layer_groups:
        raise PlanError(f"saveable={framework.key!r}: {framework.title} takes one policy per "
                        "stack, so its layers cannot be planned apart (layer_groups=True)")
    if framework.nests:
        return options
    if options.get("nest", False):
        raise PlanError(f"saveable={framework.key!r}: {framework.title} does not nest a "
                        "stack's layers in rematerialised groups (nest=True)")
    return {**options, "nest": False}


def _save_price(price: object, memory: Memory, options: dict[str, Any]) -> Fraction | None:
    """``optimize(..., save_price=)``: FLOPs per saved byte, a finite number >= 0."""
    if price is None:
        return None
    if (problem := price_problem(price)) is not None:
        raise PlanError(problem)
    if memory != Memory.PEAK:
        raise PlanError("save_price= prices the saves of the training step: it needs "
                        "memory='peak'")
    if options.get("offload") is not None:
        raise PlanError("save_price= and offload= cannot be combined: an offload plan is "
                        "priced in estimated seconds already (OffloadOptions' rates)")
    assert isinstance(price, int | float | Fraction)
    return Fraction(price)


def _scopes(regions: object, memory: Memory) -> tuple[str, ...]:
    """``optimize(..., regions=[...])``: the name scopes that are the blocks."""
    if regions is None:
        return ()
    if (not isinstance(regions, list | tuple) or not regions
            or not all(isinstance(r, str) and r.strip("/") for r in regions)):
        raise PlanError(f"regions= takes a non-empty list of name-scope prefixes (a Flax "
                        f"module path such as 'layers_', a jax.named_scope), not {regions!r}")
    if memory != Memory.PEAK:
        raise PlanError("regions= places remat regions in the training step: it needs "
                        "memory='peak'")
    return tuple(regions)


def optimize(fun: Callable, *args, budget: int | str, memory: Literal["peak", "residuals"] = "peak",
             tie: bool = True, argnums: int | Sequence[int] = 0,
             donate_argnums: int | Sequence[int] = (), refine: bool = True,
             **options) -> Plan:
    """Solve for the checkpointing plan of ``fun`` at ``args`` under ``budget``.

    ``budget`` is bytes, an int or a string like ``"12MiB"``, or ``"auto"``: the
    device's memory less what it must keep free (``client.budget``; its keywords
    ``device_memory``, ``optimizer_state`` and ``headroom`` are taken here too).
    With ``memory="peak"`` (the default) it is the peak of the training step
    ``jax.jit(jax.grad(fun, argnums), donate_argnums=...)`` and the answer a
    ``PeakPlan``; with ``memory="residuals"``, the residual bytes of
    ``jax.checkpoint(fun)`` and a ``ResidualPlan``.
    A peak plan is ``refine``d against its own measured peak (``client.peak.refine``);
    ``refine=False`` keeps the first answer and the calibrated working sets.
    A refined plan may give the last layers of a ``lax.scan``, or the last of a run of
    repeated blocks, more saves than the first, where one policy per stack would leave
    the budget unused (``client.peak.apart``; ``layer_groups=False`` keeps one policy).
    ``save_price`` (FLOPs per saved byte; ``measured_save_price()`` reads this device's)
    asks for the plan within the budget minimising recompute FLOPs plus that price per
    byte saved, where a step's time follows the bytes it moves (``client.peak.priced``):
    it may peak well under the budget.
    A peak plan's budget holds for ``jax.jit(step)`` compiled as this process compiles
    by default (``schedule="process"``); where that compile merges checkpointed blocks
    of straight-line code back into the forward pass (jax 0.10 on CPU),
    ``schedule="barriers_kept"`` plans for a step compiled with the barriers kept
    (``client.schedule``), as the answer's ``explain()`` then advises.
    Other ``options`` are ``solver.SolveOptions`` fields (``time_limit_s``,
    ``relative_gap``, ``backend``; ``offload=OffloadOptions(...)`` lets a
    plan keep residuals in host memory, a peak plan its layer inputs too).
    Keyword arguments of ``fun`` itself are not taken here: bind them with
    ``functools.partial``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> def loss(ws, x):
        ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        ...     return jnp.sum(h)
        >>> ws, x = jnp.ones((8, 64, 64)), jnp.ones((32, 64))
        >>> plan = optimize(loss, ws, x, budget="1MiB")
        >>> plan.peak_bytes <= plan.budget_bytes
        True
        >>> grads = jax.jit(jax.grad(plan.apply(loss)))(ws, x)
    """
    return plan_for(fun, args, budget, tie, dict(options, memory=memory, argnums=argnums,
                                                  donate_argnums=donate_argnums, refine=refine),
                    local_solve)  # a child process where OR-Tools is unsafe here


def smallest_budget(fun: Callable, *args, **options) -> int:
    """The smallest budget ``optimize(fun, *args, **options)`` plans: what its
    ``InfeasibleBudgetError`` names, the same whatever was planned before."""
    try:
        optimize(fun, *args, budget=1, **options)
    except InfeasibleBudgetError as err:
        return err.min_budget_bytes
    return 1  # a plan that holds nothing: no argument, no residual


def _solve_options(options: dict[str, Any]) -> SolveOptions:
    """The solver options, validated before any tracing; a bad one is refused in one
    line naming it (as the CLI does), not in pydantic's many lines."""
    try:
        return SolveOptions(**options)
    except ValidationError as exc:
        raise ValueError(f"invalid option {validation_message(exc)}") from None


def plan_for(fun: Callable, args: tuple, budget: int | str, tie: bool, options: dict[str, Any],
             solve_fn: Solver) -> Plan:
    """``optimize`` with the solve step given: ``RematClient`` passes the server's."""
    from optiremat.client.peak.planner import plan_peak

    request = PlanRequest.of(budget, tie, options)
    if request.offload:
        check_host_memory()
    traced = trace(fun, args, {})
    if request.memory == Memory.PEAK:
        return plan_peak(fun, traced, args, request, solve_fn)
    return plan_residuals(traced, request, solve_fn, name=getattr(fun, "__qualname__", ""))


def plan_residuals(traced: Traced, request: PlanRequest, solve_fn: Solver, *,
                   name: str = "") -> ResidualPlan:
    """The plan for the residuals of one ``jax.checkpoint`` around ``traced``'s function:
    tied, on its graph by policy key; untied, on its names graph equation by equation."""
    options = request.options
    if not request.tie:
        if request.saveable.names is not None:
            raise PlanError("saveable= restricts a tied plan to checkpoint names; an untied "
                            "plan (tie=False) names every value itself: drop one of them")
        names = names_form(traced, request.budget_bytes(traced), options, solve_fn)
        return ResidualPlan(names.graph, names.solution, traced, options, _names=names,
                            solve_fn=solve_fn)
    # A graph without its step plans residuals: the options need not say so, and
    # requests keep the hashes they had before peak budgets existed.
    extraction = graph_of_traced(traced, name=name, names=request.saveable.names or False)
    budget_bytes = request.budget_bytes(traced, extraction.graph)
    solution = solve_fn(extraction.graph, budget_bytes, request.tied())
    return ResidualPlan(extraction.graph, solution, traced, options,
                        key_aliases=extraction.key_aliases, solve_fn=solve_fn,
                        checkpoint_names=extraction.names_by_key)


def check_host_memory(device: Any = None) -> None:
    """Refuse an offload request, before any solve, where the device (the default
    backend's first) has no host memory to copy residuals to."""
    device = jax.devices()[0] if device is None else device
    kinds = sorted(m.kind for m in device.addressable_memories())
    if OFFLOAD_DST not in kinds:
        raise PlanError(f"offload needs '{OFFLOAD_DST}' memory to copy residuals to; the "
                        f"{device.platform} device {device.id} has {kinds}: plan without "
                        "offload")
