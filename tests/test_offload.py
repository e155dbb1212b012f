"""Offload as a third choice: real CP-SAT solves against brute force, real JAX traces.

Cheap transfers make the plan offload, dear ones make it recompute; the policy's
``Offloadable`` answers are checked against the jaxpr JAX builds with them: the
``device_put`` copies to host are exactly the plan's offloaded values, and the
residuals left on the device match the plan byte for byte.
"""

from __future__ import annotations

import itertools
import json
import random
from fractions import Fraction

import jax
import jax.numpy as jnp
import pytest
from pydantic import ValidationError

from optiremat.client import _jax_internals as jx
from optiremat.client import optimize
from optiremat.client._jax_internals import core as jax_core
from optiremat.client.keys import policy_key
from optiremat.client.measure import saved_residuals
from optiremat.client.plan import PlanError
from optiremat.client.planfile import PlanFile, load_plan
from optiremat.solver import (
    Backend,
    Decision,
    GraphBuilder,
    InfeasibleBudgetError,
    NodeMode,
    Solution,
    SolveOptions,
    solve,
)
from optiremat.solver.backends import make_backend
from optiremat.solver.formulation import build
from optiremat.solver.frontier import solve_budgets
from optiremat.solver.graph import CostGraph
from optiremat.solver.offload import DEFAULT_HOST_BANDWIDTH, OffloadOptions, evaluate_offload
from optiremat.solver.semantics import baseline_backward_flops
from optiremat.solver.solve import max_useful_budget, solve_from
from optiremat.solver.synthetic import transformer_like
from tests.models import CORPUS
from tests.service_harness import Server, body

CHEAP = OffloadOptions(host_bandwidth=10**18)  # a byte costs far less than a FLOP
DEAR = OffloadOptions(host_bandwidth=1)  # a byte costs 4e14 FLOPs


def chain(layers: int = 4, nbytes: int = 1000, flops: int = 10**6) -> CostGraph:
    """x -> tanh -> tanh -> ...; the backward pass reads every activation."""
    b = GraphBuilder("chain")
    prev = b.input(nbytes)
    for i in range(layers):
        h = b.value(nbytes)
        b.node("tanh", [prev], [h], key=f"k{i}", flops=flops)
        b.backward_reads.append(h)
        prev = h
    return b.build()


def cost(graph: CostGraph, sol) -> Fraction:
    assert sol.options.offload is not None and sol.offload is not None
    return sol.options.offload.cost_flops(sol.recompute_flops, sol.offload.host_bytes)


# ---- the solver ----------------------------------------------------------------


def test_cheap_transfers_offload_dear_ones_recompute() -> None:
    g = chain()
    cheap = solve(g, 1000, offload=CHEAP)
    # Any three offloaded and one saved on the device: nothing is recomputed.
    assert len(cheap.offloaded_keys) == 3 and len(cheap.saved_keys) == 1
    assert cheap.recompute_flops == 0
    assert (cheap.residual_bytes, cheap.offload.host_bytes) == (1000, 3000)
    assert cheap.offload.transfer_bytes == 6000  # out and back
    assert sorted(cheap.node_decisions) == ["offload", "offload", "offload", "save"]

    dear = solve(g, 1000, offload=DEAR)
    assert dear.offloaded_keys == [] and dear.offload.host_bytes == 0
    assert dear.recompute_flops == 3 * 10**6
    assert dear.node_decisions.count("recompute") == 3
    assert dear.offload.estimated_seconds == pytest.approx(3e6 / 4e14)


