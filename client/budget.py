"""``budget="auto"``: the device's memory minus what the training step holds anyway.

A peak budget (``memory="peak"``, the default) is the device's memory less
headroom and the optimizer state: the step's arguments, gradients and
temporaries are what the peak counts, so nothing else is subtracted::

    device memory (memory_stats()["bytes_limit"], or device_memory=)
    - headroom                 HEADROOM of it by default: fragmentation, other
                               programs' buffers, the allocator's own
    - optimizer state          ``optimizer_state=``: a pytree or a byte count

A residual budget (``memory="residuals"``) is::

    device memory (memory_stats()["bytes_limit"], or device_memory=)
    - headroom                 HEADROOM of it by default: XLA's workspace,
                               temporaries of the backward pass, fragmentation
    - arguments of fun         parameters and batch, live for the whole step
    - gradients                one per floating-point leaf of the parameter
                               arguments (``argnums``, as in jax.grad)
    - optimizer state          ``optimizer_state=``: a pytree or a byte count
    - updated copies           the step's new parameters and optimizer state,
                               unless the step donates the old ones
                               (``donate_argnums``)
    + arguments the backward pass reads in every plan: the residual bytes of a
      plan count them, and they are already held above

The model is deliberately conservative: it assumes all of that coexists with
the residuals at their peak. The optimizer state is taken to be donated with
the parameters (a step jitted with ``donate_argnums`` covering both): it counts
as donated when every parameter argument is.

Held memory is counted in two places, with two donation rules, on purpose:

* ``Step.held_memory`` (``client/step.py``) is the part of a *peak* that no plan
  changes, inside the gradient step optiremat compiles and measures
  (``jax.jit(jax.grad(fun), donate_argnums=...)``): its outputs are the gradients,
  and a donated argument's buffer aliases one gradient of its shape and dtype,
  XLA's own rule, so predicted peaks match ``measured_peak`` byte for byte. A
  peak budget's held bytes come from there (the graph's ``StepMemory``); here a
  peak budget subtracts only headroom and the optimizer state, which that step
  does not hold.
* The residual budget here models the user's whole training step, which
  optiremat never compiles: the optimizer's updated parameters and state need
  new buffers unless their arguments are donated, judged per argument, not per
  buffer. A model, not a measurement, and so conservative.

Sizes here come from each leaf's NumPy dtype (a Python float is 8 bytes), while
``Step.held_memory`` uses JAX's dtype (4 bytes without x64), as the step holds it.
On a mesh each leaf weighs its shard (``sharding.shard_shape``): the budget is one
device's, and a peak budget's held bytes are XLA's own (``client.peak.step_graph``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from optiremat.client.extract import Traced, graph_of_traced, trace
from optiremat.client.step import Step
from optiremat.solver.errors import OptirematError
from optiremat.solver.graph import CostGraph
from optiremat.solver.semantics import evaluate
from optiremat.solver.step import Memory
from optiremat.solver.units import format_bytes, parse_bytes

HEADROOM = 0.10  # fraction of device memory left for XLA's workspace and temporaries

# The keywords of optimize(..., budget="auto", ...) that configure the budget (argnums
# and donate_argnums, which the step takes as well, are passed on by optimize).
AUTO_KEYWORDS = frozenset({"device_memory", "optimizer_state", "headroom"})


class BudgetError(OptirematError, ValueError):
    """No automatic budget: no memory limit to read, or nothing left for residuals."""


@dataclass(frozen=True)
class MemoryBudget:
    """The automatic budget and what it is made of, in bytes."""

    device_bytes: int
    headroom_bytes: int
    argument_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    update_bytes: int
    input_residual_bytes: int

    @property
    def held_bytes(self) -> int:
        return (self.headroom_bytes + self.argument_bytes + self.gradient_bytes
                + self.optimizer_bytes + self.update_bytes)

    @property
    def residual_budget(self) -> int:
        return self.device_bytes - self.held_bytes + self.input_residual_bytes

    @property
    def peak_budget(self) -> int:
        """The peak the training step may reach: what the device has for it."""
        return self.device_bytes - self.headroom_bytes - self.optimizer_bytes

    def describe(self, memory: str = "peak") -> str:
        rows = [("device memory", self.device_bytes), ("- headroom", self.headroom_bytes)]
        if memory == "peak":
            rows += [("- optimizer state", self.optimizer_bytes),
                     ("= peak budget", self.peak_budget)]
        else:
            rows += [
                ("- arguments", self.argument_bytes), ("- gradients", self.gradient_bytes),
                ("- optimizer state", self.optimizer_bytes),
                ("- updated copies", self.update_bytes),
                ("+ arguments also residuals", self.input_residual_bytes),
                ("= residual budget", self.residual_budget),
            ]
        return "\n".join(f"{name:<28}{format_bytes(n):>14}" for name, n in rows)


def device_memory_bytes(device: Any = None) -> int:
    """The memory limit the device's allocator reports (``memory_stats()["bytes_limit"]``)."""
    device = device if device is not None else jax.devices()[0]
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        raise BudgetError(
            f"the {device.platform} platform reports no memory limit for {device} "
            f"(memory_stats() is {stats!r}), so budget='auto' cannot size the residuals. "
            "Pass device_memory='16GiB' (the memory you plan to train with) or an explicit "
            "budget such as budget='2GiB'.")
    return int(stats["bytes_limit"])


