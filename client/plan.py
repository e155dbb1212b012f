"""``optimize``: from a JAX function and a budget to a checkpointing Plan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import jax

from optiremat.client.budget import resolve_budget, split_auto_keywords
from optiremat.client.extract import Traced, graph_of_traced, trace
from optiremat.client.measure import Residual, backward_flops, saved_residuals
from optiremat.client.names import tag_every_value
from optiremat.client.policy import KeyPolicy
from optiremat.solver.graph import CostGraph
from optiremat.solver.solution import Solution
from optiremat.solver.solve import solve

# solve(graph, budget_bytes, **options) -> Solution: the local solver, or a server's.
SolveFn = Callable[..., Solution]

# Where offloaded residuals go: JAX's names for accelerator and pinned host memory.
OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"


class PlanError(RuntimeError):
    """A plan used in a way it cannot honour exactly."""


@dataclass(frozen=True)
class NamesForm:
    """``jax.checkpoint(fun, policy=policy)`` saves exactly ``names`` on the device
    and offloads exactly ``offloaded`` to host memory."""

    fun: Callable  # the user's function with checkpoint_name on every savable value
    names: frozenset[str]
    graph: CostGraph
    solution: Solution
    offloaded: frozenset[str] = frozenset()

    @property
    def policy(self):
        if not self.offloaded:  # the plain form, which JAX's remat3 path honours too
            return jax.checkpoint_policies.save_only_these_names(*sorted(self.names))
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=sorted(self.names),
            names_which_can_be_offloaded=sorted(self.offloaded),
            offload_src=OFFLOAD_SRC, offload_dst=OFFLOAD_DST)

    @property
    def residual_bytes(self) -> int:
        """Device residual bytes."""
        return self.solution.residual_bytes

    @property
    def host_bytes(self) -> int:
        return self.solution.host_bytes

    @property
    def recompute_flops(self) -> int:
        return self.solution.recompute_flops

    def checkpoint(self) -> Callable:
        return jax.checkpoint(self.fun, policy=self.policy)


@dataclass(frozen=True)
class Verification:
    """A plan's prediction next to what ``saved_residuals`` reports."""

    predicted_bytes: int  # on the device
    measured_bytes: int
    budget_bytes: int
    residuals: list[Residual]
    predicted_recompute_flops: int | None = None
    measured_recompute_flops: int | None = None
    predicted_host_bytes: int = 0  # offloaded to host memory
    measured_host_bytes: int = 0

    @property
    def exact(self) -> bool:
        flops_ok = (self.measured_recompute_flops is None
                    or self.measured_recompute_flops == self.predicted_recompute_flops)
        host_ok = self.predicted_host_bytes == self.measured_host_bytes
        return self.predicted_bytes == self.measured_bytes and flops_ok and host_ok

    @property
    def within_budget(self) -> bool:
        return self.measured_bytes <= self.budget_bytes


def _names_form(traced: Traced, budget_bytes: int, options: dict,
                solve_fn: SolveFn = solve) -> NamesForm:
    tagged = tag_every_value(traced)
    extraction = graph_of_traced(trace(tagged, traced_args(traced), {}), names=True)
    solution = solve_fn(extraction.graph, budget_bytes, **{**options, "tie": False})

    def named(decision: str) -> frozenset[str]:
        keys = extraction.graph.node_key
        return frozenset(extraction.names_by_key[keys[n]]
                         for n, d in enumerate(solution.node_decisions)
                         if d == decision and keys[n] in extraction.names_by_key)

    return NamesForm(tagged, named("save"), extraction.graph, solution, named("offload"))


def traced_args(traced: Traced) -> tuple:
    args, kwargs = jax.tree_util.tree_unflatten(traced.in_tree, traced.flat_args)
    if kwargs:
        raise PlanError("the names form takes positional arguments only")
    return args