def test_decisions_are_typed_and_keep_their_wire_strings() -> None:
    """node_decisions parse to Decision members, dump as the strings every recorded
    answer holds, and the accessors split the nodes three ways."""
    sol = solve(chain(), 1000, offload=CHEAP)
    assert all(type(d) is Decision for d in sol.node_decisions)
    wire = json.loads(sol.model_dump_json())["node_decisions"]
    assert sorted(wire) == ["offload", "offload", "offload", "save"]
    again = Solution.model_validate_json(sol.model_dump_json())
    assert again.node_decisions == sol.node_decisions
    assert again.fingerprint() == sol.fingerprint()
    dear = solve(chain(), 1000, offload=DEAR)
    for s in (sol, dear):
        for kept, saved, off, recomputed in zip(s.kept(), s.saved(), s.offloaded(),
                                               s.recomputed(), strict=True):
            assert saved + off + recomputed == 1 and kept == (saved or off)
    assert (sum(sol.offloaded()), sum(sol.saved()), sum(sol.recomputed())) == (3, 1, 0)
    assert (sum(dear.offloaded()), sum(dear.recomputed())) == (0, 3)
    with pytest.raises(ValidationError):
        Solution.model_validate({**json.loads(sol.model_dump_json()),
                                 "node_decisions": ["keep"] * 4})


def test_a_host_budget_of_zero_offloads_nothing() -> None:
    g = chain()
    none = solve(g, 1000, offload=OffloadOptions(host_bandwidth=10**18, host_budget_bytes=0))
    plain = solve(g, 1000)
    assert none.offloaded_keys == [] and none.offload.host_bytes == 0
    assert none.recompute_flops == plain.recompute_flops
    # A host budget for one value offloads one value.
    one = solve(g, 1000, offload=OffloadOptions(host_bandwidth=10**18, host_budget_bytes=1000))
    assert len(one.offloaded_keys) == 1 and one.offload.host_bytes == 1000


def test_an_infeasible_device_budget_names_the_smallest_one() -> None:
    g = chain()
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, 999, offload=OffloadOptions(host_budget_bytes=0))
    assert err.value.min_budget_bytes == 1000
    # With host memory, the device may hold nothing: offload h1 and h3, rebuild the rest.
    assert solve(g, 0, offload=OffloadOptions(host_budget_bytes=2000)).residual_bytes == 0


@pytest.mark.parametrize("bad", [
    {"host_bandwidth": 0}, {"device_flop_rate": -1}, {"host_budget_bytes": -1},
    {"host_bandwidth": 2.5}, {"bandwidth": 10},
])
def test_bad_options_are_rejected_clearly(bad: dict) -> None:
    with pytest.raises(ValidationError) as err:
        SolveOptions.model_validate({"offload": bad})
    assert next(iter(bad)) in str(err.value)


def test_prices_that_overflow_64_bits_are_rejected() -> None:
    g = chain(flops=10**15)
    odd = OffloadOptions(host_bandwidth=10**18 + 9, device_flop_rate=10**15 + 7)
    with pytest.raises(ValueError, match="64-bit"):
        solve(g, 1000, offload=odd)


def _free_reshape() -> CostGraph:
    """x -> reshape -> y, both read by the backward pass: y costs bytes saved, nothing rebuilt."""
    b = GraphBuilder("free reshape")
    x = b.input(100)
    y = b.value(100)
    b.node("reshape", [x], [y], key="r", flops=0)
    b.backward_reads.extend([x, y])
    return b.build()


def test_the_offload_layer_sits_on_the_model_without_reductions() -> None:
    """The zero-FLOP chain rule fixes the reshape to recompute, which moves its
    residual onto x, a graph input that cannot be offloaded."""
    g = _free_reshape()
    assert build(g, tie=True) != build(g, tie=True, reduce=False)
    layered = build(g, tie=True, offload=CHEAP)
    assert layered == build(g, tie=True, reduce=False, offload=CHEAP)
    assert layered.offload is not None and len(layered.offload.offload_vars) == 1


def test_only_cp_sat_solves_the_offload_layer() -> None:
    g = chain()
    with pytest.raises(ValueError, match="SCIP does not solve the offload layer"):
        make_backend(Backend.SCIP, build(g, tie=True, offload=CHEAP))
    # A request for SCIP with offload is solved by CP-SAT, and says so.
    sol = solve(g, 1000, offload=CHEAP, backend=Backend.SCIP)
    assert sol.solver == "cpsat" and len(sol.offloaded_keys) == 3


