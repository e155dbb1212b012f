"""Saves priced beside recompute: the budget a plan of least estimated time is refined at.

A plan minimises recompute FLOPs within its budget, so it fills the budget with saves
however little each buys. Each saved byte is written in the forward pass and read back
in the backward one, and where a step is bound by memory bandwidth those bytes cost
time that FLOPs do not see: on a TPU v5e the bf16 Llama stack of ``bench/layer_groups.py
--accelerator`` ran 30.0 ms a step planned at 2.39 GiB against 21.0 ms at 1.19 GiB, with
thirty times the recompute; on CPU, at vit_L12's 319.17 MiB, ``dots_saveable`` ran 297 ms
against 341 for a plan saving twice its bytes to spare 9.2e6 FLOPs (none by XLA's count).

``optimize(..., save_price=p)`` asks instead for the plan within the budget that
minimises ``recompute_flops + p * residual_bytes``, ``p`` in FLOPs per saved byte
(``measured_save_price`` reads it off the device). That plan is one the solver gives at
some budget at most the user's, since for its residual bytes it recomputes least. So
``priced_budget`` solves at budgets down from the user's and keeps the cheapest. Going
down, FLOPs never fall, so once a plan recomputes as much as the cheapest cost found, no
plan below can be cheaper and the search stops. The plan is then planned as any other
at the cheapest's predicted peak: refined against its measured step, its layers mixed
where that fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from optiremat.client.peak.refine import SolveAt
from optiremat.solver.solution import InfeasibleBudgetError, Solution
from optiremat.solver.units import format_bytes
from optiremat.solver.wire import FrontierPoint

# The budgets solved: a grid of GRID from the smallest plan's budget to the user's, then
# GRID // 2 more between the cheapest's neighbours. A scan's frontier creeps down in
# steps of a few KiB near its top (masks, small per-layer values), so a walk plan by plan
# would spend its solves there; on the grid the cheapest found is within the price of
# one last step's bytes of the cheapest there is.
GRID = 16


def price_problem(price: object, name: str = "save_price=") -> str | None:
    """What is wrong with ``price`` as a ``save_price=`` (FLOPs per saved byte, a finite
    number >= 0), or None: the words ``optimize``, the plot and the command line (which
    names its flag, ``name``) raise."""
    if (isinstance(price, bool) or not isinstance(price, int | float | Fraction)
            or not math.isfinite(price) or price < 0):
        return (f"{name} takes the FLOPs one saved byte costs, a finite number >= 0 "
                f"(optiremat.measured_save_price() reads it off the device), not {price!r}")
    return None


def priced_cost(plan: Solution | FrontierPoint, price: Fraction) -> Fraction:
    """What ``save_price`` minimises: recompute FLOPs plus ``price`` per residual byte."""
    assert plan.recompute_flops is not None and plan.residual_bytes is not None
    return plan.recompute_flops + price * plan.residual_bytes


def cheapest_priced(points: Sequence[FrontierPoint], price: Fraction) -> FrontierPoint | None:
    """Of a frontier's points, the plan of least ``priced_cost`` (of equal cost, the one of
    fewer bytes), None where no point has a plan. At budgets from its bytes up,
    ``optimize(..., save_price=price)`` plans there, or at a plan between the frontier's
    points that costs less (``priced_budget`` searches its own grid)."""
    plans = [p for p in points
             if p.recompute_flops is not None and p.residual_bytes is not None]
    return min(plans, key=lambda p: (priced_cost(p, price), p.memory_bytes or 0), default=None)


def priced_budget(budget: int, solve_at: SolveAt, price: Fraction) -> int:
    """The budget to plan at for the least ``priced_cost`` within ``budget`` (the module
    docstring): ``budget`` itself where its own plan is the cheapest found or none fits
    (refinement then says why), else the cheapest plan's predicted peak, so that
    refinement, measuring, finds that plan or its equal rather than filling the room
    above it with saves the price says are not worth their bytes."""
    cheapest = _Cheapest(solve_at, price)
    if not cheapest.consider(budget):
        return budget
    try:
        solve_at(0)
        low = 0
    except InfeasibleBudgetError as err:
        low = min(err.min_budget_bytes, budget)
    high = budget
    for count in (GRID, GRID // 2):
        step = max(1, (high - low) // count)
        for i in range(1, count + 1):
            if not cheapest.consider(high - (high - low) * i // count):
                break  # no plan below is cheaper
        high = min(budget, cheapest.solved_at + step)
        low = max(low, cheapest.solved_at - step)
    if cheapest.solved_at == budget:
        return budget
    assert cheapest.plan.peak_bytes is not None, "a peak plan's solve prices its peak"
    return cheapest.plan.peak_bytes


class _Cheapest:
    """The plan of least ``priced_cost`` among those solved, and the budget solved at."""

    def __init__(self, solve_at: SolveAt, price: Fraction) -> None:
        self.solve_at, self.price = solve_at, price
        self.cost: Fraction | None = None
        self.plan: Solution
        self.solved_at = 0
        self._flops: dict[int, int | None] = {}  # per budget solved, its plan's FLOPs

    def consider(self, budget: int) -> bool:
        """Solve at ``budget`` (once); False where no plan fits it or none below can be
        cheaper than the cheapest (going down, FLOPs never fall)."""
        if budget not in self._flops:
            try:
                plan = self.solve_at(budget)
            except InfeasibleBudgetError:
                self._flops[budget] = None
                return False
            self._flops[budget] = plan.recompute_flops
            cost = priced_cost(plan, self.price)
            if self.cost is None or cost < self.cost:
                self.cost, self.plan, self.solved_at = cost, plan, budget
        flops = self._flops[budget]
        return flops is not None and self.cost is not None and flops < self.cost


def priced_note(price: Fraction, asked: int, planned_at: int, plan: Solution) -> str:
    """What ``explain()`` says of a plan asked for with ``save_price=``."""
    cost = float(priced_cost(plan, price))
    where = ("at the budget" if planned_at >= asked
             else f"at {format_bytes(planned_at)} of the {format_bytes(asked)} budget: the "
                  "plans above it save bytes that cost more than the FLOPs they spare")
    return (f"Saves priced at {float(price):.4g} FLOPs a byte: the plan minimising "
            f"recompute FLOPs + price x saved bytes ({cost:.4g}) was planned {where}.")
