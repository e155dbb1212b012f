"""The plans ``optimize`` returns: one type per meaning of the budget.

* ``PeakPlan`` (``memory="peak"``, the default): the budget is the peak bytes of
  the compiled training step, ``jax.jit(jax.grad(fun, argnums))``. The plan places
  a remat region in every differentiated ``lax.scan`` (``client.peak.placement``) and
  decides, per policy key, what each region saves; ``plan.apply(fun)`` is the
  function with those regions in place.
* ``ResidualPlan`` (``memory="residuals"``): the budget is the residual bytes of
  one ``jax.checkpoint`` around the whole function, exact against
  ``saved_residuals``; ``plan.policy`` goes straight into
  ``jax.checkpoint(fun, policy=...)``.

Both are a ``Plan``: a solution on a cost graph and the policy keys it saves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, Literal

import jax

import optiremat.client._jax_internals as jx
from optiremat.client.extract import Traced, graph_of_traced, trace
from optiremat.client.frameworks import (
    framework_named,
    levanter_policy,
    maxtext_overrides,
    names_decided,
    names_of_keys,
)
from optiremat.client.measure import backward_flops, saved_residuals
from optiremat.client.names import tag_every_value
from optiremat.client.peak.placement import Placement, measured_with_barriers
from optiremat.client.policy import KeyPolicy, warn_under_remat3
from optiremat.client.step import host_buffers_apart, lowered_peak
from optiremat.client.verification import Verification
from optiremat.solver.errors import OptirematError
from optiremat.solver.graph import CostGraph
from optiremat.solver.solution import Decision, Solution, SolveOptions
from optiremat.solver.solve import Solver

# Where offloaded residuals go: JAX's names for accelerator and pinned host memory.
OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"

class PlanError(OptirematError, RuntimeError):
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
        """``save_only_these_names`` of ``names`` (and offload). ``fun`` names its values
        with JAX's partial-eval ``name`` primitive, which the remat3 path does not read:
        with ``jax_remat3`` on it warns, and ``checkpoint()`` holds under either flag."""
        warn_under_remat3()
        return self._names_policy()

    def _names_policy(self):
        if not self.offloaded:
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
        return jx.checkpoint(self.fun, policy=self._names_policy())


def names_form(traced: Traced, budget_bytes: int, options: SolveOptions,
               solve_fn: Solver) -> NamesForm:
    """The plan at ``budget_bytes`` solved untied on the graph of ``traced`` with every
    value named (``save_only_these_names`` semantics)."""
    tagged = tag_every_value(traced)
    extraction = graph_of_traced(trace(tagged, traced_args(traced), {}), names=True)
    solution = solve_fn(extraction.graph, budget_bytes, options.model_copy(update={"tie": False}))

    def named(decision: Decision) -> frozenset[str]:
        keys = extraction.graph.node_key
        return frozenset(extraction.names_by_key[keys[n]]
                         for n, d in enumerate(solution.node_decisions)
                         if d == decision and keys[n] in extraction.names_by_key)

    return NamesForm(tagged, named(Decision.SAVE), extraction.graph, solution,
                     named(Decision.OFFLOAD))


def traced_args(traced: Traced) -> tuple:
    args, kwargs = jax.tree_util.tree_unflatten(traced.in_tree, traced.flat_args)
    if kwargs:
        raise PlanError("the names form takes positional arguments only")
    return args


@dataclass
class Plan:
    """A solved checkpointing plan for one function, argument shapes and budget: what
    a ``PeakPlan`` and a ``ResidualPlan`` both have."""

    memory: ClassVar[Literal["peak", "residuals"]]  # what the budget means

    graph: CostGraph
    solution: Solution
    traced: Traced = field(repr=False)
    options: SolveOptions = field(default_factory=SolveOptions, repr=False)  # as asked
    key_aliases: dict[str, frozenset[str]] = field(default_factory=dict, repr=False)
    # Policy key -> the ``checkpoint_name`` it binds, for the model's named values.
    checkpoint_names: dict[str, str] = field(default_factory=dict, repr=False)

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
    def peak_bytes(self) -> int | None:
        """Predicted peak of the training step (None for a residual plan)."""
        return self.solution.peak_bytes

    @property
    def residual_bytes(self) -> int:
        """Residual bytes on the device (all of them without offload), arguments included."""
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
    def collective_bytes(self) -> int:
        """Bytes per device the plan's recomputation moves over the interconnect (on a
        mesh: the all-reduces and gathers its recomputed equations repeat)."""
        return self.solution.collective_bytes or 0

    @property
    def lower_bound_flops(self) -> int:
        return self.solution.lower_bound_flops

    # ---- the policy -------------------------------------------------------

    def _keys(self, decision: Decision) -> frozenset[str]:
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
        return self._keys(Decision.SAVE)

    @cached_property
    def offloaded_keys(self) -> frozenset[str]:
        """Policy keys to offload to host memory: the policy answers ``Offloadable``."""
        return self._keys(Decision.OFFLOAD)

    @property
    def policy(self) -> KeyPolicy:
        """The policy of every region (a peak plan) or of one checkpoint around ``fun``.
        With ``jax_remat3`` on, JAX would not ask it about most of what it saves: it warns
        (``client.policy``); ``apply`` and ``checkpoint`` hold under either flag."""
        warn_under_remat3()
        return self._key_policy()

    def _key_policy(self) -> KeyPolicy:
        if not self.tied:
            raise PlanError(
                "this plan decides equations one by one (tie=False), which a stateless policy "
                "cannot express: it sees only (primitive, shapes, params). Use plan.checkpoint() "
                "or plan.names.fun with plan.names.policy.")
        return KeyPolicy(self.saved_keys, self.offloaded_keys, OFFLOAD_SRC, OFFLOAD_DST)

    def apply(self, fun: Callable) -> Callable:
        """``fun`` with the plan's remat in place: same signature, same outputs."""
        raise NotImplementedError

    def verify(self, fun: Callable | None = None, *args, flops: bool = False, peak: bool = False,
               **kwargs) -> Verification:
        """The prediction next to what JAX and XLA measure (``Verification``)."""
        raise NotImplementedError

    def explain(self) -> str:
        """What the plan holds, where, and what it costs, in words."""
        from optiremat.client.explain import explain_plan

        return explain_plan(self.graph, self.solution, names=names_of_keys(
            self.graph, self.key_aliases, self.checkpoint_names))

    # ---- export to a framework's config (``client.frameworks``) -------------

    def names_decided(self, framework: str = "maxtext") -> dict[str, str]:
        """Per ``checkpoint_name`` the model binds, where the plan keeps it (``device``,
        ``offload``, ``remat``); ``ExportError`` where ``framework`` cannot express it."""
        return names_decided(self.graph, self.solution, self.key_aliases,
                             self.checkpoint_names, framework_named(framework))

    def to_maxtext(self) -> dict[str, Any]:
        """MaxText's config overrides that build this plan's policy: ``remat_policy:
        custom`` and each named tensor's ``remat``, ``device`` or ``offload`` (plan with
        ``saveable="maxtext"``; a plan MaxText cannot express raises ``ExportError``)."""
        return maxtext_overrides(self.names_decided("maxtext"))

    def to_levanter(self) -> dict[str, Any]:
        """Haliax's ``ScanCheckpointPolicy`` fields that build this plan's policy (Levanter's
        ``model.gradient_checkpointing``; plan with ``saveable="levanter"``)."""
        return levanter_policy(self.names_decided("levanter"))

    def _args(self, args: tuple) -> tuple:
        """The arguments to verify at: those given, else the ones the plan was made for."""
        return args or traced_args(self.traced)