@dataclass
class Plan:
    """A solved checkpointing plan for one function, argument shapes and budget.

    ``policy`` goes straight into ``jax.checkpoint``; ``names`` is the same plan
    written with ``checkpoint_name``. Untied plans (``tie=False``) exist only in
    the names form.
    """

    graph: CostGraph
    solution: Solution
    traced: Traced = field(repr=False)
    options: dict[str, Any] = field(default_factory=dict, repr=False)
    _names: NamesForm | None = field(default=None, repr=False)
    key_aliases: dict[str, frozenset[str]] = field(default_factory=dict, repr=False)
    solve_fn: SolveFn = field(default=solve, repr=False, compare=False)  # for the names form

    # ---- predictions ------------------------------------------------------

    @property
    def tied(self) -> bool:
        """Tied plans decide per policy key; untied ones were solved on the names graph."""
        return self.solution.options.tie

    @property
    def status(self) -> str:
        return str(self.solution.status)

    @property
    def budget_bytes(self) -> int:
        return self.solution.budget_bytes

    @property
    def residual_bytes(self) -> int:
        """Residual bytes on the device (all of them without offload)."""
        return self.solution.residual_bytes

    @property
    def host_bytes(self) -> int:
        """Residual bytes offloaded to host memory (``offload=OffloadOptions(...)``)."""
        return self.solution.host_bytes

    @property
    def estimated_seconds(self) -> float | None:
        """Recompute and transfer time the plan adds (offload solves only)."""
        return self.solution.offload.estimated_seconds if self.solution.offload else None

    @property
    def recompute_flops(self) -> int:
        return self.solution.recompute_flops

    @property
    def lower_bound_flops(self) -> int:
        return self.solution.lower_bound_flops

    # ---- the two forms ----------------------------------------------------

    def _keys(self, decision: str) -> frozenset[str]:
        """Policy keys decided so; a graph key standing for several expands to all of them."""
        g = self.graph
        keys: set[str] = set()
        for n, d in enumerate(self.solution.node_decisions):
            key = g.node_key[n]
            if d == decision and key:
                keys |= self.key_aliases.get(key, {key})
        return frozenset(keys)

    @cached_property
    def saved_keys(self) -> frozenset[str]:
        """Policy keys to save on the device."""
        return self._keys("save")

    @cached_property
    def offloaded_keys(self) -> frozenset[str]:
        """Policy keys to offload to host memory: the policy answers ``Offloadable``."""
        return self._keys("offload")

    @property
    def policy(self) -> KeyPolicy:
        if not self.tied:
            raise PlanError(
                "this plan decides equations one by one (tie=False), which a stateless policy "
                "cannot express: it sees only (primitive, shapes, params). Use plan.checkpoint() "
                "or plan.names.fun with plan.names.policy.")
        return KeyPolicy(self.saved_keys, self.offloaded_keys, OFFLOAD_SRC, OFFLOAD_DST)

    @property
    def names(self) -> NamesForm:
        """The names form, solved at this plan's budget (built on first use)."""
        if self._names is None:
            self._names = _names_form(self.traced, self.budget_bytes, self.options,
                                      self.solve_fn)
        return self._names

    @property
    def names_policy(self):
        return self.names.policy

    def checkpoint(self, fun: Callable | None = None) -> Callable:
        """``jax.checkpoint`` with this plan; untied plans use the names form."""
        if self.tied:
            if fun is None:
                raise PlanError("pass the function to checkpoint: plan.checkpoint(fun)")
            return jax.checkpoint(fun, policy=self.policy)
        return self.names.checkpoint()

    # ---- checking ---------------------------------------------------------

    def verify(self, fun: Callable | None = None, *args, flops: bool = False,
               **kwargs) -> Verification:
        """Compare the prediction with ``saved_residuals`` (and, with ``flops``, the
        backward pass's FLOPs beyond ``everything_saveable``)."""
        checkpointed = self.checkpoint(fun)
        if not args and not kwargs:
            args = traced_args(self.traced)
        residuals = saved_residuals(checkpointed, *args, **kwargs)
        form: Plan | NamesForm = self if self.tied else self.names
        measured_flops = None
        if flops:
            base_fun = fun if self.tied else self.names.fun
            everything = jax.checkpoint(base_fun,
                                        policy=jax.checkpoint_policies.everything_saveable)
            measured_flops = (backward_flops(checkpointed, *args, **kwargs)
                              - backward_flops(everything, *args, **kwargs))
        device = sum(r.bytes for r in residuals if not r.host)
        return Verification(form.residual_bytes, device, self.budget_bytes, residuals,
                            form.recompute_flops, measured_flops, form.host_bytes,
                            sum(r.bytes for r in residuals if r.host))


def optimize(fun: Callable, *args, budget: int | str, tie: bool = True, **options) -> Plan:
    """Solve for the checkpointing plan of ``fun`` at ``args`` under ``budget``.

    ``budget`` is bytes of residuals, an int or a string like ``"12MiB"``, or
    ``"auto"``: the device's memory less what the training step holds anyway
    (see ``optiremat.client.budget``; its keywords ``device_memory``, ``optimizer_state``,
    ``argnums``, ``donate_argnums`` and ``headroom`` are taken here too).
    Other ``options`` are ``optiremat.solver.SolveOptions`` fields (``time_limit_s``,
    ``relative_gap``, ``backend``; ``offload=OffloadOptions(...)`` lets the plan
    keep residuals in host memory, and ``budget`` then caps device bytes).
    Keyword arguments of ``fun`` itself are not taken here: bind them with
    ``functools.partial``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> f = lambda x, w: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w))
        >>> x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
        >>> plan = optimize(f, x, w, budget="1KiB")
        >>> plan.verify(f, x, w).exact
        True
    """
    return plan_for(fun, args, budget, tie, options, solve)


def plan_for(fun: Callable, args: tuple, budget: int | str, tie: bool, options: dict[str, Any],
             solve_fn: SolveFn) -> Plan:
    """``optimize`` with the solve step given: ``RematClient`` passes the server's."""
    options, auto = split_auto_keywords(options)
    traced = trace(fun, args, {})
    if tie:
        extraction = graph_of_traced(traced, name=getattr(fun, "__qualname__", ""))
        budget_bytes = resolve_budget(budget, traced, extraction.graph, auto)
        solution = solve_fn(extraction.graph, budget_bytes, tie=True, **options)
        return Plan(extraction.graph, solution, traced, dict(options),
                    key_aliases=extraction.key_aliases, solve_fn=solve_fn)
    budget_bytes = resolve_budget(budget, traced, None, auto)
    names = _names_form(traced, budget_bytes, dict(options), solve_fn)
    return Plan(names.graph, names.solution, traced, dict(options), names, solve_fn=solve_fn)