def test_options_without_offload_keep_their_json_and_hash() -> None:
    plain = SolveOptions()
    assert "offload" not in plain.model_dump(mode="json")
    on = SolveOptions(offload=OffloadOptions())
    assert on.model_dump(mode="json")["offload"] == {
        "host_budget_bytes": 64 * 2**30, "host_bandwidth": DEFAULT_HOST_BANDWIDTH,
        "device_flop_rate": 400 * 10**12}
    sol = solve(chain(), 1000)
    assert "offload" not in json.loads(sol.model_dump_json())


def test_the_same_request_gives_the_same_plan() -> None:
    g = chain(6)
    options = OffloadOptions(host_bandwidth=10**9, device_flop_rate=10**12)
    runs = {solve(g, 2000, offload=options).fingerprint() for _ in range(3)}
    assert len(runs) == 1


def _random_graph(seed: int) -> CostGraph:
    rnd = random.Random(seed)
    b = GraphBuilder(f"random {seed}")
    values = [b.input(rnd.randrange(0, 64)) for _ in range(rnd.randint(1, 2))]
    for _ in range(rnd.randint(2, 8)):
        reads = rnd.sample(values, min(len(values), rnd.randint(1, 2)))
        writes = [b.value(rnd.randrange(0, 64)) for _ in range(rnd.randint(1, 2))]
        mode = rnd.choice([NodeMode.FREE] * 5 + [NodeMode.SAVE, NodeMode.RECOMPUTE])
        b.node("op", reads, writes, key=f"k{rnd.randrange(5)}" if mode == NodeMode.FREE else "",
               flops=rnd.randrange(0, 100), mode=mode)
        values.extend(writes)
        b.backward_reads.extend(v for v in writes if rnd.random() < 0.4)
    if not b.backward_reads:
        b.backward_reads.append(values[-1])
    return b.build()


def _brute_force(g: CostGraph, budget: int, options: OffloadOptions) -> Fraction | None:
    """Least cost over every (recompute, save, offload) choice per key."""
    keys = sorted({k for k, m in zip(g.node_key, g.node_mode, strict=True) if m == "free"})
    base = baseline_backward_flops(g)
    best = None
    for choice in itertools.product((0, 1, 2), repeat=len(keys)):
        of = dict(zip(keys, choice, strict=True))
        saves = [of.get(k, 0) > 0 for k in g.node_key]
        offloaded = [m == "free" and of.get(k) == 2
                     for k, m in zip(g.node_key, g.node_mode, strict=True)]
        plan = evaluate_offload(g, saves, offloaded)
        if plan.device_bytes <= budget and plan.host_bytes <= options.host_budget_bytes:
            c = options.cost_flops(plan.evaluation.backward_flops - base, plan.host_bytes)
            best = c if best is None or c < best else best
    return best


@pytest.mark.parametrize("seed", range(30))
def test_the_optimum_is_brute_forces(seed: int) -> None:
    g = _random_graph(seed)
    rnd = random.Random(seed)
    options = OffloadOptions(host_budget_bytes=rnd.randrange(0, 150),
                             host_bandwidth=rnd.choice([1, 3, 7, 10**6]),
                             device_flop_rate=rnd.choice([1, 2, 5]))
    budget = rnd.randrange(0, 150)
    best = _brute_force(g, budget, options)
    if best is None:
        with pytest.raises(InfeasibleBudgetError):
            solve(g, budget, offload=options)
        return
    sol = solve(g, budget, offload=options)
    assert cost(g, sol) == best
    plan = evaluate_offload(g, sol.kept(), sol.offloaded())
    assert (plan.device_bytes, plan.host_bytes) == (sol.residual_bytes, sol.offload.host_bytes)
    assert sol.residual_bytes <= budget and sol.offload.host_bytes <= options.host_budget_bytes


# ---- against JAX -----------------------------------------------------------------