@dataclass
class PeakPlan(Plan):
    """A plan for the peak of the training step: applied with ``plan.apply(fun)``, the
    function with a checkpoint inside each region (``placement``)."""

    memory: ClassVar[Literal["peak", "residuals"]] = "peak"

    placement: Placement = field(kw_only=True, repr=False)
    # The compile the budget holds under (``optimize(..., schedule=)``), and what the plan
    # would measure under the other where they differ (``client.schedule``).
    schedule: str = field(default="process", kw_only=True)
    schedule_note: str = field(default="", kw_only=True)
    # Where a plan asked for with ``save_price=`` was planned (``client.peak.priced``).
    price_note: str = field(default="", kw_only=True)

    def explain(self) -> str:
        return "\n\n".join(filter(None, (super().explain(), self.schedule_note,
                                          self.price_note)))

    @property
    def groups(self) -> tuple[int, ...]:
        """Per region, its layers in that many rematerialised groups (1: per layer)."""
        return tuple(self.solution.groups or [1] * len(self.placement.regions))

    @property
    def names(self) -> NamesForm:
        raise PlanError("the names form is for residual plans (memory='residuals'); a peak "
                        "plan is applied with plan.apply(fun)")

    def checkpoint(self, fun: Callable | None = None) -> Callable:
        raise PlanError("a peak plan places its checkpoints inside the function (each "
                        "region's lax.scan body or block): use plan.apply(fun)")

    def apply(self, fun: Callable) -> Callable:
        """``fun`` with each region's ``lax.scan`` body checkpointed per iteration by the
        plan's policy: ``jax.jit(jax.grad(plan.apply(loss)))`` is the whole change a user
        makes. ``fun`` is traced once per structure and types of its arguments. Where the
        plan gives a scan's layers saves of their own (``layer_groups``), that scan runs
        them in consecutive groups, each checkpointed by its group's policy; where it gives
        repeated blocks saves of their own, each block's checkpoint takes its own. Where the
        step fits without any checkpoint (``solution.no_checkpoint``), ``fun`` itself."""
        if self.solution.no_checkpoint:
            return fun
        return self.placement.apply(fun, self._key_policy(), self.solution.groups,
                                    self.layer_policies())

    @property
    def layer_groups(self) -> tuple[tuple[int, int, frozenset[str]], ...]:
        """Where the plan gives a scan's layers saves of their own: per group of
        consecutive layers, in program order, (region, layers, policy keys saved); or
        repeated blocks: per block of the run, (region, 1, keys). Empty where every
        region's layers take ``policy``."""
        return tuple((g.region, g.layers, self._expanded(g.saved_keys))
                     for g in self.solution.layer_groups or [])

    def layer_policies(self) -> dict[int, list[tuple[int, KeyPolicy]]]:
        """Per region whose layers are planned apart, (layers, policy) per group."""
        policies: dict[int, list[tuple[int, KeyPolicy]]] = {}
        for region, layers, keys in self.layer_groups:
            policies.setdefault(region, []).append((layers, KeyPolicy(keys)))
        return policies

    def _expanded(self, keys: Sequence[str]) -> frozenset[str]:
        return frozenset(k for key in keys for k in self.key_aliases.get(key, {key}))

    def verify(self, fun: Callable | None = None, *args, flops: bool = False, peak: bool = False,
               **kwargs) -> Verification:
        """The residuals of the step with the plan applied, next to the prediction, and
        with ``peak`` XLA's ``memory_analysis()`` of the compiled step (compiled, never
        run: arguments may be ``jax.ShapeDtypeStruct``)."""
        if fun is None:
            raise PlanError("pass the function: plan.verify(fun, *args)")
        if flops or kwargs:
            raise PlanError("a peak plan is verified at positional arguments, by residuals "
                            "and peak")
        args = self._args(args)
        step = self.placement.step
        applied = self.apply(fun)
        chosen = sorted({i % len(args) for i in step.argnums})

        def of_differentiated(*diff):
            full = list(args)
            for i, x in zip(chosen, diff, strict=True):
                full[i] = x
            return applied(*full)

        residuals = saved_residuals(of_differentiated, *[args[i] for i in chosen])
        measured_peak_bytes = None
        if peak and self.host_bytes and not host_buffers_apart():
            # Its device peak would read as met or missed by bytes that are on the host.
            raise PlanError("the device peak of a plan that offloads cannot be measured on "
                            "CPU: XLA's CPU memory analysis counts pinned_host buffers as "
                            "device ones. Verify it on a GPU or TPU, or check its residuals "
                            "and host bytes here with peak=False")
        if peak:
            measured_peak_bytes = lowered_peak(
                step.function(applied).lower(*args),
                measured_with_barriers(self.placement.regions, self.schedule))
        return Verification(self.residual_bytes, sum(r.bytes for r in residuals if not r.host),
                            self.budget_bytes, residuals,
                            predicted_host_bytes=self.host_bytes,
                            measured_host_bytes=sum(r.bytes for r in residuals if r.host),
                            predicted_peak_bytes=self.peak_bytes if peak else None,
                            measured_peak_bytes=measured_peak_bytes)


