"""Recorded answers: the same requests give the same Solution, bit for bit, as when recorded.

A request's answer is cached by its hash and must agree on every host, so a
change to the solver's structure may not change which plan it returns, even
among equally good ones. Each request below is solved and its
``Solution.fingerprint()`` (or the smallest budget it names, or its progress
reports) compared with the value recorded before the solve drivers were merged.
The corpus covers tied, folded, untied, direct, SCIP, baselines, offload
(folded, untied, brute-force sized), peak budgets, sweeps and progress.

Every graph here is built without JAX (synthetic graphs, GraphBuilder), so one
record holds on every supported JAX version (CI runs this on the oldest and
the newest); a graph extracted from a traced function would be recorded per
JAX version, since jaxprs legitimately differ between releases (0.12's tanh
derivative has a ``one_minus_square`` node where 0.10's has a ``sub``).

The values hold for the OR-Tools they were recorded with (a fingerprint names
the solver's version): record them again with ``python -m tests.test_same_answers``
after a deliberate change or an OR-Tools upgrade.
"""

from __future__ import annotations

import pprint
import random
import sys
from functools import cache
from typing import Any

import ortools
import pytest

from optiremat.solver import CostGraph, InfeasibleBudgetError, SolveOptions, solve
from optiremat.solver.frontier import solve_budgets
from optiremat.solver.solve import max_useful_budget, min_feasible_budget
from optiremat.solver.step import RegionMemory, StepMemory
from optiremat.solver.synthetic import transformer_like
from tests.test_offload import _random_graph, chain

RECORDED_WITH = "9.15.6755"  # OR-Tools
CHEAP, DEAR = {"host_bandwidth": 10**13}, {"host_bandwidth": 10**9}


def _with_step(graph: CostGraph) -> CostGraph:
    step = StepMemory(argument_bytes=3 * 2**20, output_bytes=2**20,
                      regions=[RegionMemory(source="model.py:1", length=6,
                                            working_bytes=5 * 2**20)])
    return graph.model_copy(update={"step": step})


