"""Solve a cost graph for a budget: the solver's requests.

``solve`` answers one budget, ``BudgetSeries`` (and ``solve_from``) several budgets of
one graph on one formulation and backend model, ``min_feasible_budget`` and
``max_useful_budget`` the ends of a frontier. A budget means the peak of the
training step or residual bytes (``optiremat.solver.peak``): each request runs
its search on the view of the graph that budget needs. The search itself,
phases, starts, exact pricing and the Solution, is ``optiremat.solver.search``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import optiremat.solver.collectives as collectives
from optiremat.solver.graph import CostGraph
from optiremat.solver.nesting import choose_groups, lever_options, min_budget_over_groups, nests
from optiremat.solver.offload import OffloadOptions
from optiremat.solver.peak import BudgetView, canonical_options, resolve_memory
from optiremat.solver.semantics import evaluate
from optiremat.solver.solution import Backend, ProgressCallback, Solution, SolveOptions
from optiremat.solver.step import Memory
from optiremat.solver.validation import check_budget

if TYPE_CHECKING:
    from optiremat.solver.repeats import FoldedSearch
    from optiremat.solver.search import Search

__all__ = ["ProgressCallback", "BudgetSeries", "Solver", "max_useful_budget",
           "min_feasible_budget", "resolve_options", "solve", "solve_from"]


class Solver(Protocol):
    """What answers one solve request: ``solve`` here, ``out_of_process.local_solve`` (in
    a child process where OR-Tools is unsafe), or a server (``RematClient.solve``). The
    options come validated, once, by whoever took them from a user."""

    def __call__(self, graph: CostGraph, budget_bytes: int, options: SolveOptions, /
                 ) -> Solution: ...


def solve(
    graph: CostGraph,
    budget_bytes: int,
    options: SolveOptions | None = None,
    *,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    groups: Sequence[int] | None = None,
    **overrides: Any,
) -> Solution:
    """The plan with the fewest recompute FLOPs that fits ``budget_bytes``.

    The budget is the peak of the training step when the graph carries its
    step, else the residual bytes (``options.memory`` chooses; ``solver.peak``).
    ``overrides`` are SolveOptions fields (``solve(g, b, tie=False)``). Setting
    ``cancel`` stops the search and returns the best plan found so far. A peak
    budget may nest a region's layers in groups (``solver.nesting``); ``groups``
    fixes their counts instead. Raises InfeasibleBudgetError, naming the smallest
    feasible budget, when no plan fits.
    """
    started = time.monotonic()
    options = resolve_options(options, overrides)
    check_budget(budget_bytes)
    return BudgetSeries(graph, options, cancel, groups, progress=progress,
                        started=started).solve(budget_bytes)


def solve_from(
    graph: CostGraph,
    budget_bytes: int,
    options: SolveOptions,
    start: Sequence[bool] | None,
    *,
    cancel: threading.Event | None = None,
) -> Solution:
    """``solve`` that starts from a plan (per node save flags), e.g. a neighbouring
    budget's answer in a sweep: when it fits, the search is hinted with it and
    cut off at its FLOPs, so the answer is never worse than ``start``."""
    return BudgetSeries(graph, options, cancel).solve(budget_bytes, start)


class BudgetSeries:
    """Solves of one graph at several budgets sharing one formulation and backend
    model, as a frontier needs: each ``solve`` has the full time limit and, like
    ``solve_from``, starts from the plan it is given. ``solve`` is a series of one.

    The levers apply here, and only here, in this order: the links' price
    (``collectives``), the layers nested in groups (``nesting``, one series per group
    count), and the budget's view of the graph (``peak.BudgetView``).

    With offload each budget is a request of its own, answered as ``solve``
    answers it: an offload search takes no start (``optiremat.solver.search``),
    and a model shared between budgets hints each with the last answer it found,
    which changed 38 of 144 points of offload sweeps on transformer stacks.
    """

    def __init__(
        self, graph: CostGraph, options: SolveOptions, cancel: threading.Event | None = None,
        groups: Sequence[int] | None = None, *, progress: ProgressCallback | None = None,
        started: float | None = None,
    ) -> None:
        self._options = canonical_options(graph, options)
        self._asked = graph  # what answers are reported on; the search runs on its price
        graph = self._graph = collectives.priced(graph, self._options)
        self._cancel = cancel
        self._progress = progress
        self._started = started  # the first solve's clock, if it started before this
        memory = resolve_memory(graph, self._options.memory)
        self._nested: dict[tuple[int, ...], BudgetSeries] | None = None
        if groups is None and nests(graph, memory, self._options):
            self._nested = {}  # one sweep per group count, built on first use
            return
        self._view = BudgetView.of(graph, self._options.memory, groups)
        self._shared = self._search() if self._options.offload is None else None

    def solve(self, budget_bytes: int, start: Sequence[bool] | None = None) -> Solution:
        answer = self._solve(budget_bytes, start)
        if self._graph is self._asked:
            return answer
        return collectives.report(self._asked, answer)

    def _solve(self, budget_bytes: int, start: Sequence[bool] | None) -> Solution:
        if self._nested is not None:
            return choose_groups(self._graph, budget_bytes, self._options,
                                  lambda g: self._grouped(g).solve(budget_bytes, start))
        search = self._shared or self._search()
        search.restart_clock(self._clock())
        return self._view.solve(self._graph, budget_bytes,
                                lambda _, budget: search.solve(budget, start),
                                search.min_budget)

    def _clock(self) -> float:
        """When the next solve started: ``started`` for the first, else now."""
        started, self._started = self._started, None
        return time.monotonic() if started is None else started

    def _search(self) -> Search | FoldedSearch:
        # its clock restarts at each solve (_clock)
        return _search_for(self._view.graph, self._options, time.monotonic(), self._progress,
                           self._cancel)

    def _grouped(self, groups: tuple[int, ...]) -> BudgetSeries:
        assert self._nested is not None
        if groups not in self._nested:
            self._nested[groups] = BudgetSeries(
                self._graph, lever_options(self._options, groups), self._cancel, groups,
                progress=self._progress)
        return self._nested[groups]


def min_feasible_budget(graph: CostGraph, tie: bool = True, memory: Memory | None = None,
                        nest: bool = True, offload: OffloadOptions | None = None) -> int:
    """The smallest budget any plan fits (tied by policy key when ``tie``; peak plans
    nested in groups too, unless ``nest`` is off; with ``offload``, device bytes with
    the plan per layer offloading within the host budget)."""
    options = SolveOptions(tie=tie, backend=Backend.CPSAT, nest=nest, offload=offload)

    def least(groups: Sequence[int] | None) -> int:
        view = BudgetView.of(graph, memory, groups)
        asked = options if groups is None else lever_options(options, groups)
        return view.budget(_search_for(view.graph, asked, time.monotonic(), None, None)
                           .min_budget())

    if nests(graph, resolve_memory(graph, memory), options):
        return min_budget_over_groups(graph, least)
    return least(None)


def max_useful_budget(graph: CostGraph, memory: Memory | None = None) -> int:
    """The budget of saving everything: no budget above this buys fewer FLOPs."""
    view = BudgetView.of(graph, memory)
    return view.budget(evaluate(view.graph, [True] * graph.num_nodes).residual_bytes)


def resolve_options(options: SolveOptions | None, overrides: dict[str, Any]) -> SolveOptions:
    """``options`` with ``overrides`` applied, validated like a request."""
    base = options or SolveOptions()
    if not overrides:
        return base
    return SolveOptions.model_validate({**base.model_dump(), **overrides})


def _search_for(graph: CostGraph, options: SolveOptions, started: float,
                progress: ProgressCallback | None,
                cancel: threading.Event | None) -> Search | FoldedSearch:
    """``search.search_for``, imported at the first search: only a search needs
    OR-Tools, and a client planning through a server (``RematClient``) may lack it."""
    try:
        from optiremat.solver.search import search_for
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] != "ortools":
            raise
        raise ImportError(
            "a local solve needs OR-Tools, which is not installed here: pip install ortools, "
            "or plan through a server with optiremat.RematClient(url).optimize(...)") from exc

    return search_for(graph, options, started, progress, cancel)
