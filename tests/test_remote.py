"""RematClient against a real ``optiremat serve`` on loopback: the remote Plan is the
local Plan, also from a client without OR-Tools, transient failures are retried, the
server's errors surface intact, and the job progress bar shows on a terminal only."""

from __future__ import annotations

import json
import logging
import os
import pty
import select
import subprocess
import sys
import textwrap
import time

import jax
import pytest

import optiremat
from optiremat.client.errors import NotFound, ProblemError, RemoteInfeasibleBudget
from optiremat.client.frontier import sweep
from optiremat.client.peak.placement import Placement
from optiremat.client.peak.step_graph import step_extraction
from optiremat.client.remote import RematClient
from optiremat.client.step import Step, lowered_peak
from optiremat.solver.offload import OffloadOptions
from optiremat.solver.solution import InfeasibleBudgetError
from optiremat.solver.solve import max_useful_budget, min_feasible_budget
from tests.flaky_proxy import FlakyProxy
from tests.models import CORPUS
from tests.peak_models import CORPUS as PEAK_CORPUS
from tests.peak_models import mlp, residual_stack
from tests.service_harness import REPO, Server

# Among the suite's longest: handed out first (tests/conftest.py).
pytestmark = pytest.mark.slow

# Under the server's cap on synchronous solves, so both sides solve the same request.
# These plans are residual plans of the classic corpus; test_peak_plans_travel covers peaks.
OPTIONS = {"time_limit_s": 20.0, "memory": "residuals"}


def midpoint(fun, args) -> int:
    graph = optiremat.extract_graph(fun, *args)
    return (min_feasible_budget(graph) + max_useful_budget(graph)) // 2


@pytest.mark.parametrize("name", ["transformer_block", "cond"])
def test_remote_plan_equals_local_plan_and_jax_saves_what_it_predicts(
        remote: RematClient, name: str) -> None:
    fun, args = CORPUS[name]
    budget = midpoint(fun, args)
    local = optiremat.optimize(fun, *args, budget=budget, **OPTIONS)
    plan = remote.optimize(fun, *args, budget=budget, **OPTIONS)

    assert type(plan) is type(local)
    assert plan.graph.content_hash == local.graph.content_hash
    assert plan.solution.fingerprint() == local.solution.fingerprint()
    assert plan.key_aliases == local.key_aliases
    assert plan.policy == local.policy
    check = plan.verify(fun, *args)
    assert check.measured_bytes == plan.residual_bytes == local.residual_bytes
    assert check.exact and check.within_budget


def test_remote_untied_plan_solves_its_names_form_on_the_server(
        remote: RematClient, server: Server) -> None:
    fun, args = CORPUS["mlp"]
    local = optiremat.optimize(fun, *args, budget=9_000, tie=False, **OPTIONS)
    plan = remote.optimize(fun, *args, budget=9_000, tie=False, **OPTIONS)
    assert plan.names.names == local.names.names
    assert plan.names.solution.fingerprint() == local.names.solution.fingerprint()
    assert plan.verify().exact


def test_an_infeasible_budget_raises_like_the_local_path_with_the_servers_message(
        remote: RematClient) -> None:
    fun, args = CORPUS["mlp"]
    floor = min_feasible_budget(optiremat.extract_graph(fun, *args))
    with pytest.raises(InfeasibleBudgetError) as caught:
        remote.optimize(fun, *args, budget=floor - 1, memory="residuals")
    err = caught.value
    assert isinstance(err, RemoteInfeasibleBudget) and isinstance(err, ProblemError)
    assert err.status == 422 and err.type == "urn:optiremat:problem:infeasible-budget"
    assert err.min_budget_bytes == floor and err.budget_bytes == floor - 1
    assert err.detail == (f"no plan keeps residuals within {floor - 1} bytes; the smallest "
                          f"feasible budget for this graph is {floor} bytes")
    assert err.detail in str(err)


def test_other_errors_carry_the_problem_detail(remote: RematClient) -> None:
    with pytest.raises(NotFound) as caught:
        remote.job("no-such-job")
    assert caught.value.problem["status"] == 404
    assert "no job 'no-such-job'" in caught.value.detail