@cache
def _requests() -> dict[str, tuple[CostGraph, int, dict[str, Any]]]:
    t3, t4, t6 = transformer_like(3), transformer_like(4), transformer_like(6)
    full = max_useful_budget(t6)
    peak = _with_step(t6)
    assert peak.step is not None
    held = peak.step.held_bytes + peak.step.working_bytes
    requests = {
        "tied, folded": (t6, full // 4, {}),
        "tied, direct": (t6, full // 4, {"direct": True}),
        "untied": (t6, full // 3, {"tie": False}),
        "untied, gap": (t6, full // 3, {"tie": False, "relative_gap": 0.01}),
        "scip": (t4, max_useful_budget(t4) // 3, {"backend": "scip"}),
        "baselines": (t6, full // 2, {"compare_baselines": True}),
        "offload, folded, cheap": (t6, full // 4, {"offload": CHEAP}),
        "offload, folded, dear": (t6, full // 4, {"offload": DEAR}),
        "offload, direct": (t6, full // 4, {"offload": CHEAP, "direct": True}),
        "offload, scip": (t6, full // 4, {"offload": CHEAP, "backend": "scip"}),
        "offload, untied": (t3, max_useful_budget(t3) // 3,
                            {"tie": False, "offload": {"host_bandwidth": 10**12}}),
        "offload, gap": (t3, max_useful_budget(t3) // 4, {"tie": False, "relative_gap": 0.05,
                                                          "offload": {"host_bandwidth": 10**12}}),
        "offload, chain": (chain(), 1000, {"offload": {"host_bandwidth": 10**18}}),
        "offload, no host": (chain(), 1000, {"offload": {"host_bandwidth": 10**18,
                                                         "host_budget_bytes": 0}}),
        "offload, baselines": (chain(6), 2000, {"offload": DEAR, "compare_baselines": True}),
        "peak": (peak, held + full // 4, {}),
        "peak, untied": (peak, held + full // 3, {"tie": False}),
        "peak, offload": (peak, held + full // 12, {"offload": CHEAP}),
        "peak as residuals": (peak, full // 4, {"memory": "residuals"}),
    }
    for seed in range(8):
        rnd = random.Random(seed)
        g = _random_graph(seed)
        offload = {"host_budget_bytes": rnd.randrange(0, 150),
                   "host_bandwidth": rnd.choice([1, 3, 7, 10**6]),
                   "device_flop_rate": rnd.choice([1, 2, 5])}
        requests[f"offload, random {seed}"] = (g, rnd.randrange(0, 150), {"offload": offload})
        requests[f"random {seed}"] = (g, rnd.randrange(0, 150), {"tie": bool(seed % 2)})
    return requests


def _answer(graph: CostGraph, budget: int, options: dict[str, Any]) -> str:
    try:
        solution = solve(graph, budget, SolveOptions(time_limit_s=60, **options))
    except InfeasibleBudgetError as err:
        return f"infeasible {err.min_budget_bytes}"
    return solution.fingerprint()[:16]


def _sweep(graph: CostGraph, options: dict[str, Any]) -> list[str]:
    request = SolveOptions(time_limit_s=60, **options)
    low, high = min_feasible_budget(graph, request.tie), max_useful_budget(graph)
    budgets = [low - 1] + [low + (high - low) * i // 5 for i in range(6)]
    return [f"infeasible {r.min_budget_bytes}" if isinstance(r, InfeasibleBudgetError)
            else r.fingerprint()[:16] for r in solve_budgets(graph, budgets, request).values()]


@cache
def _sweeps() -> dict[str, tuple[CostGraph, dict[str, Any]]]:
    return {"tied": (transformer_like(6), {}), "untied": (transformer_like(3), {"tie": False}),
            "offload": (chain(6), {"offload": DEAR}), "peak": (_with_step(transformer_like(6)), {})}


def _progress(options: dict[str, Any]) -> list[tuple[int, int]]:
    """(incumbent, bound) of every report; elapsed seconds left out."""
    g = transformer_like(6)
    seen: list[tuple[int, int]] = []
    solve(g, max_useful_budget(g) // 4, SolveOptions(time_limit_s=60, **options),
          progress=lambda incumbent, bound, _: seen.append((incumbent, bound)))
    return seen


PROGRESS = {"tied": {}, "untied": {"tie": False}, "offload": {"offload": CHEAP}}

# Recorded at 91936c5, before the offload solve became a layer of the formulation.
ANSWERS: dict[str, str] = {
    "tied, folded": "aa2405c9a07336e4",
    "tied, direct": "1e856decded20625",
    "untied": "b9a177dc47108ac5",
    "untied, gap": "7be569697f6cf192",
    "scip": "ccc890a419e76c8f",
    "baselines": "3a95be20086dcc2e",
    "offload, folded, cheap": "0eba7ebcadac290b",
    "offload, folded, dear": "9a2d618e46c5ab9b",
    "offload, direct": "be1c27662facbe30",
    "offload, scip": "cfaa4644a263916e",
    "offload, untied": "2e970c3bebfc405b",
    "offload, gap": "02111dfe7b979966",
    "offload, chain": "77d047231b6313bd",
    "offload, no host": "d8cd75e4b2699568",
    "offload, baselines": "862811d4cad6c52b",
    "peak": "ef11afc5d8ac27c7",
    "peak, untied": "f98f9c0a3de303d7",
    "peak, offload": "b25ccab7c345d32d",
    "peak as residuals": "09153e1d6607adc0",
    "offload, random 0": "adcc1e2eef25e461",
    "random 0": "726f6df4278db57f",
    "offload, random 1": "4c5cdfc5e6730c89",
    "random 1": "5fd8316807fc6690",
    "offload, random 2": "4a7e377984359b76",
    "random 2": "a6b5170809c257ff",
    "offload, random 3": "9aa98e191a6a0bef",
    "random 3": "d72e4bb6da095700",
    "offload, random 4": "96b233c81fd5cd2a",
    "random 4": "62bcf2a455ebdd25",
    "offload, random 5": "9bbf8f858d0a4dc2",
    "random 5": "infeasible 49",
    "offload, random 6": "e7fa7b30ab593c9b",
    "random 6": "infeasible 85",
    "offload, random 7": "infeasible 19",
    "random 7": "infeasible 57",
}
SWEEPS: dict[str, list[str]] = {
    "tied": [
        "infeasible 155213828", "c38ef497f0ffbae1", "1264113af176c92f",
        "c7d9c544016199dd", "b05ac3db32be9bed", "fc1215159ade1ff2",
        "33756d8ba9550c83",
    ],
    "untied": [
        "infeasible 79704068", "ed5e6e0ad68f74f0", "8ae32d2423d5b071",
        "01bb90056b16603c", "e34d4a5f0a0819bc", "30e3dc4a1367288c",
        "489135978f236f4a",
    ],
    "offload": [
        "ad2bab056acbec08", "5d3a0ef6578553b9", "9904c80ef94dc549",
        "e474ea4d48aa4cd8", "d84fc2feed645123", "bd4da22e2963931f",
        "3a1052aec6fe9f97",
    ],
    "peak": [
        "infeasible 9437184", "cc585b7b2a1be43f", "32044b485286310e", "dff50dff06c9e9be",
        "9435896639efaf37", "ce57543de9fdca08", "389743b4409d4636"],
}
REPORTS: dict[str, list[tuple[int, int]]] = {
    "tied": [
        (116819755008, 0), (91251277824, 91251277824),
    ],
    "untied": [
        (78416756736, 0), (78387384320, 78309805056),
        (78370574336, 78316093440), (78366375936, 78316093440),
    ],
    "offload": [
        (95084371968, 2850578432), (32696696832, 19843252224),
        (23846215680, 19843252224), (21841838080, 19843252224),
        (19843252224, 19843252224),
    ],
}
BUDGETS: dict[str, list[int]] = {
    "stack": [155213828, 155213828, 1309138948],
    "chain": [1000, 1000, 4000],
}

pytestmark = pytest.mark.skipif(ortools.__version__ != RECORDED_WITH,
                                reason=f"answers recorded with OR-Tools {RECORDED_WITH}")


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_a_request_gives_its_recorded_answer(name: str) -> None:
    assert _answer(*_requests()[name]) == ANSWERS[name]


@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_a_sweep_gives_its_recorded_points(name: str) -> None:
    assert _sweep(*_sweeps()[name]) == SWEEPS[name]


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_progress_reports_are_the_recorded_ones(name: str) -> None:
    assert _progress(PROGRESS[name]) == REPORTS[name]


def test_frontier_ends_are_the_recorded_ones() -> None:
    assert _budgets() == BUDGETS


def _budgets() -> dict[str, list[int]]:
    return {name: [min_feasible_budget(g), min_feasible_budget(g, tie=False), max_useful_budget(g)]
            for name, g in (("stack", transformer_like(6)), ("chain", chain()))}


def _record() -> None:
    """Print the tables above as they are today, to paste over them."""
    tables = {
        "ANSWERS": {name: _answer(*request) for name, request in _requests().items()},
        "SWEEPS": {name: _sweep(*sweep) for name, sweep in _sweeps().items()},
        "REPORTS": {name: _progress(options) for name, options in PROGRESS.items()},
        "BUDGETS": _budgets(),
    }
    for name, table in tables.items():
        sys.stdout.write(f"{name} = {pprint.pformat(table, width=100, sort_dicts=False)}\n")


if __name__ == "__main__":
    _record()
