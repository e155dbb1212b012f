"""One root for optiremat's errors, each error still the builtin it always was, and the
remote ones carrying the request and the response, as httpx's errors do; against a
real ``optiremat serve`` on loopback."""

from __future__ import annotations

import inspect
from importlib import import_module

import httpx
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
from optiremat.client.frameworks import ExportError
from optiremat.client.remote import RematClient
from optiremat.client.target import TargetError
from optiremat.solver.graph import CostGraph
from optiremat.solver.out_of_process import SolveProcessError
from optiremat.solver.solution import InfeasibleBudgetError
from optiremat.solver.solve import min_feasible_budget
from optiremat.solver.step import StepMemory
from optiremat.solver.validation import GraphError, OutOfRangeError
from tests.service_harness import Server, chain, free_port
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
    SolveProcessError: RuntimeError,
    optiremat.BudgetError: ValueError,
    optiremat.PlacementError: ValueError,
    optiremat.ShardingError: ValueError,
    RemoteError: Exception,
    ConnectionFailed: Exception,
    ProblemError: Exception,
    RequestRejected: Exception,
    Unauthorized: Exception,
    NotFound: Exception,
    ServerError: Exception,
    RemoteInfeasibleBudget: ValueError,  # as an InfeasibleBudgetError
    JobCancelled: Exception,
    ExportError: ValueError,
}


@pytest.mark.parametrize("error", BUILTIN_OF, ids=lambda e: e.__name__)
def test_each_public_error_is_an_optiremat_error_and_still_its_builtin(
        error: type[Exception]) -> None:
    assert issubclass(error, optiremat.OptirematError)
    assert issubclass(error, BUILTIN_OF[error])


def test_every_error_the_solver_and_the_client_define_is_listed() -> None:
    defined = {value for name in module_paths()
               if name.startswith(("optiremat.solver.", "optiremat.client."))
               for _, value in inspect.getmembers(import_module(name), inspect.isclass)
               if issubclass(value, BaseException) and not issubclass(value, Warning)
               and value.__module__ == name}
    assert defined == set(BUILTIN_OF) | {optiremat.OptirematError}
    assert issubclass(optiremat.ScheduleWarning, UserWarning)  # a warning, not an error


def _peak_graph() -> CostGraph:
    """A chain that carries its training step: its budget is a peak budget."""
    data = chain(4, name="peak").model_dump(mode="json")
    data.update(step=StepMemory(argument_bytes=10, output_bytes=5).model_dump(mode="json"),
                node_region=[-1] * 4, value_region=[-1] * 5)
    return CostGraph.model_validate(data)


def test_a_problem_carries_the_request_and_the_response(server: Server,
                                                        remote: RematClient) -> None:
    with pytest.raises(NotFound) as caught:
        remote.job("no-such-job")
    err = caught.value
    assert isinstance(err.request, httpx.Request) and isinstance(err.response, httpx.Response)
    assert err.request.method == "GET"
    assert str(err.request.url) == f"{server.url}/v1/jobs/no-such-job"
    assert err.response.status_code == err.status == 404
    assert err.response.json() == err.problem
    assert err.response.request is err.request


@pytest.mark.parametrize("memory, counts", [
    ("residuals", "keeps residuals within"),
    ("peak", "keeps the training step's predicted peak within"),
])
def test_an_infeasible_budget_carries_the_exchange_and_says_what_it_counts(
        server: Server, remote: RematClient, memory: str, counts: str) -> None:
    graph = _peak_graph()
    floor = min_feasible_budget(graph, memory=memory)
    with pytest.raises(RemoteInfeasibleBudget) as caught:
        remote.solve(graph, floor - 1, memory=memory)
    err = caught.value
    assert err.detail == (f"no plan {counts} {floor - 1} bytes; the smallest feasible "
                          f"budget for this graph is {floor} bytes")
    assert err.min_budget_bytes == floor
    assert err.request is not None and err.response is not None
    assert (err.request.method, str(err.request.url)) == ("POST", f"{server.url}/v1/solve")
    assert err.response.status_code == 422


def test_a_failed_job_carries_the_poll_that_reported_it(server: Server,
                                                        remote: RematClient) -> None:
    graph = _peak_graph()
    floor = min_feasible_budget(graph)
    job = remote.submit(graph, floor - 1)
    with pytest.raises(RemoteInfeasibleBudget) as caught:
        remote.wait(job.id, timeout=60, progress=False)
    err = caught.value
    assert "keeps the training step's predicted peak within" in err.detail
    assert err.request is not None and err.response is not None
    assert str(err.request.url) == f"{server.url}/v1/jobs/{job.id}"
    assert err.response.status_code == 200  # the job was found; it is the job that failed
    reported = err.response.json()
    assert reported["id"] == job.id and reported["error"]["detail"] == err.detail
    # A Job given as such was not fetched here: there is no exchange to carry.
    finished = remote.job(job.id)
    with pytest.raises(RemoteInfeasibleBudget) as again:
        remote.wait(finished, progress=False)
    assert again.value.request is None and again.value.response is None


def test_a_failed_connection_carries_the_request_and_no_response() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with RematClient(url, retries=0) as unreachable, \
            pytest.raises(ConnectionFailed) as caught:
        unreachable.job("any")
    err = caught.value
    assert err.request is not None and str(err.request.url) == f"{url}/v1/jobs/any"
    assert err.response is None
    assert isinstance(err.__cause__, httpx.ConnectError)
