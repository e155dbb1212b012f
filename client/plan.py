"""``optimize``: from a JAX function and a budget to a checkpointing Plan.

Two kinds of plan, by what the budget means (``memory``):

* ``"peak"`` (the default): the peak bytes of the compiled training step,
  ``jax.jit(jax.grad(fun, argnums))``. The plan places a remat region in every
  differentiated ``lax.scan`` (``client.placement``) and decides, per policy
  key, what each region saves; ``plan.apply(fun)`` is the function with those
  regions in place.
* ``"residuals"``: the residual bytes of one ``jax.checkpoint`` around the
  whole function, exact against ``saved_residuals``; ``plan.policy`` goes
  straight into ``jax.checkpoint(fun, policy=...)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import jax

from optiremat.client.budget import resolve_budget, split_auto_keywords
from optiremat.client.extract import Traced, graph_of_traced, trace
from optiremat.client.measure import Residual, backward_flops, saved_residuals
from optiremat.client.names import tag_every_value
from optiremat.client.placement import Placement
from optiremat.client.policy import KeyPolicy
from optiremat.client.refine import refined_solve, step_measure
from optiremat.client.step import Step, lowered_peak
from optiremat.client.step_graph import step_extraction
from optiremat.solver.errors import OptirematError
from optiremat.solver.graph import CostGraph
from optiremat.solver.solution import Decision, Solution
from optiremat.solver.solve import solve
from optiremat.solver.step import Memory
from optiremat.solver.units import format_bytes

# solve(graph, budget_bytes, **options) -> Solution: the local solver, or a server's.
SolveFn = Callable[..., Solution]

# Where offloaded residuals go: JAX's names for accelerator and pinned host memory.
OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"

# A measured peak this far from the prediction, either way, is warned about: above it, XLA
# did not follow the plan; below it, the plan recomputes more than its budget needs.
PEAK_TOLERANCE = 0.10


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
    """A plan's prediction next to what JAX (``saved_residuals``) and XLA measure."""

    predicted_bytes: int  # residuals on the device
    measured_bytes: int
    budget_bytes: int
    residuals: list[Residual]
    predicted_recompute_flops: int | None = None
    measured_recompute_flops: int | None = None
    predicted_host_bytes: int = 0  # offloaded to host memory
    measured_host_bytes: int = 0
    # verify(..., peak=True): the compiled step's peak (argument + output + temp - alias).
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None

    @property
    def exact(self) -> bool:
        """Residuals (and FLOPs, host bytes) exactly as predicted."""
        flops_ok = (self.measured_recompute_flops is None
                    or self.measured_recompute_flops == self.predicted_recompute_flops)
        host_ok = self.predicted_host_bytes == self.measured_host_bytes
        return self.predicted_bytes == self.measured_bytes and flops_ok and host_ok

    @property
    def peak_error(self) -> float | None:
        """(predicted - measured) / measured peak; positive when the plan was cautious."""
        if self.predicted_peak_bytes is None or not self.measured_peak_bytes:
            return None
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes

    @property
    def within_budget(self) -> bool:
        """The measured peak (or, without ``peak=True``, the residuals) fits the budget."""
        if self.measured_peak_bytes is not None and self.predicted_peak_bytes is not None:
            return self.measured_peak_bytes <= self.budget_bytes
        return self.measured_bytes <= self.budget_bytes

    @property
    def warning(self) -> str:
        """Empty, or what to do when XLA's peak and the prediction differ by more than
        ``PEAK_TOLERANCE`` either way."""
        error = self.peak_error
        if error is None or abs(error) <= PEAK_TOLERANCE:
            return ""
        measured, predicted = self.measured_peak_bytes or 0, self.predicted_peak_bytes or 0
        if error < 0:
            return (f"XLA's schedule holds {format_bytes(measured)}, {-error:.0%} more than the "
                    f"predicted {format_bytes(predicted)}: it does not follow the plan's "
                    "regions. Remat lowers the peak reliably inside lax.scan over layers "
                    "(nnx.scan, eqx scan-over-layers); XLA reschedules unrolled loops of "
                    "checkpointed blocks.")
        return (f"XLA's schedule holds {format_bytes(measured)}, {error:.0%} less than the "
                f"predicted {format_bytes(predicted)}: the plan recomputes more than its budget "
                "needs. A plan made for other arguments than these (other shapes, or other "
                "shardings: on a mesh a plan prices what one device holds) is cautious too.")


