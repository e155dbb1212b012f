"""Peak plans on a device mesh: the budget is what one device holds.

The plans themselves run on 8 simulated CPU devices in a process of their own
(``tests/mesh_checks.py``: the device count is fixed when JAX starts), on data
parallel, FSDP and 2 x 4 tensor-parallel layouts, each with and without a
``with_sharding_constraint`` in the layer, on the Llama stack and the corpus LM. Bad
input and the propagation rules' per-device shapes are checked here, on this process's
one device.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optiremat
from optiremat.client.extract import trace
from optiremat.client.sharding import SingleDevice, Spec
from optiremat.client.sharding_rules import propagate
from tests.service_harness import REPO

# Among the suite's longest: handed out first (tests/conftest.py).
pytestmark = pytest.mark.slow

# Every mesh with and without a constraint inside the layer, across the Llama stack and
# the LM (``tests/mesh_checks.py``).
LAYOUTS = ["dp", "fsdp_constrained", "tp_constrained", "lm_dp_constrained", "lm_fsdp", "lm_tp"]
MESHES = {"dp": [["data"], [8]], "fsdp": [["data"], [8]], "tp": [["data", "model"], [2, 4]]}
# Predicted per-device peak against XLA's, on every plan.
TOLERANCE = 0.03
# What a plan's recomputation moves between devices, by the graph against XLA's collectives,
# as a share of the step's own collectives. The graph prices the all-reduces and gathers a
# recomputation repeats, and counts a dot's gathered operand as shared with its gradient;
# XLA sometimes gathers it a second time (the unconstrained FSDP LM at its smallest budget:
# one MLP weight per layer, 78,848 B, 3.4% of the step's collectives; docs/design.md).
COLLECTIVES_TOLERANCE = 0.05
SIZES = {"data": 2, "model": 4}  # the tensor-parallel mesh's axes, for propagation alone


@pytest.fixture(scope="module")
def checks() -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.mesh_checks"], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plans_on_a_mesh_predict_and_honour_per_device_budgets(checks: dict,
                                                              layout: str) -> None:
    result = checks[layout]
    assert result["schema_version"] == 3
    assert result["mesh"] == MESHES[layout.removeprefix("lm_").split("_")[0]]
    assert result["low"] < result["no_remat"]
    for plan in result["plans"]:
        assert "refused" not in plan, (layout, plan)  # every budget from the smallest up
        assert plan["measured"] <= plan["budget"], (layout, plan)
        error = (plan["predicted"] - plan["measured"]) / plan["measured"]
        assert abs(error) <= TOLERANCE, (layout, plan, error)
        assert plan["same_gradients"] in (True, None), (layout, plan)
        # What the plan's recomputation moves between devices, against what XLA's
        # collectives move beyond the step without remat (the graph does not see all of
        # it: docs/design.md, Sharded steps, Collectives).
        moved = plan["collectives"] - plan["xla_collectives"]
        assert abs(moved) <= COLLECTIVES_TOLERANCE * result["step_collectives"], (layout, plan)
    assert result["plans"][-1]["same_gradients"] is True  # and output shardings
    if layout in ("dp", "tp_constrained"):
        # 20% of the way up, the 4 layers are planned apart: exact on the mesh, gradients
        # and their shardings equal.
        middle = result["plans"][1]
        assert middle["layer_groups"] and sum(middle["layer_groups"]) == 4, middle
        assert middle["predicted"] == middle["measured"] and middle["same_gradients"] is True
    at_peak = result["plans"][0]
    assert at_peak["budget"] == result["no_remat"] and at_peak["flops"] == 0
    # The smallest budget recomputes: sharded bytes leave remat work to do there.
    assert result["plans"][-1]["flops"] > 0


def test_a_plan_pays_the_link_for_a_gathered_weight_only_where_the_budget_needs_it(
        checks: dict) -> None:
    result = checks["mlp_fsdp_gathered"]
    graph = optiremat.CostGraph.model_validate_json(result["graph"])
    gathers = [b for b, p in zip(graph.node_collective_bytes or [], graph.node_primitive,
                                 strict=True) if p == "sharding_constraint" and b]
    # Each layer's two weights, gathered 8 ways: 7/8 of a whole weight per layer.
    assert len(gathers) == 2 and all(b == 7 * 128 * 256 * 4 // 8 * 4 for b in gathers)
    plans = result["plans"]
    for plan in plans:
        assert plan["measured"] <= plan["budget"], plan
        assert plan["predicted"] == plan["measured"], plan
        # Exactly what XLA's collectives move beyond the step without remat.
        assert plan["collectives"] == plan["xla_collectives"], plan
    # Down from the no-remat peak the plan gathers the weights again rather than hold them
    # gathered, at no FLOPs; only the smallest budget recomputes the layer as well.
    moved = [p["collectives"] for p in plans]
    assert moved == sorted(moved) and moved[-1] == sum(gathers)
    assert plans[0]["flops"] == plans[1]["flops"] == 0 < plans[-1]["flops"]
    assert plans[-1]["same_gradients"] is True


def test_row_parallel_dots_carry_their_all_reduce_in_the_graph(checks: dict) -> None:
    graph = optiremat.CostGraph.model_validate_json(checks["tp_constrained"]["graph"])
    moved = graph.node_collective_bytes or [0] * graph.num_nodes
    reducing = [n for n, b in enumerate(moved)
                if b and graph.node_primitive[n] == "dot_general"]
    # The attention's and the MLP's output projections: their contracted dimension is
    # split on the model axis in both operands. A ring all-reduce over its 4 devices moves
    # 2 * 3/4 of one device's (B/2, T, D) f32 block, each of the 4 layers.
    assert len(reducing) == 2
    assert all(moved[n] == 4 * 2 * 3 * (4 * 32 * 64 * 4) // 4 for n in reducing)


def test_the_service_solves_a_graph_on_a_mesh_as_the_client_does(
        checks: dict, remote: optiremat.RematClient) -> None:
    graph = optiremat.CostGraph.model_validate_json(checks["tp_constrained"]["graph"])
    assert graph.schema_version == 3 and graph.devices == 8
    budget = checks["tp_constrained"]["low"]
    local = optiremat.solve(graph, budget, time_limit_s=20.0)
    answered = remote.solve(graph, budget, time_limit_s=20.0)
    assert answered.fingerprint() == local.fingerprint()
    assert answered.peak_bytes == local.peak_bytes <= budget


def _loss(ws: jax.Array, x: jax.Array) -> jax.Array:
    h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return jnp.sum(h)


def test_arguments_on_one_device_have_the_null_layout() -> None:
    """No argument on a mesh: the layout is ``SingleDevice``, where every value is whole
    and nothing moves, and the graph records no mesh (extraction never asks which
    layout it has)."""
    ws, x = jnp.ones((4, 8, 8)), jnp.ones((2, 8))
    layout = trace(_loss, (ws, x), {}).layout
    assert isinstance(layout, SingleDevice) and not layout.on_mesh
    assert layout.value_bytes(jax.typeof(x), (("data",), ())) == x.nbytes
    graph = optiremat.extract_graph(_loss, ws, x)
    assert graph.mesh is None and not any(graph.node_collective_bytes or ())


def test_a_mesh_larger_than_the_host_is_refused_naming_the_argument() -> None:
    mesh = AbstractMesh((16,), ("data",))
    x = jax.ShapeDtypeStruct((32, 8), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    ws = jax.ShapeDtypeStruct((4, 8, 8), jnp.float32)
    with pytest.raises(optiremat.ShardingError, match=r"argument args\[1\] .*16 devices") as err:
        optiremat.optimize(_loss, ws, x, budget="1MiB")
    assert isinstance(err.value, optiremat.OptirematError)
    assert "xla_force_host_platform_device_count=16" in str(err.value)


@pytest.mark.parametrize("table", [(("model",), ()), (("data",), ()), ((), ())])
def test_an_embedding_gather_is_split_as_its_tokens(table: Spec) -> None:
    """Whole rows for every token the device holds, however the table is split by
    vocabulary rows: XLA's partitioned gather (masked over the table's shard, then
    all-reduced or reduce-scattered) leaves one device a (batch shard, seq, d) block on
    the FSDP and tensor-parallel layouts of ``tests/mesh_models.py``."""
    closed = jax.make_jaxpr(lambda t, i: t[i])(jax.ShapeDtypeStruct((512, 64), jnp.float32),
                                              jax.ShapeDtypeStruct((8, 32), jnp.int32))
    outs, _ = propagate(closed.jaxpr, [table, (("data",), ())], SIZES)
    assert outs == [(("data",), (), ())]


def test_a_gather_keeps_a_whole_sliced_dimensions_split() -> None:
    """A table split by its ``d`` columns gathers each device's columns of every row:
    XLA's compiled gather there is f32[128,1,16] per device on the 2 x 4 mesh, its
    output P('data', None, 'model')."""
    closed = jax.make_jaxpr(lambda t, i: t[i])(jax.ShapeDtypeStruct((512, 64), jnp.float32),
                                              jax.ShapeDtypeStruct((8, 32), jnp.int32))
    outs, _ = propagate(closed.jaxpr, [((), ("model",)), (("data",), ())], SIZES)
    assert outs == [(("data",), (), ("model",))]


def test_a_broadcast_an_elementwise_op_meets_takes_its_split() -> None:
    """The causal mask ``jnp.where`` broadcasts to the scores' shape is split as the
    scores are: XLA's compiled data-parallel step holds it as pred[1,8,32,32] per
    device, not the whole pred[8,8,32,32]."""
    mask = jnp.tril(jnp.ones((32, 32), dtype=bool))
    closed = jax.make_jaxpr(lambda s: jnp.where(mask, s, -1e9))(
        jax.ShapeDtypeStruct((8, 8, 32, 32), jnp.float32))
    _, env = propagate(closed.jaxpr, [(("data",), (), (), ())], SIZES)
    broadcasts = [s for v, s in env.items() if len(getattr(v.aval, "shape", ())) == 4
                  and v not in closed.jaxpr.invars]
    assert broadcasts and all(s == (("data",), (), (), ()) for s in broadcasts), broadcasts