def test_refused_connections_are_retried_until_the_server_listens(
        server: Server, caplog: pytest.LogCaptureFixture) -> None:
    proxy = FlakyProxy(server.port)

    class ListenAfterTwoRefusals(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "ConnectError" in message and "retry 2 of" in message:
                proxy.listen()

    handler = ListenAfterTwoRefusals()
    logging.getLogger("optiremat.client").addHandler(handler)
    graph = _mlp_graph()
    try:
        with caplog.at_level(logging.WARNING, "optiremat.client"), \
                RematClient(proxy.url, backoff_s=0.01) as flaky:
            solution = flaky.solve(graph, 10**9)
    finally:
        logging.getLogger("optiremat.client").removeHandler(handler)
        proxy.close()
    refusals = [r for r in caplog.records if "ConnectError" in r.getMessage()]
    assert len(refusals) == 2
    assert solution.recompute_flops == 0  # every budget above saving everything


def test_503_is_retried_and_uploads_are_gzip(server: Server) -> None:
    proxy = FlakyProxy(server.port, unavailable=2)
    proxy.listen()
    graph = _mlp_graph()
    try:
        with RematClient(proxy.url, backoff_s=0.01) as flaky:
            solution = flaky.solve(graph, 10**9)
    finally:
        proxy.close()
    assert solution.graph_hash == graph.content_hash
    (request,) = proxy.requests
    head, _, body = request.partition(b"\r\n\r\n")
    assert b"content-encoding: gzip" in head.lower()
    assert not body or body.startswith(b"\x1f\x8b")  # gzip's magic, if it came along


def test_a_rate_limit_is_waited_out(server: Server) -> None:
    proxy = FlakyProxy(server.port, unavailable=2, refusal=b"429 Too Many Requests")
    proxy.listen()
    try:
        with RematClient(proxy.url, backoff_s=0.01) as limited:
            solution = limited.solve(_mlp_graph(), 10**9)
    finally:
        proxy.close()
    assert solution.status == "optimal" and len(proxy.requests) == 1


def test_a_server_that_never_answers_fails_after_the_retries() -> None:
    proxy = FlakyProxy(1)  # never listens
    try:
        with RematClient(proxy.url, retries=1, backoff_s=0.01) as dead, \
                pytest.raises(optiremat.ConnectionFailed, match="ConnectError"):
            dead.solve(_mlp_graph(), 10**9)
    finally:
        proxy.close()


def test_jobs_submit_wait_and_frontier_match_the_local_answers(remote: RematClient) -> None:
    fun, args = _mlp()
    graph = optiremat.extract_graph(fun, *args)
    budget = midpoint(fun, args)
    job = remote.submit(graph, budget, **OPTIONS)
    assert job.graph_hash == graph.content_hash
    solved = remote.wait(job, progress=False)
    assert solved.fingerprint() == optiremat.optimize(fun, *args, budget=budget,
                                                   **OPTIONS).solution.fingerprint()
    assert remote.job(job.id).status == "succeeded"
    as_job = remote.optimize(fun, *args, budget=budget, job=True, progress=False, **OPTIONS)
    assert as_job.solution.fingerprint() == solved.fingerprint()

    floor = min_feasible_budget(graph)
    with pytest.raises(InfeasibleBudgetError, match=f"is {floor} bytes") as caught:
        remote.wait(remote.submit(graph, floor - 1, **OPTIONS), progress=False)
    assert caught.value.min_budget_bytes == floor

    here = sweep(graph, count=4, **OPTIONS)
    there = remote.frontier(graph, count=4, **OPTIONS)
    assert there.points == here.points
    assert there.min_feasible_budget == here.min_feasible_budget


def test_a_frontier_over_every_lever_is_the_same_remotely(remote: RematClient) -> None:
    fun, args = residual_stack(layers=16, d=64, batch=128)
    graph = step_extraction(fun, args, Step.of(0), name_inputs=True).graph
    link = OffloadOptions(host_bandwidth=10**12)
    here = sweep(graph, count=4, offload=link)
    there = remote.frontier(graph, count=4, offload=link)
    # The server's range counts offload too: its smallest budget is the offload plan's.
    assert there.min_feasible_budget == here.min_feasible_budget
    assert here.min_feasible_budget == min_feasible_budget(graph, offload=link)
    assert there.points == here.points and there.step_seconds == here.step_seconds
    assert all(p.estimated_seconds is not None for p in there.plans)


def test_auto_budget_works_remotely_with_device_memory(remote: RematClient) -> None:
    fun, args = _mlp()
    plan = remote.optimize(fun, *args, budget="auto", device_memory="40KiB", argnums=(1, 2, 3),
                           **OPTIONS)
    expected = optiremat.memory_budget(fun, *args, device_memory="40KiB", argnums=(1, 2, 3))
    assert plan.budget_bytes == expected.residual_budget
    assert plan.verify(fun, *args).within_budget


def test_peak_plans_travel_and_come_back_the_same(remote: RematClient) -> None:
    """The step's memory travels in the graph: the server plans the peak as we do."""
    fun, args = PEAK_CORPUS[0].build()
    budget = "80MiB"
    local = optiremat.optimize(fun, *args, budget=budget, time_limit_s=20.0)
    plan = remote.optimize(fun, *args, budget=budget, time_limit_s=20.0)
    assert plan.memory == "peak" and plan.peak_bytes == local.peak_bytes
    assert plan.solution.fingerprint() == local.solution.fingerprint()
    # The stack's layers are planned apart at this budget, every solve on the server.
    assert plan.layer_groups and plan.layer_groups == local.layer_groups
    assert plan.verify(fun, *args).exact


def test_priced_plans_are_priced_the_same_through_the_server(remote: RematClient) -> None:
    """``save_price``'s budgets are solved on the server, each as the local solve is."""
    fun, args = PEAK_CORPUS[0].build()
    local = optiremat.optimize(fun, *args, budget="80MiB", save_price=200, time_limit_s=20.0)
    plan = remote.optimize(fun, *args, budget="80MiB", save_price=200, time_limit_s=20.0)
    assert plan.peak_bytes == local.peak_bytes and plan.budget_bytes == local.budget_bytes
    assert plan.solution.fingerprint() == local.solution.fingerprint()
    assert plan.explain().endswith(local.price_note) and local.price_note


# A client process where OR-Tools cannot be imported: it plans a peak budget through the
# server and prints what it planned, and what a local solve says.
NO_ORTOOLS_SCRIPT = textwrap.dedent("""
    import json
    import sys

    class NoORTools:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == "ortools":  # as Python says a module is absent
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoORTools())
    try:
        import ortools
    except ImportError:
        pass
    else:
        raise SystemExit("ortools imported despite the finder")
    import optiremat
    from tests.peak_models import mlp

    fun, args = mlp(**json.loads(sys.argv[3]))
    with optiremat.RematClient(sys.argv[1]) as remote:
        plan = remote.optimize(fun, *args, budget=int(sys.argv[2]), time_limit_s=20.0)
    try:  # a local solve says what it lacks
        optiremat.solve(plan.graph, int(sys.argv[2]))
        local = "solved locally"
    except ImportError as err:
        local = str(err)
    print(json.dumps({"local": local, "fingerprint": plan.solution.fingerprint(),
                      "saved_keys": sorted(plan.saved_keys),
                      "recompute_flops": plan.recompute_flops, "peak_bytes": plan.peak_bytes,
                      "ortools": sorted(m for m in sys.modules if m.startswith("ortools"))}))
""")


SMALL_MLP = {"layers": 4, "d": 128, "hidden": 512, "batch": 64}


def test_a_client_without_ortools_plans_a_peak_budget_through_the_server(
        server: Server) -> None:
    """At dots_saveable's measured peak the answer is that built-in, priced by the
    cost model after the solves (``client.peak.refine``): the client runs no search."""
    fun, args = mlp(**SMALL_MLP)
    step = Step.of(0)
    extracted = step_extraction(fun, args, step)
    placement = Placement(extracted.regions, extracted.differentiated, step)
    applied = placement.apply(fun, jax.checkpoint_policies.dots_saveable)
    budget = lowered_peak(step.function(applied).lower(*args))
    local = optiremat.optimize(fun, *args, budget=budget, time_limit_s=20.0)
    assert local.solution.status == "feasible" and local.solution.gap == 1.0  # the built-in

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", NO_ORTOOLS_SCRIPT, server.url, str(budget),
                           json.dumps(SMALL_MLP)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    remote = json.loads(done.stdout.splitlines()[-1])
    assert remote["ortools"] == []
    assert "a local solve needs OR-Tools" in remote["local"]  # and says how to do without
    assert remote["saved_keys"] == sorted(local.saved_keys)
    assert (remote["recompute_flops"], remote["peak_bytes"]) == (local.recompute_flops,
                                                                 local.peak_bytes)
    assert remote["fingerprint"] == local.solution.fingerprint()


WAIT_SCRIPT = textwrap.dedent("""
    import sys
    from optiremat.client.remote import RematClient
    from optiremat.solver.solve import max_useful_budget, min_feasible_budget
    from tests.service_harness import tangled
    # A solve that finds plans at once but cannot prove one optimal in its time limit.
    graph = tangled(20, 8, seed=int(sys.argv[2]), name="progress")
    low, high = min_feasible_budget(graph, tie=False), max_useful_budget(graph)
    with RematClient(sys.argv[1]) as remote:
        job = remote.submit(graph, low + (high - low) // 10, tie=False, time_limit_s=1.5)
        solution = remote.wait(job)
    print("done", solution.status)
""")


def test_progress_bar_shows_on_a_terminal_and_not_in_a_pipe(server: Server) -> None:
    command = [sys.executable, "-c", WAIT_SCRIPT, server.url]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm", "COLUMNS": "120"}

    piped = subprocess.run([*command, "1"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=60, check=True)
    assert piped.stdout.startswith("done")
    assert piped.stderr == ""

    leader, follower = pty.openpty()
    process = subprocess.Popen([*command, "2"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=follower, stdin=subprocess.DEVNULL)
    os.close(follower)
    screen = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            screen += chunk
        elif process.poll() is not None:
            break
    os.close(leader)
    assert process.wait(timeout=30) == 0
    assert process.stdout is not None and process.stdout.read().startswith(b"done")
    text = screen.decode(errors="replace")
    assert "optiremat job" in text
    assert "incumbent" in text and "bound" in text


def _mlp():
    return CORPUS["mlp"]


def _mlp_graph():
    fun, args = CORPUS["mlp"]
    return optiremat.extract_graph(fun, *args)