@dataclass
class ResidualPlan(Plan):
    """A plan for the residuals of one ``jax.checkpoint`` around the whole function: its
    ``policy`` goes straight into ``jax.checkpoint``. ``names`` is the plan written with
    ``checkpoint_name``; untied plans (``tie=False``) exist only in that form."""

    memory: ClassVar[Literal["peak", "residuals"]] = "residuals"

    solve_fn: Solver | None = field(default=None, kw_only=True, repr=False, compare=False)
    _names: NamesForm | None = field(default=None, kw_only=True, repr=False)

    @property
    def names(self) -> NamesForm:
        """The names form, solved at this plan's budget (built on first use)."""
        if self._names is None:
            assert self.solve_fn is not None, "a tied residual plan keeps its solve function"
            self._names = names_form(self.traced, self.budget_bytes, self.options,
                                     self.solve_fn)
        return self._names

    def checkpoint(self, fun: Callable | None = None) -> Callable:
        """``jax.checkpoint`` around the whole function."""
        if self.tied:
            if fun is None:
                raise PlanError("pass the function to checkpoint: plan.checkpoint(fun)")
            return jx.checkpoint(fun, policy=self._key_policy())
        return self.names.checkpoint()

    def apply(self, fun: Callable) -> Callable:
        """``fun`` checkpointed whole with the plan's policy."""
        return self.checkpoint(fun)

    def verify(self, fun: Callable | None = None, *args, flops: bool = False, peak: bool = False,
               **kwargs) -> Verification:
        """The prediction next to ``saved_residuals``; with ``flops``, also the backward
        pass's FLOPs beyond ``everything_saveable``."""
        if peak:
            raise PlanError("peak=True checks a peak plan (memory='peak'); this one plans "
                            "residuals")
        if not args and not kwargs:
            args = self._args(args)
        checkpointed = self.checkpoint(fun)
        residuals = saved_residuals(checkpointed, *args, **kwargs)
        form: Plan | NamesForm = self if self.tied else self.names
        measured_flops = None
        if flops:
            base_fun = fun if self.tied else self.names.fun
            assert base_fun is not None  # checkpoint(None) of a tied plan raised above
            everything = jx.checkpoint(base_fun, policy=jax.checkpoint_policies.everything_saveable)
            measured_flops = (backward_flops(checkpointed, *args, **kwargs)
                              - backward_flops(everything, *args, **kwargs))
        device = sum(r.bytes for r in residuals if not r.host)
        return Verification(form.residual_bytes, device, self.budget_bytes, residuals,
                            form.recompute_flops, measured_flops, form.host_bytes,
                            sum(r.bytes for r in residuals if r.host))
