"""``RematClient``: the optiremat service over HTTP, with the same Plans as the local path.

Extraction always runs here, next to JAX; only the cost graph travels
(gzip-compressed) and only the Solution comes back. ``RematClient.optimize``
builds its Plan from the local extraction and the remote solution with the
same code as ``optiremat.optimize``, so policy, predictions and ``verify`` agree.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from optiremat.client.errors import ConnectionFailed, JobCancelled, problem_error, response_error
from optiremat.client.progress import job_progress
from optiremat.client.transport import RetryTransport
from optiremat.solver.graph import CostGraph
from optiremat.solver.solution import Solution, SolveOptions
from optiremat.solver.solve import resolve_options
from optiremat.solver.units import parse_bytes
from optiremat.solver.wire import DEFAULT_FRONTIER_POINTS, Frontier, Job

GZIP_LEVEL = 6  # ~4x smaller graphs for a few ms per MB


class RematClient:
    """A client for one optiremat server.

    ``retries`` extra attempts are made on connection failures and 502/503/504,
    with exponential backoff from ``backoff_s``. ``timeout`` (seconds) bounds
    each HTTP exchange; a synchronous solve holds one open for the whole solve.
    Use as a context manager, or call ``close()``.
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = 120.0,
                 retries: int = 4, backoff_s: float = 0.25,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Accept": "application/json", "User-Agent": "optiremat-client"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout,
            transport=RetryTransport(transport, retries=retries, backoff_s=backoff_s),
        )

    def __enter__(self) -> RematClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # ---- HTTP -------------------------------------------------------------

    def _request(self, method: str, path: str, body: bytes | None = None,
                 budget_bytes: int | None = None) -> httpx.Response:
        headers = {}
        if body is not None:
            body = gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0)
            headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        request = self._http.build_request(method, path, content=body, headers=headers)
        try:
            response = self._http.send(request)
        except httpx.TransportError as exc:
            raise ConnectionFailed(
                f"{method} {self.base_url}{path} failed: {type(exc).__name__}: {exc}",
                request=request) from exc
        if response.is_error:
            raise response_error(response, budget_bytes)
        return response

    @staticmethod
    def _solve_body(graph: CostGraph, budget_bytes: int, options: SolveOptions) -> bytes:
        return _with_graph(graph, {"budget_bytes": budget_bytes,
                                   "options": options.model_dump(mode="json")})

    # ---- solving ------------------------------------------------------------

    def solve(self, graph: CostGraph, budget: int | str, options: SolveOptions | None = None,
              **overrides: Any) -> Solution:
        """``POST /v1/solve``: the plan for ``graph`` within ``budget`` bytes.

        ``options``, with ``overrides`` (SolveOptions fields) on top, as
        ``solver.solve.solve`` takes them (it is a ``solver.solve.Solver``); the server
        caps ``time_limit_s`` (use ``submit``/``wait`` for long solves). An infeasible budget raises
        ``InfeasibleBudgetError`` naming the smallest feasible one, as locally.
        """
        budget_bytes = parse_bytes(budget)
        body = self._solve_body(graph, budget_bytes, resolve_options(options, overrides))
        response = self._request("POST", "/v1/solve", body, budget_bytes)
        return Solution.model_validate_json(response.content)

    def submit(self, graph: CostGraph, budget: int | str, options: SolveOptions | None = None,
               **overrides: Any) -> Job:
        """``POST /v1/jobs``: start a background solve (or find the identical one)."""
        budget_bytes = parse_bytes(budget)
        body = self._solve_body(graph, budget_bytes, resolve_options(options, overrides))
        return Job.model_validate_json(self._request("POST", "/v1/jobs", body).content)

    def job(self, job: Job | str) -> Job:
        """The job's current state."""
        return self._job(job)[0]

    def _job(self, job: Job | str) -> tuple[Job, httpx.Response]:
        job_id = job.id if isinstance(job, Job) else job
        response = self._request("GET", f"/v1/jobs/{job_id}")
        return Job.model_validate_json(response.content), response

    def cancel(self, job: Job | str) -> Job:
        """Stop the job; it keeps the best plan found so far as its solution."""
        job_id = job.id if isinstance(job, Job) else job
        return Job.model_validate_json(self._request("DELETE", f"/v1/jobs/{job_id}").content)

    def wait(self, job: Job | str, *, timeout: float | None = None,
             progress: bool | None = None, poll_s: float = 0.05,
             max_poll_s: float = 1.0) -> Solution:
        """Poll until the job finishes and return its solution.

        A progress bar (elapsed time, incumbent, bound) is drawn on stderr when
        ``progress`` is true, or by default when stderr is a terminal. A failed
        job raises its problem (an infeasible budget as ``InfeasibleBudgetError``);
        a job cancelled with a plan returns that plan (status ``feasible``).
        On ``timeout`` the job keeps running and ``TimeoutError`` is raised.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        # The response that reported the job last: a failure raised below carries it.
        current, response = (job, None) if isinstance(job, Job) else self._job(job)
        with job_progress(progress) as show:
            while True:
                show(current)
                if current.finished:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"job {current.id} still {current.status} after "
                                       f"{timeout} s; it keeps running on the server")
                time.sleep(poll_s)
                poll_s = min(max_poll_s, poll_s * 1.5)
                current, response = self._job(current.id)
        if current.solution is not None:
            return current.solution
        if current.status == "cancelled":
            raise JobCancelled(f"job {current.id} was cancelled before it found a plan",
                               response=response)
        if current.error is None:
            raise problem_error(500, {"title": "Job failed", "detail": f"job {current.id} failed"},
                                current.budget_bytes, response=response)
        problem = current.error.model_dump(mode="json", exclude_none=True)
        raise problem_error(current.error.status, problem, current.budget_bytes,
                            response=response)

    def frontier(self, graph: CostGraph, budgets: list[int] | None = None,
                 count: int | None = None, **options: Any) -> Frontier:
        """``POST /v1/frontier``: one solve per budget; ``count`` spaced budgets by default."""
        if budgets is None and count is None:
            count = DEFAULT_FRONTIER_POINTS
        fields: dict[str, Any] = {"options": resolve_options(None, options).model_dump(mode="json")}
        fields.update({"budgets": budgets} if budgets is not None else {"count": count})
        body = _with_graph(graph, fields)
        return Frontier.model_validate_json(self._request("POST", "/v1/frontier", body).content)

    # ---- the Plan -------------------------------------------------------------

    def optimize(self, fun: Callable, *args: Any, budget: int | str, tie: bool = True,
                 job: bool = False, progress: bool | None = None, **options: Any):
        """``optiremat.optimize``, solved by the server; returns the same ``Plan``.

        With ``job``, the solve runs as a background job (no time-limit cap of
        the synchronous endpoint, a progress bar on a terminal). ``budget`` may
        be ``"auto"``, with the keywords of ``optiremat.client.budget.memory_budget``.
        """
        from optiremat.client.planning import plan_for

        def remote_solve(graph: CostGraph, budget_bytes: int, options: SolveOptions, /
                         ) -> Solution:
            if job:
                return self.wait(self.submit(graph, budget_bytes, options), progress=progress)
            return self.solve(graph, budget_bytes, options)

        return plan_for(fun, args, budget, tie, options, remote_solve)


def _with_graph(graph: CostGraph, fields: dict[str, Any]) -> bytes:
    """A JSON object of ``fields`` and the graph, spliced in as pydantic serialises it
    (no dict round trip for a graph of 100k nodes)."""
    rest = json.dumps(fields, separators=(",", ":"))
    return b'{"graph":' + graph.model_dump_json().encode() + b"," + rest[1:].encode()