def memory_budget(fun: Any, *args: Any, device_memory: int | str | None = None,
                  optimizer_state: Any = None, argnums: int | Sequence[int] = 0,
                  donate_argnums: Sequence[int] = (), headroom: float = HEADROOM
                  ) -> MemoryBudget:
    """What ``budget="auto"`` would give ``fun`` at ``args``, item by item.

    ``argnums`` are the parameter arguments (default 0, as ``jax.grad``);
    ``donate_argnums`` the arguments whose buffers the training step donates.
    """
    traced = trace(fun, args, {})
    return _memory_budget(traced, graph_of_traced(traced).graph, device_memory=device_memory,
                          optimizer_state=optimizer_state, argnums=argnums,
                          donate_argnums=donate_argnums, headroom=headroom)


def _memory_budget(traced: Traced, graph: CostGraph | None, *,
                   device_memory: int | str | None = None,
                   optimizer_state: Any = None, argnums: int | Sequence[int] = 0,
                   donate_argnums: Sequence[int] = (), headroom: float = HEADROOM
                   ) -> MemoryBudget:
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom is a fraction of device memory in [0, 1), got {headroom}")
    if device_memory is not None:
        device = parse_bytes(device_memory)
    else:  # the step's devices (a mesh's or the one): the smallest memory among them
        device = min(device_memory_bytes(d) for d in traced.layout.devices())
    args, _ = jax.tree_util.tree_unflatten(traced.in_tree, traced.flat_args)
    params = _positions("argnums", (argnums,) if isinstance(argnums, int) else argnums, len(args))
    donated = _positions("donate_argnums", donate_argnums, len(args))

    param_bytes = sum(_tree_bytes(args[i]) for i in params)
    gradient_bytes = sum(_tree_bytes(args[i], floats_only=True) for i in params)
    if optimizer_state is None:
        optimizer_bytes = 0
    elif isinstance(optimizer_state, int | str):
        optimizer_bytes = parse_bytes(optimizer_state)
    else:
        optimizer_bytes = _tree_bytes(optimizer_state)
    updates = param_bytes - sum(_tree_bytes(args[i]) for i in params & donated)
    if not params <= donated:
        updates += optimizer_bytes

    budget = MemoryBudget(
        device_bytes=device,
        headroom_bytes=math.ceil(device * headroom),
        argument_bytes=sum(_leaf_bytes(x) for x in traced.flat_args),
        gradient_bytes=gradient_bytes,
        optimizer_bytes=optimizer_bytes,
        update_bytes=updates,
        input_residual_bytes=(0 if graph is None
                              else _always_read_argument_bytes(graph, len(traced.flat_args))),
    )
    return budget


def resolve_budget(budget: int | str, traced: Traced, graph: CostGraph | None,
                   auto: dict[str, Any], step: Step, memory: Memory) -> int:
    """Bytes for ``budget``: ``"auto"`` sizes it with the ``auto`` keywords; else parsed."""
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        if memory == Memory.RESIDUALS and graph is None:
            graph = graph_of_traced(traced).graph
        sized = _memory_budget(traced, graph, argnums=step.argnums,
                               donate_argnums=step.donate_argnums, **auto)
        left = sized.peak_budget if memory == Memory.PEAK else sized.residual_budget
        if left <= 0:
            what = "the training step" if memory == Memory.PEAK else "residuals"
            raise BudgetError(f"the device leaves no memory for {what}:\n"
                              + sized.describe(memory))
        return left
    if auto:
        raise TypeError(f"{', '.join(sorted(auto))} only apply to budget='auto'")
    return parse_bytes(budget)


def split_auto_keywords(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(solver options, auto-budget keywords) from ``optimize``'s keyword arguments."""
    solver = {k: v for k, v in options.items() if k not in AUTO_KEYWORDS}
    auto = {k: v for k, v in options.items() if k in AUTO_KEYWORDS}
    return solver, auto


def _always_read_argument_bytes(graph: CostGraph, num_args: int) -> int:
    """Bytes of the function's arguments the backward pass reads whatever the plan.

    Extraction lays the graph's inputs out as constants first, then one input
    per argument leaf. Saving everything needs the fewest values, and any plan
    needs at least those.
    """
    arguments = {graph.value_index[v] for v in graph.inputs[len(graph.inputs) - num_args:]}
    residuals = evaluate(graph, [True] * graph.num_nodes).residuals
    return sum(graph.value_bytes[v] for v in residuals if v in arguments)


def _positions(name: str, positions: Sequence[int], count: int) -> set[int]:
    out = set()
    for i in positions:
        if not isinstance(i, int) or not -count <= i < count:
            raise ValueError(f"{name} has {i!r}, but the function takes {count} arguments")
        out.add(i % count)
    return out


def _dtype(x: Any) -> np.dtype:
    dtype = getattr(x, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.asarray(x).dtype


def _leaf_bytes(x: Any) -> int:
    """Bytes of an array, a ShapeDtypeStruct or a Python scalar, without touching data;
    of one device's shard, for one placed on a mesh."""
    shape = np.shape(x) if not hasattr(x, "shape") else x.shape
    sharding = getattr(x, "sharding", None)
    if sharding is not None:
        shape = sharding.shard_shape(tuple(shape))
    return math.prod(shape) * _dtype(x).itemsize


def _tree_bytes(tree: Any, floats_only: bool = False) -> int:
    leaves = jax.tree_util.tree_leaves(tree)
    if floats_only:
        leaves = [x for x in leaves if jax.numpy.issubdtype(_dtype(x), jax.numpy.inexact)]
    return sum(_leaf_bytes(x) for x in leaves)
