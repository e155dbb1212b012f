"""Bad input to the Python API gets a clear error naming what is wrong, before any solve:
a function with no floating-point output, a scan that runs no iteration, a shard_map
inside the step, a scan inside a while loop or a cond branch, a plan file whose
decisions do not fit its graph."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import optiremat
from optiremat.client.planning import plan_for
from optiremat.solver.solution import Decision
from optiremat.solver.solve import solve

X = jnp.ones((8, 8))
WS = jnp.ones((4, 8, 8)) * 0.1


def counting_solve(calls: list[int]):
    """The local solve, counting its calls."""
    def solve_fn(*args, **kwargs):
        calls.append(1)
        return solve(*args, **kwargs)
    return solve_fn


def index_of_largest(ws, x):
    def layer(h, w):
        return jnp.tanh(h @ w), None
    h, _ = lax.scan(layer, x, ws)
    return jnp.argmax(h)  # an int32 scalar: jax.grad refuses it


@pytest.mark.parametrize("memory", ["peak", "residuals"])
def test_a_function_with_an_integer_output_is_a_step_error_before_any_solve(
        memory: str) -> None:
    calls: list[int] = []
    with pytest.raises(optiremat.StepError, match=r"returns int32\[\]: no floating-point "
                                                   "output to differentiate"):
        plan_for(index_of_largest, (WS, X), "1MiB", True, {"memory": memory},
                 counting_solve(calls))
    assert calls == []
    with pytest.raises(optiremat.StepError):
        optiremat.extract_step(index_of_largest, WS, X)
    with pytest.raises(optiremat.StepError):
        optiremat.extract_graph(index_of_largest, WS, X)


def test_integer_outputs_next_to_a_float_one_are_planned() -> None:
    def loss_and_index(ws, x):  # the step differentiates the sum of its float outputs
        return jnp.sum(jnp.tanh(x @ ws[0])), jnp.argmax(x)
    plan = optiremat.optimize(loss_and_index, WS, X, budget="1MiB")
    assert plan.status == "optimal"


def empty_stack(ws, x):
    def layer(h, w):
        return jnp.tanh(h @ w), None
    h, _ = lax.scan(layer, x, ws)  # the line the error names
    return jnp.sum(h)


@pytest.mark.parametrize("memory", ["peak", "residuals"])
def test_a_scan_of_length_zero_is_named_not_a_schema_error(memory: str) -> None:
    with pytest.raises(optiremat.ExtractionError) as info:
        optiremat.optimize(empty_stack, jnp.ones((0, 8, 8)), X, budget="1MiB", memory=memory)
    message = str(info.value)
    assert f"lax.scan at {__file__}:" in message and "(empty_stack) has length 0" in message
    assert "pydantic" not in message and "placement.py" not in message


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    def loss(x):
        return jnp.sum(jnp.sin(jnp.tanh(x)))
    plan = optiremat.optimize(loss, X, budget=10**6, memory="residuals")
    return optiremat.PlanFile.of(plan).write(tmp_path_factory.mktemp("plans") / "plan.json")


def test_a_plan_whose_decisions_do_not_fit_its_graph_is_refused(
        plan_path: Path, tmp_path: Path) -> None:
    plan = optiremat.load_plan(plan_path)
    nodes = plan.graph.num_nodes
    short = plan.solution.model_copy(
        update={"node_decisions": plan.solution.node_decisions[:-1]})
    edited = tmp_path / "edited.json"
    edited.write_text(plan.model_copy(update={"solution": short}).model_dump_json())
    with pytest.raises(optiremat.PlanFileError) as info:
        optiremat.load_plan(edited)
    message = str(info.value)
    assert message.startswith(f"{edited} is not a valid plan file: ")
    assert f"node_decisions has {nodes - 1} entries but the graph has {nodes} nodes" in message
    assert "\n" not in message and "pydantic.dev" not in message

    offloads = plan.solution.model_copy(
        update={"node_decisions": [Decision.OFFLOAD] * nodes})
    edited.write_text(plan.model_copy(update={"solution": offloads}).model_dump_json())
    with pytest.raises(optiremat.PlanFileError, match="options have no offload"):
        optiremat.load_plan(edited)


def test_a_graph_or_junk_given_as_a_plan_is_named(plan_path: Path, tmp_path: Path) -> None:
    graph = tmp_path / "loss.graph.json"
    graph.write_text(optiremat.load_plan(plan_path).graph.model_dump_json())
    with pytest.raises(optiremat.PlanFileError, match="is a cost graph, not a plan"):
        optiremat.load_plan(graph)
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    with pytest.raises(optiremat.PlanFileError, match="is not a valid plan file: Invalid JSON"):
        optiremat.load_plan(junk)


def stack_under_shard_map(ws, x):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    spec = jax.sharding.PartitionSpec("data")

    def per_shard(x):
        return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    return jnp.sum(jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec)(x))


@pytest.mark.parametrize("memory", ["peak", "residuals"])
def test_a_shard_map_inside_the_step_is_refused_with_its_place_before_any_solve(
        memory: str) -> None:
    """Its body is not walked yet: planned as one elementwise equation, the layers inside
    it were missing from the graph and the plan was empty, said to be optimal."""
    # optimize takes no solve_fn: the error is raised at extraction, before any solve.
    with pytest.raises(optiremat.ExtractionError,
                       match=r"shard_map at .*test_user_errors\.py.* per-shard function"):
        optiremat.optimize(stack_under_shard_map, WS, X, budget="1MiB", memory=memory)


def _layers(h: jax.Array, ws: jax.Array) -> jax.Array:
    return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws)[0]


def test_a_scan_inside_a_while_loop_is_refused_naming_the_loop() -> None:
    """The loop runs its body a data-dependent number of times: the scan's layers have
    no static place (a cond's are refused the same way, ``test_peak_plans``)."""
    def fun(ws, x):
        def body(carry):
            return _layers(carry[0], ws), carry[1] + 1
        return jnp.sum(lax.while_loop(lambda c: c[1] < 2, body, (x, 0))[0])
    with pytest.raises(optiremat.PlacementError, match="sits inside a while_loop"):
        optiremat.optimize(fun, WS, X, budget="1MiB")


def test_a_scan_inside_a_cond_branch_is_refused_but_a_call_there_is_walked() -> None:
    """A scan's residuals inside a branch could not be predicted exactly; a call's body
    is walked where it stands, as anywhere else."""
    def scan_in_branch(ws, x, flag):
        return jnp.sum(lax.cond(flag, lambda h: _layers(h, ws), lambda h: h, x))
    with pytest.raises(optiremat.ExtractionError, match="scan inside a cond branch"):
        optiremat.extract_graph(scan_in_branch, WS, X, True)

    def call_in_branch(w, x, flag):
        return jnp.sum(lax.cond(flag, jax.jit(lambda h: jnp.tanh(h @ w)), lambda h: h, x))
    graph = optiremat.extract_graph(call_in_branch, WS[0], X, True)
    assert "cond_branches" in graph.node_primitive


@pytest.mark.parametrize(("option", "words"), [
    ({"time_limit_s": "fast"}, ["invalid option time_limit_s:", "(got 'fast')"]),
    ({"speed": 1}, ["invalid option speed:", "not permitted"]),
])
def test_a_bad_solver_option_is_one_line_naming_it_before_any_tracing(
        option: dict, words: list[str]) -> None:
    calls: list[int] = []
    with pytest.raises(ValueError) as raised:
        plan_for(lambda x: jnp.sum(jnp.tanh(x)), (jnp.ones(8),), 10**6, True,
                 {"memory": "residuals", **option}, counting_solve(calls))
    message = str(raised.value)
    assert "\n" not in message and "pydantic" not in message, message
    for word in words:
        assert word in message
    assert calls == []
