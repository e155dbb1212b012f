"""Peak budgets: a budget is the peak bytes of the compiled training step.

What runs out on a device is the peak of ``jax.jit(jax.grad(loss))`` as XLA's
``memory_analysis()`` counts it: argument + output + temp - alias bytes. A
plan moves only part of that, so the model is::

    peak(plan) = held + working + residual bytes that are not arguments

* ``held``: arguments (parameters, batch) + outputs (gradients) - bytes the
  outputs alias (donated arguments); fixed by the step's signature.
* residuals: what the forward pass leaves for the backward pass. Residuals
  inside a ``lax.scan`` are stacked over its length (``value_bytes`` already
  are), so this is per-layer residuals x layers, plus the rest; a residual may
  cost more on the device than its size (``value_extra_bytes``). Residuals that
  are arguments are held anyway and cost nothing more.
* ``working``: the largest transient working set of the backward pass, one
  layer's recomputation and its cotangents, measured by one compile of one
  layer per region (``optiremat.client.calibration``).

Measured on the scan corpus (``bench/peak.py``): XLA's temp bytes are exactly
linear in the number of layers for a fixed policy, with the stacked residuals
as the slope, so held + residuals is exact and the working set is the only
estimate. Along the frontier of optimal plans it varies by 1-8% of the peak
around the calibrated value.

A peak budget is therefore a residual budget shifted by ``held + working``, on
a view of the graph whose argument values weigh nothing: the search is the
same MILP. ``SolveOptions.memory`` picks the meaning; by default a graph that
carries its step (``CostGraph.step``) is planned by peak, any other by
residuals.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from optiremat.solver.graph import CostGraph, GraphError
from optiremat.solver.semantics import evaluate
from optiremat.solver.solution import InfeasibleBudgetError, Solution, SolveOptions
from optiremat.solver.step import Memory, StepMemory

# The outer scan's own small buffers (its counters and loop-state tuples): 384 to
# 744 bytes on the scan corpus (bench/peak.py), so a little more is allowed.
OUTER_LOOP_BYTES = 1024


def nesting_bytes(step: StepMemory, groups: Sequence[int]) -> int:
    """What the regions' layers in ``groups`` rematerialised groups hold beyond one group's
    stacked residuals (``solver.nesting``): each group's input, and one group's slice of
    the stacked parameters and their gradients, which the outer scan copies."""
    held = 0
    for region, k in zip(step.regions, groups, strict=True):
        if k != 1:
            held += (k * region.carry_bytes + region.length // k * region.slice_bytes
                     + OUTER_LOOP_BYTES)
    return held


def canonical_options(graph: CostGraph, options: SolveOptions) -> SolveOptions:
    """``options`` without a ``memory`` that only repeats the graph's default, so that
    both ways of asking for the same plan get the same answer, bit for bit."""
    default = Memory.PEAK if graph.step is not None else Memory.RESIDUALS
    if options.memory is not None and resolve_memory(graph, options.memory) == default:
        return options.model_copy(update={"memory": None})
    return options


def resolve_memory(graph: CostGraph, memory: Memory | None) -> Memory:
    """What a budget means for ``graph``: as asked, else peak when it knows its step."""
    if memory is None:
        return Memory.PEAK if graph.step is not None else Memory.RESIDUALS
    if memory == Memory.PEAK and graph.step is None:
        raise GraphError(
            "memory='peak' needs a graph that carries its training step (one from "
            "optiremat.extract_step, or optiremat extract); this one does not: plan it with "
            "memory='residuals'")
    return Memory(memory)


def value_weights(graph: CostGraph, groups: Sequence[int], extra: bool = True) -> list[int]:
    """Per value, what a residual costs a peak budget: nothing for an argument (held
    anyway), else its bytes (and, with ``extra``, its ``value_extra_bytes``), a
    region's stacked values divided by the region's group count."""
    arguments = {graph.value_index[v] for v in graph.inputs}
    more = graph.value_extra_bytes if extra and graph.value_extra_bytes else [0] * graph.num_values
    stacked_by = graph.value_region or [-1] * graph.num_values
    weights = []
    for v, (nbytes, added) in enumerate(zip(graph.value_bytes, more, strict=True)):
        # In k groups, one group's layers are live at a time: 1/k of the stack
        # (stacked bytes are the layers times one layer's, so this is exact).
        r = stacked_by[v]
        weights.append(0 if v in arguments else (nbytes + added) // (groups[r] if r >= 0 else 1))
    return weights


def priced_extra_bytes(graph: CostGraph, saves: Sequence[bool],
                       groups: Sequence[int] | None = None) -> int:
    """What a peak budget prices for the plan saving ``saves`` beyond its residuals'
    sizes: the ``value_extra_bytes`` (XLA's copies) of those it weighs."""
    if graph.value_extra_bytes is None:
        return 0
    assert graph.step is not None
    groups = [1] * len(graph.step.regions) if groups is None else list(groups)
    with_extra, without = value_weights(graph, groups), value_weights(graph, groups, extra=False)
    return sum(with_extra[v] - without[v] for v in evaluate(graph, list(saves)).residuals)


@dataclass(frozen=True)
class BudgetView:
    """The graph a search runs on and the bytes every plan holds besides its residuals."""

    graph: CostGraph
    memory: Memory
    held_bytes: int  # arguments + outputs - aliases + working set (0 for residual budgets)

    @classmethod
    def of(cls, graph: CostGraph, memory: Memory | None,
           groups: Sequence[int] | None = None) -> BudgetView:
        """The view of ``graph``; with ``groups`` (per region, a peak budget), the view of
        its regions' layers in that many rematerialised groups (``solver.nesting``)."""
        mode = resolve_memory(graph, memory)
        if mode == Memory.RESIDUALS:
            if groups is not None and any(k != 1 for k in groups):
                raise GraphError("groups of layers are a peak-budget plan")
            return cls(graph, mode, 0)
        step = graph.step
        assert step is not None
        groups = [1] * len(step.regions) if groups is None else list(groups)
        view = CostGraph.model_construct(**{**dict(graph),
                                            "value_bytes": value_weights(graph, groups),
                                            "step": None, "value_extra_bytes": None})
        held = step.held_bytes + step.working_bytes + nesting_bytes(step, groups)
        return cls(view, mode, held)

    def predicted(self, saves: list[bool]) -> int:
        """The budget the plan saving ``saves`` (per node) needs."""
        return self.budget(evaluate(self.graph, saves).residual_bytes)

    def search_budget(self, budget: int) -> int:
        """The residual budget a plan within ``budget`` has (negative: nothing fits)."""
        return budget - self.held_bytes

    def budget(self, search_bytes: int) -> int:
        """The budget a plan of ``search_bytes`` residual bytes in the view needs."""
        return search_bytes + self.held_bytes

    def solve(self, graph: CostGraph, budget: int,
              search: Callable[[CostGraph, int], Solution],
              min_search_bytes: Callable[[], int]) -> Solution:
        """``search`` on the view at the shifted budget, reported in ``budget``'s terms."""
        inner = self.search_budget(budget)
        if inner < 0:
            raise InfeasibleBudgetError(budget, self.budget(min_search_bytes()))
        try:
            answer = search(self.graph, inner)
        except InfeasibleBudgetError as err:
            raise InfeasibleBudgetError(budget, self.budget(err.min_budget_bytes)) from None
        return self.report(graph, budget, answer)

    def report(self, graph: CostGraph, budget: int, answer: Solution) -> Solution:
        """The view's answer for ``graph``: residual bytes of every residual (what
        ``saved_residuals`` lists), and the predicted peak."""
        if self.memory == Memory.RESIDUALS:
            return answer
        update: dict[str, Any] = {"graph_hash": graph.content_hash, "budget_bytes": budget}
        if answer.node_decisions:
            full = evaluate(graph, [d != "recompute" for d in answer.node_decisions])
            update["residual_bytes"] = full.residual_bytes - answer.host_bytes
            update["peak_bytes"] = self.budget(answer.residual_bytes)
        return answer.model_copy(update=update)
