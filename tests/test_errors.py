"""One root for optiremat's errors, each error still the builtin it always was."""

from __future__ import annotations

import inspect
from importlib import import_module

import pytest

import optiremat
from optiremat.client.errors import (
    ConnectionFailed,
    JobCancelled,
    NotFound,
    ProblemError,
    RemoteError,
    RemoteInfeasibleBudget,
    RequestRejected,
    ServerError,
    Unauthorized,
)
from optiremat.client.extract.state import ExtractionError
from optiremat.client.target import TargetError
from optiremat.solver.solution import InfeasibleBudgetError
from optiremat.solver.validation import GraphError, OutOfRangeError
from tools.typecheck import module_paths

# Each public error and the builtin it subclassed before OptirematError existed.
BUILTIN_OF: dict[type[Exception], type[Exception]] = {
    InfeasibleBudgetError: ValueError,
    GraphError: ValueError,
    OutOfRangeError: ValueError,
    optiremat.StepError: ValueError,
    ExtractionError: ValueError,
    optiremat.PlanFileError: ValueError,
    TargetError: ValueError,
    optiremat.PlanError: RuntimeError,
    optiremat.BudgetError: ValueError,
    optiremat.PlacementError: ValueError,
    RemoteError: Exception,
    ConnectionFailed: Exception,
    ProblemError: Exception,
    RequestRejected: Exception,
    Unauthorized: Exception,
    NotFound: Exception,
    ServerError: Exception,
    RemoteInfeasibleBudget: ValueError,  # as an InfeasibleBudgetError
    JobCancelled: Exception,
}


@pytest.mark.parametrize("error", BUILTIN_OF, ids=lambda e: e.__name__)
def test_each_public_error_is_an_optiremat_error_and_still_its_builtin(
        error: type[Exception]) -> None:
    assert issubclass(error, optiremat.OptirematError)
    assert issubclass(error, BUILTIN_OF[error])


def test_every_error_the_solver_and_the_client_define_is_listed() -> None:
    defined = {value for name, path in module_paths().items()
               if name.startswith(("optiremat.solver", "optiremat.client"))
               for _, value in inspect.getmembers(import_module(name), inspect.isclass)
               if issubclass(value, BaseException) and value.__module__ == name}
    assert defined == set(BUILTIN_OF) | {optiremat.OptirematError}