def _subjaxprs(eqn: jax_core.JaxprEqn):
    for param in eqn.params.values():
        for p in param if isinstance(param, tuple | list) else (param,):
            if isinstance(p, jx.ClosedJaxpr):
                yield p.jaxpr
            elif isinstance(p, jax_core.Jaxpr):
                yield p


def _copies_to(jaxpr: jax_core.Jaxpr,
               space: jax_core.MemorySpace) -> list[jax_core.JaxprEqn | None]:
    """Per ``device_put`` into ``space`` (at any depth), the equation that produced its
    input (None for an input of the jaxpr: a copy back reads a residual)."""
    producer = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put" and eqn.params["devices"] == (space,):
            found.extend(producer.get(v) for v in eqn.invars)
        for sub in _subjaxprs(eqn):
            found.extend(_copies_to(sub, space))
    return found


def _smallest_device_budget(fun, args, **options) -> int:
    try:
        optimize(fun, *args, budget=0, **options, memory="residuals")
    except InfeasibleBudgetError as err:
        return err.min_budget_bytes
    return 0


# Models without cond: there a tied decision stands for several keys (its group).
@pytest.mark.parametrize("name", ["mlp", "transformer_block", "scan_stack"])
def test_the_policy_offloads_exactly_what_the_plan_offloads(name: str) -> None:
    fun, args = CORPUS[name]
    budget = _smallest_device_budget(fun, args, offload=CHEAP)
    plan = optimize(fun, *args, budget=budget, offload=CHEAP, memory="residuals")
    assert plan.offloaded_keys and plan.host_bytes > 0

    # The jaxpr JAX builds with the policy: one copy to host per offloaded value,
    # produced by an equation whose key the plan offloads, and one copy back.
    checkpointed = jax.checkpoint(fun, policy=plan.policy)
    jaxpr = jax.make_jaxpr(lambda *a: jax.vjp(checkpointed, *a)[1](1.0))(*args).jaxpr
    to_host = _copies_to(jaxpr, jax_core.MemorySpace.Host)
    keys = {policy_key(e.primitive, [v.aval for v in e.invars], e.params)
            for e in to_host if e is not None}
    assert None not in to_host
    assert keys == plan.offloaded_keys
    offloaded_nodes = plan.solution.offloaded()
    ev = evaluate_offload(plan.graph, plan.solution.kept(), offloaded_nodes)
    producer = plan.graph.producer
    host_values = [v for v in ev.evaluation.residuals
                   if (p := producer[v]) is not None and offloaded_nodes[p]]
    assert len(to_host) == len(host_values)
    assert len(_copies_to(jaxpr, jax_core.MemorySpace.Device)) == len(host_values)

    # saved_residuals: device residuals byte for byte, the rest in host memory.
    residuals = saved_residuals(checkpointed, *args)
    assert sum(r.bytes for r in residuals if not r.host) == plan.residual_bytes <= budget
    assert sum(r.bytes for r in residuals if r.host) == plan.host_bytes
    check = plan.verify(fun, *args, flops=True)
    assert check.exact and check.measured_recompute_flops == plan.recompute_flops


def test_dear_transfers_give_a_policy_that_never_offloads() -> None:
    fun, args = CORPUS["mlp"]
    budget = _smallest_device_budget(fun, args, offload=CHEAP)
    plan = optimize(fun, *args, budget=budget, offload=DEAR, memory="residuals")
    assert not plan.offloaded_keys and plan.host_bytes == 0
    jaxpr = jax.make_jaxpr(lambda *a: jax.vjp(plan.checkpoint(fun), *a)[1](1.0))(*args).jaxpr
    assert _copies_to(jaxpr, jax_core.MemorySpace.Host) == []
    assert plan.verify(fun, *args).exact


def test_the_offloading_plan_runs_and_gives_the_same_gradient() -> None:
    fun, args = CORPUS["mlp"]
    budget = _smallest_device_budget(fun, args, offload=CHEAP)
    plan = optimize(fun, *args, budget=budget, offload=CHEAP, memory="residuals")
    assert plan.offloaded_keys
    got = jax.jit(jax.grad(plan.checkpoint(fun), argnums=(1, 2, 3)))(*args)
    want = jax.grad(fun, argnums=(1, 2, 3))(*args)
    for g, w in zip(got, want, strict=True):
        assert jnp.allclose(g, w, rtol=1e-4, atol=1e-4)  # jit reorders float sums


