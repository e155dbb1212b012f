"""Peak budgets: a budget is the peak bytes of the compiled training step.

What runs out on a device is the peak of ``jax.jit(jax.grad(loss))`` as XLA's
``memory_analysis()`` counts it: argument + output + temp - alias bytes. The
step runs in *phases*, and its peak is the largest of them::

    peak(plan) = held + max over phases p of (residuals live in p + working set of p)

* ``held``: arguments (parameters, batch) + outputs (gradients) - bytes the
  outputs alias (donated arguments); fixed by the step's signature.
* the phases (``step_phases``): each region's backward pass, one layer at a
  time, and the phases outside every region (the forward pass's end and the
  backward of what follows the last region: an LM head's logits, softmax and
  their cotangents). The backward pass runs the program in reverse, so a
  residual is live from where the forward pass makes it to the backward of the
  earliest part that reads it: an LM head's residuals are freed before any
  layer's backward runs, the stacked residuals of a ``lax.scan`` live until its
  backward ends, and every residual is live at the end of the forward pass.
* residuals: what the forward pass leaves for the backward pass. Residuals
  inside a ``lax.scan`` are stacked over its length (``value_bytes`` already
  are); a residual may cost more on the device than its size
  (``value_extra_bytes``). Residuals that are arguments are held anyway. Only
  the regions' residuals move with the plan; those outside every region are
  JAX's own choice, the same for every plan, and are counted in the phases
  that hold them.
* working sets: a region's is one layer's recomputation and cotangents,
  measured by one compile of one layer (``optiremat.client.peak.calibration``); the
  phases outside the regions hold ``StepMemory.outside_working_bytes``,
  measured by one compile of the step.

Every phase holds the regions' residuals (a step's regions are planned as one
row: exact for one region, and for several it counts a later region's
residuals in an earlier one's backward, which has freed them), so the budget
is one residual budget shifted by ``held`` + the largest phase's fixed bytes,
on a view of the graph whose fixed residuals weigh nothing: the search is the
same MILP. ``SolveOptions.memory`` picks the meaning; by default a graph that
carries its step (``CostGraph.step``) is planned by peak, any other by
residuals.

Measured on the scan corpus (``bench/peak.py``): XLA's temp bytes are exactly
linear in the number of layers for a fixed policy, with the stacked residuals
as the slope; and on the LM corpus (``tests/lm_models.py``) the head's phase
sets the peak from vocabularies of about 8k at these sizes, where the phase
model predicts it within bytes and a sum of every residual and the largest
layer working set ran 11-80% under it.
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
class Phase:
    """One phase of the step: what it holds besides ``held`` and the plan's residuals."""

    name: str  # "backward of region 0" or "outside the regions"
    region: int  # the region whose backward pass this is; -1 outside every region
    working_bytes: int  # its working set
    fixed_residual_bytes: int = 0  # the residuals no plan changes that are live here

    @property
    def fixed_bytes(self) -> int:
        """What the phase holds whatever the plan, besides the step's held bytes."""
        return self.working_bytes + self.fixed_residual_bytes


# The last few graphs' fixed residuals: every view of a solve (each group count, each
# refining round) asks for them, and each answer is two evaluations of the graph.
_FIXED_CACHE: dict[int, tuple[CostGraph, list[int]]] = {}
_FIXED_CACHE_SIZE = 8


def fixed_residuals(graph: CostGraph) -> list[int]:
    """The values outside every region that are residuals whatever the plan (JAX's AD
    saves them: nothing decides there), as positions: residual both when every node is
    saved and when none is. Empty for a graph priced the way it was before phases."""
    if graph.step is None or graph.step.outside_working_bytes is None:
        return []
    cached = _FIXED_CACHE.get(id(graph))
    if cached is not None and cached[0] is graph:
        return cached[1]
    fixed = _fixed_residuals(graph)
    if len(_FIXED_CACHE) >= _FIXED_CACHE_SIZE:
        _FIXED_CACHE.pop(next(iter(_FIXED_CACHE)))
    _FIXED_CACHE[id(graph)] = (graph, fixed)
    return fixed