def _names_form(traced: Traced, budget_bytes: int, options: dict,
                solve_fn: SolveFn = solve) -> NamesForm:
    tagged = tag_every_value(traced)
    extraction = graph_of_traced(trace(tagged, traced_args(traced), {}), names=True)
    solution = solve_fn(extraction.graph, budget_bytes, **{**options, "tie": False})

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
    """A solved checkpointing plan for one function, argument shapes and budget.

    A peak plan (the default) is applied with ``plan.apply(fun)``: the function
    with a checkpoint inside each region. A residual plan's ``policy`` goes
    straight into ``jax.checkpoint``. ``names`` is the plan written with
    ``checkpoint_name`` (residual plans); untied plans (``tie=False``) exist
    only in that form.
    """

    graph: CostGraph
    solution: Solution
    traced: Traced = field(repr=False)
    options: dict[str, Any] = field(default_factory=dict, repr=False)
    _names: NamesForm | None = field(default=None, repr=False)
    key_aliases: dict[str, frozenset[str]] = field(default_factory=dict, repr=False)
    solve_fn: SolveFn = field(default=solve, repr=False, compare=False)  # for the names form
    placement: Placement | None = field(default=None, repr=False)  # peak plans

    # ---- predictions ------------------------------------------------------

    @property
    def memory(self) -> Literal["peak", "residuals"]:
        """What the budget means: the step's peak, or one checkpoint's residuals."""
        return "peak" if self.placement is not None else "residuals"

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
        """Predicted peak of the training step (peak plans)."""
        return self.solution.peak_bytes

    @property
    def groups(self) -> tuple[int, ...] | None:
        """Per region, its layers in that many rematerialised groups (1: per layer)."""
        if self.placement is None:
            return None
        return tuple(self.solution.groups or [1] * len(self.placement.regions))

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
    def lower_bound_flops(self) -> int:
        return self.solution.lower_bound_flops

    # ---- the forms --------------------------------------------------------

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
        """The policy of every region (a peak plan) or of one checkpoint around ``fun``."""
        if not self.tied:
            raise PlanError(
                "this plan decides equations one by one (tie=False), which a stateless policy "
                "cannot express: it sees only (primitive, shapes, params). Use plan.checkpoint() "
                "or plan.names.fun with plan.names.policy.")
        return KeyPolicy(self.saved_keys, self.offloaded_keys, OFFLOAD_SRC, OFFLOAD_DST)

    @property
    def names(self) -> NamesForm:
        """The names form, solved at this plan's budget (built on first use)."""
        if self.placement is not None:
            raise PlanError("the names form is for residual plans (memory='residuals'); a peak "
                            "plan is applied with plan.apply(fun)")
        if self._names is None:
            self._names = _names_form(self.traced, self.budget_bytes, self.options,
                                      self.solve_fn)
        return self._names

    def checkpoint(self, fun: Callable | None = None) -> Callable:
        """``jax.checkpoint`` around the whole function (residual plans)."""
        if self.placement is not None:
            raise PlanError("a peak plan places its checkpoints inside the function's "
                            "lax.scan bodies: use plan.apply(fun)")
        if self.tied:
            if fun is None:
                raise PlanError("pass the function to checkpoint: plan.checkpoint(fun)")
            return jax.checkpoint(fun, policy=self.policy)
        return self.names.checkpoint()

    def apply(self, fun: Callable) -> Callable:
        """``fun`` with the plan's remat in place: same signature, same outputs.

        A peak plan checkpoints the body of each region's ``lax.scan`` per
        iteration with the plan's policy, so ``jax.jit(jax.grad(plan.apply(loss)))``
        is the whole change a user makes; a residual plan checkpoints ``fun`` whole.
        """
        if self.placement is None:
            return self.checkpoint(fun)
        return self.placement.apply(fun, self.policy, self.solution.groups)

    # ---- explaining and checking -------------------------------------------

    def explain(self) -> str:
        """What the plan holds, where, and what it costs, in words."""
        from optiremat.client.explain import explain_plan

        return explain_plan(self.graph, self.solution)

    def verify(self, fun: Callable | None = None, *args, flops: bool = False, peak: bool = False,
               **kwargs) -> Verification:
        """Compare the prediction with ``saved_residuals`` and, with ``peak``, with XLA's
        ``memory_analysis()`` of the compiled step (compiled, never run: arguments may be
        ``jax.ShapeDtypeStruct``). With ``flops``, also the backward pass's FLOPs beyond
        ``everything_saveable`` (residual plans)."""
        if not args and not kwargs:
            args = traced_args(self.traced)
        if self.placement is None:
            if peak:
                raise PlanError("peak=True checks a peak plan (memory='peak'); this one plans "
                                "residuals")
            return self._verify_residuals(fun, args, kwargs, flops)
        if fun is None:
            raise PlanError("pass the function: plan.verify(fun, *args)")
        if flops or kwargs:
            raise PlanError("a peak plan is verified at positional arguments, by residuals "
                            "and peak")
        return self._verify_step(fun, args, peak)

    def _verify_residuals(self, fun, args, kwargs, flops: bool) -> Verification:
        checkpointed = self.checkpoint(fun)
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

    def _verify_step(self, fun: Callable, args: Sequence, peak: bool) -> Verification:
        assert self.placement is not None
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
        if peak and self.host_bytes and jax.default_backend() == "cpu":
            # Its device peak would read as met or missed by bytes that are on the host.
            raise PlanError("the device peak of a plan that offloads cannot be measured on "
                            "CPU: XLA's CPU memory analysis counts pinned_host buffers as "
                            "device ones. Verify it on a GPU or TPU, or check its residuals "
                            "and host bytes here with peak=False")
        if peak:
            measured_peak_bytes = lowered_peak(step.function(applied).lower(*args))
        return Verification(self.residual_bytes, sum(r.bytes for r in residuals if not r.host),
                            self.budget_bytes, residuals,
                            predicted_host_bytes=self.host_bytes,
                            measured_host_bytes=sum(r.bytes for r in residuals if r.host),
                            predicted_peak_bytes=self.peak_bytes if peak else None,
                            measured_peak_bytes=measured_peak_bytes)