@pytest.mark.parametrize("name", ["mlp", "scan_stack"])
def test_untied_offload_goes_through_the_names_form(name: str) -> None:
    """``save_and_offload_only_these_names`` with the plan's names."""
    fun, args = CORPUS[name]
    budget = _smallest_device_budget(fun, args, tie=False, offload=CHEAP)
    plan = optimize(fun, *args, budget=budget, tie=False, offload=CHEAP, memory="residuals")
    assert plan.names.offloaded and plan.names.host_bytes > 0
    with pytest.raises(PlanError, match="tie=False"):
        plan.policy  # noqa: B018
    check = plan.verify(flops=True)
    assert check.exact and check.measured_host_bytes == plan.names.host_bytes


def test_of_equally_cheap_plans_the_leanest_on_the_device_wins() -> None:
    """Saving a free reshape or rebuilding it cost the same: no device bytes are spent on it."""
    sol = solve(_free_reshape(), 1000, offload=CHEAP)
    assert sol.node_decisions == ["recompute"] and sol.residual_bytes == 100


def test_a_sweep_with_offload_offloads_at_small_budgets() -> None:
    g = chain()
    results = solve_budgets(g, [1000, 2000, 4000], SolveOptions(offload=CHEAP))
    host = [results[b].offload.host_bytes for b in (1000, 2000, 4000)]
    assert host == [3000, 2000, 0]


def test_each_budget_of_an_offload_sweep_is_a_request_of_its_own() -> None:
    """An offload search takes no start, and no hint from the budget before: here the
    infeasible budget's search for the smallest one would steer the next budget's."""
    g = transformer_like(4)
    options = SolveOptions(offload=OffloadOptions(host_bandwidth=10**12))
    tight, budget = (max_useful_budget(g) // d for d in (12, 8))
    swept = solve_budgets(g, [tight, budget], options)
    single = solve(g, budget, options)
    assert isinstance(swept[tight], InfeasibleBudgetError)
    assert swept[budget].fingerprint() == single.fingerprint()
    warm = solve_from(g, budget, single.options, [True] * g.num_nodes)
    assert warm.fingerprint() == single.fingerprint() and warm.offloaded_keys


# ---- the service ---------------------------------------------------------------


def test_the_option_flows_through_the_service(server: Server) -> None:
    g = chain()
    offload = {"host_bandwidth": 10**18}
    with server.client() as client:
        response = client.post("/v1/solve", json=body(g, 1000, offload=offload))
        assert response.status_code == 200, response.text
        remote = Solution.model_validate(response.json())
        assert response.json()["options"]["offload"]["host_bandwidth"] == 10**18
        bad = client.post("/v1/solve", json=body(g, 1000, offload={"host_bandwidth": 0}))
    assert remote.options.offload == OffloadOptions(**offload)
    # Same options as the server's (it caps the time limit): the same plan, bit for bit.
    assert remote.fingerprint() == solve(g, 1000, remote.options).fingerprint()
    assert len(remote.offloaded_keys) == 3 and remote.offload.host_bytes == 3000
    assert bad.status_code == 422 and "host_bandwidth" in bad.text


def test_a_plan_file_keeps_the_offloads(tmp_path) -> None:
    fun, args = CORPUS["mlp"]
    budget = _smallest_device_budget(fun, args, offload=CHEAP)
    plan = optimize(fun, *args, budget=budget, offload=CHEAP, memory="residuals")
    loaded = load_plan(PlanFile.of(plan).write(tmp_path / "mlp.plan.json"))
    assert loaded.policy() == plan.policy and loaded.offloaded_keys == plan.offloaded_keys
    assert loaded.evaluation().residual_bytes == plan.residual_bytes + plan.host_bytes