def _fixed_residuals(graph: CostGraph) -> list[int]:
    stacked_by = graph.value_region or [-1] * graph.num_values
    regions = graph.node_region or [-1] * graph.num_nodes
    producer = graph.producer
    every = set(evaluate(graph, [True] * graph.num_nodes).residuals)
    none = set(evaluate(graph, [False] * graph.num_nodes).residuals)
    return [v for v in sorted(every & none) if stacked_by[v] < 0
            and ((p := producer[v]) is None or regions[p] < 0)]


def _freed_at(graph: CostGraph) -> list[int]:
    """Per value, the position (in program order: 2r+1 for region r, 2r for what runs
    between regions r-1 and r) of the earliest part that reads it: the backward pass
    runs the positions in reverse and frees a residual once that part's backward ends."""
    regions = graph.node_region or [-1] * graph.num_nodes
    position, seen = [], -1
    for r in regions:
        seen = max(seen, r)
        position.append(2 * r + 1 if r >= 0 else 2 * (seen + 1))
    producer = graph.producer
    freed = [position[p] if p is not None else 0 for p in producer]
    for n, reads in enumerate(graph.node_inputs):
        for v in reads:
            freed[v] = min(freed[v], position[n])
    return freed


def step_phases(graph: CostGraph, groups: Sequence[int] | None = None,
                region_working: Sequence[int] | None = None) -> list[Phase]:
    """The step's phases, each with its fixed bytes; a region's working set is the
    calibrated one unless ``region_working`` (per region) says otherwise. The phases
    outside every region are one phase: at the forward pass's end and in the backward
    of what follows the last region every residual is live."""
    step = graph.step
    assert step is not None
    working = [r.working_bytes for r in step.regions] if region_working is None \
        else list(region_working)
    fixed = fixed_residuals(graph)
    if step.outside_working_bytes is None:  # priced as before phases: one per region
        return [Phase(f"backward of region {r}", r, w) for r, w in enumerate(working)]
    groups = [1] * len(step.regions) if groups is None else list(groups)
    weights = value_weights(graph, groups)
    freed = _freed_at(graph)
    phases = [Phase(f"backward of region {r}", r, w,
                    sum(weights[v] for v in fixed if freed[v] <= 2 * r + 1))
              for r, w in enumerate(working)]
    phases.append(Phase("outside the regions", -1, step.outside_working_bytes,
                        sum(weights[v] for v in fixed)))
    return phases


@dataclass(frozen=True)
class BudgetView:
    """The graph a search runs on and the bytes every plan holds besides its residuals."""

    graph: CostGraph
    memory: Memory
    held_bytes: int  # arguments + outputs - aliases + the largest phase's fixed bytes
    phases: tuple[Phase, ...] = ()  # a peak budget's phases (``step_phases``)

    @classmethod
    def of(cls, graph: CostGraph, memory: Memory | None,
           groups: Sequence[int] | None = None,
           region_working: Sequence[int] | None = None) -> BudgetView:
        """The view of ``graph``; with ``groups`` (per region, a peak budget), the view of
        its regions' layers in that many rematerialised groups (``solver.nesting``); with
        ``region_working``, each region's backward working set as measured for a plan."""
        mode = resolve_memory(graph, memory)
        if mode == Memory.RESIDUALS:
            if groups is not None and any(k != 1 for k in groups):
                raise GraphError("groups of layers are a peak-budget plan")
            return cls(graph, mode, 0)
        step = graph.step
        assert step is not None
        groups = [1] * len(step.regions) if groups is None else list(groups)
        weights = value_weights(graph, groups)
        for v in fixed_residuals(graph):  # priced in the phases that hold them
            weights[v] = 0
        view = CostGraph.model_construct(**{**dict(graph), "value_bytes": weights,
                                            "step": None, "value_extra_bytes": None})
        phases = tuple(step_phases(graph, groups, region_working))
        held = (step.held_bytes + max((p.fixed_bytes for p in phases), default=0)
                + nesting_bytes(step, groups))
        return cls(view, mode, held, phases)

    def peak_phase(self) -> Phase | None:
        """The phase that sets the peak of every plan (all phases hold the same plan
        residuals); None for a residual budget."""
        return max(self.phases, key=lambda p: p.fixed_bytes, default=None)

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
        if answer.planned:
            full = evaluate(graph, answer.kept())
            update["residual_bytes"] = full.residual_bytes - answer.host_bytes
            update["peak_bytes"] = self.budget(answer.residual_bytes)
        return answer.model_copy(update=update)
