"""A local solve in a child process, where OR-Tools' native code is unsafe in this one.

Next to TensorFlow (gemma imports it through kauldron), CP-SAT's native code
crashes the process: a segmentation fault in the solve, or in garbage
collection after it, since both libraries carry their own protobuf. Planning
must never take the user's process down, so ``local_solve``, the solve
``optimize`` uses, runs the solve in a fresh interpreter when TensorFlow is
loaded or when asked (``OPTIREMAT_SOLVE_OUT_OF_PROCESS=1``; ``=0`` keeps it in
process whatever is loaded). The child is ``python -m
optiremat.solver.out_of_process``: the request as JSON on stdin, the answer as
JSON on stdout. It imports the solver only (pydantic, OR-Tools; never JAX, nor
the user's ``__main__``, which a multiprocessing spawn would re-run), and the
same request gives the same Solution there as here (``solve_seconds`` aside).

The solver's own errors cross back as the same type with the same message
(``InfeasibleBudgetError`` with its ``min_budget_bytes``); a child that dies
(a signal, an exit without an answer) raises ``SolveProcessError`` saying how,
with the end of its stderr, and the parent carries on.
"""

from __future__ import annotations

import base64
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, StrictInt

from optiremat.solver.errors import OptirematError
from optiremat.solver.graph import CostGraph
from optiremat.solver.solution import InfeasibleBudgetError, Solution, SolveOptions
from optiremat.solver.solve import resolve_options, solve

ENV_FLAG = "OPTIREMAT_SOLVE_OUT_OF_PROCESS"
# Modules whose presence makes OR-Tools' native code unsafe in this process.
CONFLICTING_MODULES = ("tensorflow",)
CHILD_MODULE = "optiremat.solver.out_of_process"
_STDERR_TAIL = 2000  # characters of a dead child's stderr its error quotes


class SolveProcessError(OptirematError, RuntimeError):
    """The solver's child process died or answered something that is not an answer."""


class ChildRequest(BaseModel):
    graph: CostGraph
    budget_bytes: StrictInt
    options: SolveOptions
    groups: list[StrictInt] | None = None


class ChildError(BaseModel):
    type: str  # module.qualname of the exception the solve raised
    message: str
    budget_bytes: int | None = None  # InfeasibleBudgetError's fields
    min_budget_bytes: int | None = None
    pickled: str | None = None  # base64 pickle of any other error that round-trips


class ChildReply(BaseModel):
    solution: Solution | None = None
    error: ChildError | None = None


def out_of_process() -> bool:
    """Whether a local solve runs in a child: ``OPTIREMAT_SOLVE_OUT_OF_PROCESS`` when
    set (1/true/yes/on or 0/false/no/off), else whether a conflicting module is loaded."""
    flag = os.environ.get(ENV_FLAG, "").strip().lower()
    if flag in ("1", "true", "yes", "on"):
        return True
    if flag in ("0", "false", "no", "off"):
        return False
    if flag:
        raise ValueError(f"{ENV_FLAG}={flag!r}: set it to 1 (solve in a child process) or "
                         "0 (solve in this one), or unset it (a child only next to "
                         f"{', '.join(CONFLICTING_MODULES)})")
    return any(name in sys.modules for name in CONFLICTING_MODULES)


def local_solve(graph: CostGraph, budget_bytes: int, options: SolveOptions | None = None,
                **overrides: Any) -> Solution:
    """``solver.solve.solve``, in a child process where ``out_of_process()`` says so."""
    if out_of_process():
        return solve_in_child(graph, budget_bytes, options, **overrides)
    return solve(graph, budget_bytes, options, **overrides)


def solve_in_child(graph: CostGraph, budget_bytes: int, options: SolveOptions | None = None,
                   *, groups: Sequence[int] | None = None,
                   command: Sequence[str] | None = None, **overrides: Any) -> Solution:
    """``solve(graph, budget_bytes, options, groups=groups, **overrides)`` run by a child
    Python (``command``, by default this interpreter running this module)."""
    request = ChildRequest(graph=graph, budget_bytes=budget_bytes,
                           options=resolve_options(options, overrides),
                           groups=list(groups) if groups is not None else None)
    argv = list(command) if command is not None else [sys.executable, "-m", CHILD_MODULE]
    # The child imports what this process imports: its path, ahead of any PYTHONPATH.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop(ENV_FLAG, None)
    run = subprocess.run(argv, input=request.model_dump_json().encode(), capture_output=True,
                         env=env, check=False)
    reply = _reply_of(run)
    if reply.error is not None:
        raise _error_of(reply.error)
    assert reply.solution is not None
    return reply.solution


def _reply_of(run: subprocess.CompletedProcess[bytes]) -> ChildReply:
    if run.returncode == 0:
        try:
            reply = ChildReply.model_validate_json(run.stdout)
        except ValueError:
            reply = ChildReply()
        if (reply.solution is None) != (reply.error is None):
            return reply
    how = (f"was killed by {signal.Signals(-run.returncode).name}" if run.returncode < 0
           and -run.returncode in signal.valid_signals() else f"exited {run.returncode}")
    stderr = run.stderr.decode(errors="replace").strip()[-_STDERR_TAIL:]
    raise SolveProcessError(
        f"the solver's child process {how} without an answer; this process is unharmed. "
        f"Plan through a server (optiremat.RematClient) to keep OR-Tools out of this "
        f"environment altogether." + (f" Its stderr ends:\n{stderr}" if stderr else ""))


def _error_of(error: ChildError) -> Exception:
    if error.min_budget_bytes is not None and error.budget_bytes is not None:
        return InfeasibleBudgetError(error.budget_bytes, error.min_budget_bytes)
    if error.pickled is not None:
        found = pickle.loads(base64.b64decode(error.pickled))  # from our own child
        if isinstance(found, Exception):
            return found
    return SolveProcessError(f"the solve raised {error.type}: {error.message}")


def _child_error(exc: Exception) -> ChildError:
    kind = type(exc)
    error = ChildError(type=f"{kind.__module__}.{kind.__qualname__}", message=str(exc))
    if isinstance(exc, InfeasibleBudgetError):
        return error.model_copy(update={"budget_bytes": exc.budget_bytes,
                                        "min_budget_bytes": exc.min_budget_bytes})
    try:
        pickled = pickle.dumps(exc)
        back = pickle.loads(pickled)  # an error whose constructor pickle cannot call
    except Exception:  # any failure to round-trip: send the type and message
        return error
    if type(back) is kind and str(back) == str(exc):
        return error.model_copy(update={"pickled": base64.b64encode(pickled).decode()})
    return error


def main() -> None:
    """The child: one request on stdin, one ``ChildReply`` on stdout. Anything else
    written to the stdout descriptor (native code's logs) goes to stderr instead."""
    reply_to = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    request = ChildRequest.model_validate_json(sys.stdin.buffer.read())
    try:
        reply = ChildReply(solution=solve(request.graph, request.budget_bytes, request.options,
                                          groups=request.groups))
    except Exception as exc:  # every error goes back to the parent
        reply = ChildReply(error=_child_error(exc))
    reply_to.write(reply.model_dump_json())
    reply_to.flush()


if __name__ == "__main__":
    main()