def optimize(fun: Callable, *args, budget: int | str, memory: Literal["peak", "residuals"] = "peak",
             tie: bool = True, argnums: int | Sequence[int] = 0,
             donate_argnums: int | Sequence[int] = (), refine: bool = True,
             **options) -> Plan:
    """Solve for the checkpointing plan of ``fun`` at ``args`` under ``budget``.

    ``budget`` is bytes, an int or a string like ``"12MiB"``, or ``"auto"``: the
    device's memory less what it must keep free (``client.budget``; its keywords
    ``device_memory``, ``optimizer_state`` and ``headroom`` are taken here too).
    With ``memory="peak"`` (the default) it is the peak of the training step
    ``jax.jit(jax.grad(fun, argnums), donate_argnums=...)``; with
    ``memory="residuals"``, the residual bytes of ``jax.checkpoint(fun)``.
    A peak plan is ``refine``d against its own backward working set: one compile
    of one layer under its policy measures it, and the budget is solved again
    when it differs from the calibrated one (``client.refine``); ``refine=False``
    keeps the first answer and the calibrated working set.
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
                    solve)


def check_host_memory(device: Any = None) -> None:
    """Refuse an offload request, before any solve, where the device (the default
    backend's first) has no host memory to copy residuals to."""
    device = jax.devices()[0] if device is None else device
    kinds = sorted(m.kind for m in device.addressable_memories())
    if OFFLOAD_DST not in kinds:
        raise PlanError(f"offload needs '{OFFLOAD_DST}' memory to copy residuals to; the "
                        f"{device.platform} device {device.id} has {kinds}: plan without "
                        "offload")


def plan_for(fun: Callable, args: tuple, budget: int | str, tie: bool, options: dict[str, Any],
             solve_fn: SolveFn) -> Plan:
    """``optimize`` with the solve step given: ``RematClient`` passes the server's."""
    options, auto = split_auto_keywords(options)
    memory = Memory(options.pop("memory", Memory.PEAK))
    refine = options.pop("refine", True)
    step = Step.of(options.pop("argnums", 0), options.pop("donate_argnums", ()))
    offload = options.get("offload") is not None
    if offload:
        check_host_memory()
    traced = trace(fun, args, {})
    name = getattr(fun, "__qualname__", "")
    if memory == Memory.PEAK:
        if not tie:
            raise PlanError("peak plans are tied by policy key for now: pass tie=True, or plan "
                            "residuals with memory='residuals', tie=False")
        # An offload plan may offload each layer's input too: it is named for the policy.
        extracted = step_extraction(fun, args, step, name=name, name_inputs=offload)
        budget_bytes = resolve_budget(budget, traced, None, auto, step, Memory.PEAK)
        graph = extracted.graph

        def solve_at(budget: int) -> Solution:
            return solve_fn(graph, budget, tie=True, **options)

        placement = Placement(extracted.regions, extracted.differentiated, step,
                              name_inputs=offload)
        # Offload plans are not refined: on CPU, XLA's memory analysis counts host
        # buffers as device ones, so their peak cannot be measured here.
        solution = (refined_solve(graph, extracted.regions, budget_bytes, solve_at,
                                  step_measure(fun, args, extracted, placement))
                    if refine and not offload else solve_at(budget_bytes))
        return Plan(extracted.graph, solution, traced, dict(options),
                    key_aliases=extracted.extraction.key_aliases, solve_fn=solve_fn,
                    placement=placement)
    # A graph without its step plans residuals: the options need not say so, and
    # requests keep the hashes they had before peak budgets existed.
    if tie:
        extraction = graph_of_traced(traced, name=name)
        budget_bytes = resolve_budget(budget, traced, extraction.graph, auto, step,
                                      Memory.RESIDUALS)
        solution = solve_fn(extraction.graph, budget_bytes, tie=True, **options)
        return Plan(extraction.graph, solution, traced, dict(options),
                    key_aliases=extraction.key_aliases, solve_fn=solve_fn)
    budget_bytes = resolve_budget(budget, traced, None, auto, step, Memory.RESIDUALS)
    names = _names_form(traced, budget_bytes, dict(options), solve_fn)
    return Plan(names.graph, names.solution, traced, dict(options), names, solve_fn=solve_fn)
