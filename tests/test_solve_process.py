"""A local solve in a child process (``solver.out_of_process``): the same plan, the same
errors, and a process that survives a solver that dies.

TensorFlow is too big to install here; a stand-in plays its part: a module named
``tensorflow`` whose import makes any OR-Tools solve in its process abort, as
TensorFlow's protobuf makes CP-SAT's native code crash (issue 29). Planning next to
it must not die.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

from optiremat.solver.graph import CostGraph
from optiremat.solver.out_of_process import (
    ENV_FLAG,
    SolveProcessError,
    local_solve,
    out_of_process,
    solve_in_child,
)
from optiremat.solver.solution import InfeasibleBudgetError, Solution
from optiremat.solver.solve import max_useful_budget, min_feasible_budget, solve
from optiremat.solver.synthetic import transformer_like


@pytest.fixture(scope="module")
def graph() -> CostGraph:
    return transformer_like(2, seq=64, d_model=128, heads=4)


def _same(a: Solution, b: Solution) -> None:
    assert a.model_dump_json(exclude={"solve_seconds"}) == \
        b.model_dump_json(exclude={"solve_seconds"})


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_child_solves_the_plan_this_process_solves(graph: CostGraph, tie: bool) -> None:
    lo, hi = min_feasible_budget(graph, tie=tie), max_useful_budget(graph)
    budget = lo + (hi - lo) // 3
    _same(solve_in_child(graph, budget, tie=tie), solve(graph, budget, tie=tie))


def test_an_infeasible_budget_crosses_as_itself(graph: CostGraph) -> None:
    budget = min_feasible_budget(graph) - 1
    with pytest.raises(InfeasibleBudgetError) as here:
        solve(graph, budget)
    with pytest.raises(InfeasibleBudgetError) as there:
        solve_in_child(graph, budget)
    assert str(there.value) == str(here.value)
    assert (there.value.budget_bytes, there.value.min_budget_bytes) == \
        (here.value.budget_bytes, here.value.min_budget_bytes)


def test_other_errors_cross_with_their_type_and_message(graph: CostGraph) -> None:
    with pytest.raises(ValueError) as here:
        solve(graph, 2**62)
    with pytest.raises(ValueError) as there:
        solve_in_child(graph, 2**62)
    assert type(there.value) is type(here.value) and str(there.value) == str(here.value)


def test_a_child_that_dies_is_a_clear_error(graph: CostGraph) -> None:
    killed = [sys.executable, "-c", "import os, sys; sys.stderr.write('boom'); os.abort()"]
    with pytest.raises(SolveProcessError, match=r"(?s)killed by SIGABRT without an answer.*boom"):
        solve_in_child(graph, 10**9, command=killed)
    silent = [sys.executable, "-c", "print('not an answer')"]
    with pytest.raises(SolveProcessError, match="exited 0 without an answer"):
        solve_in_child(graph, 10**9, command=silent)


def test_where_a_solve_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_FLAG, raising=False)
    monkeypatch.delitem(sys.modules, "tensorflow", raising=False)
    assert not out_of_process()
    monkeypatch.setitem(sys.modules, "tensorflow", types.ModuleType("tensorflow"))
    assert out_of_process()
    monkeypatch.setenv(ENV_FLAG, "0")  # asked: in process, whatever is loaded
    assert not out_of_process()
    monkeypatch.delitem(sys.modules, "tensorflow")
    monkeypatch.setenv(ENV_FLAG, "1")
    assert out_of_process()
    monkeypatch.setenv(ENV_FLAG, "maybe")
    with pytest.raises(ValueError, match=f"{ENV_FLAG}='maybe'"):
        out_of_process()


def test_the_forced_path_solves_in_a_child(graph: CostGraph,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_FLAG, "1")
    budget = max_useful_budget(graph)
    _same(local_solve(graph, budget), solve(graph, budget))


# A stand-in for TensorFlow: importing it makes OR-Tools die in this process.
LETHAL = """
import os
from ortools.linear_solver import pywraplp
from ortools.sat.python import cp_model

def _die(*args, **kwargs):
    os.abort()

cp_model.CpSolver.solve = cp_model.CpSolver.Solve = pywraplp.Solver.Solve = _die
"""

# A small function and its plan, made here and in a child Python beside the stand-in.
PROBLEM = """
import jax.numpy as jnp
import optiremat

def loss(x, w):
    return jnp.sum(jnp.tanh(jnp.sin(x @ w) @ w))

x, w = jnp.ones((16, 32)), jnp.full((32, 32), 0.01)
plan = optiremat.optimize(loss, x, w, budget="20KiB", memory="residuals")
answer = plan.solution.model_dump_json(exclude={"solve_seconds"})
"""


@pytest.fixture(scope="module")
def plan_here() -> str:
    """The plan solved in this process, where OR-Tools is safe."""
    namespace: dict = {}
    exec(PROBLEM, namespace)
    return namespace["answer"]


def _plan_beside(module: str, flag: str | None,
                 tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The plan solved by a Python that imported ``module``, the stand-in, first."""
    (tmp_path / f"{module}.py").write_text(LETHAL)
    env = {k: v for k, v in os.environ.items() if k != ENV_FLAG}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    if flag is not None:
        env[ENV_FLAG] = flag
    # exec'd as here: the graph records source lines, which its hash covers.
    script = f"import {module}\nexec({PROBLEM!r})\nprint(answer)"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300, check=False)


@pytest.mark.parametrize(("module", "flag"), [("tensorflow", None), ("poisoned", "1")],
                         ids=["tensorflow-loaded", "asked"])
def test_planning_beside_a_lethal_library_survives(module: str, flag: str | None,
                                                   tmp_path: Path, plan_here: str) -> None:
    run = _plan_beside(module, flag, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == plan_here


def test_the_stand_in_is_lethal_in_process(tmp_path: Path) -> None:
    """Asked to solve in process, the same plan dies with its process: the stand-in is
    as lethal as it claims, and the flag's 0 is obeyed."""
    run = _plan_beside("tensorflow", "0", tmp_path)
    assert run.returncode == -signal.SIGABRT, (run.returncode, run.stderr[-2000:])
