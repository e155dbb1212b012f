"""The step's phases (``solver.peak.step_phases``): what each holds, on graphs built by hand.

A step here is an embedding, one region of layers and a head, in program order:
the head's residuals are live at the forward pass's end and in the head's
backward, and freed before the layers' backward runs; the embedding's output,
read by the region, is live in the region's backward too.
"""

from __future__ import annotations

from optiremat.solver.graph import CostGraph, GraphBuilder
from optiremat.solver.peak import BudgetView, fixed_residuals, step_phases
from optiremat.solver.solve import min_feasible_budget, solve
from optiremat.solver.step import RegionMemory, StepMemory

MiB = 2**20
LAYER_WORKING, HEAD_WORKING = 3 * MiB, 10 * MiB


def lm_step(outside_working: int | None = HEAD_WORKING,
            layer_working: int = LAYER_WORKING) -> CostGraph:
    """tokens -> embed (outside) -> 4 layers (region 0, each saving or recomputing its
    activation) -> head (outside: logits kept for its backward). Outside every region
    JAX's own AD decides (mode save), as in an extracted step."""
    b = GraphBuilder("lm")
    b.step = StepMemory(argument_bytes=8 * MiB, output_bytes=4 * MiB,
                        regions=[RegionMemory(source="lm.py:3", length=4,
                                              working_bytes=layer_working)],
                        outside_working_bytes=outside_working)
    table = b.input(4 * MiB)
    h0 = b.value(MiB)
    b.node("gather", [table], [h0], flops=10, mode="save")  # the embedding: JAX's own AD
    b.backward_reads.append(h0)  # the region's backward reads its input
    h = h0
    for _ in range(4):
        act, out = b.value(2 * MiB, region=0), b.value(MiB)
        b.node("dot_general", [h], [act], key="dot", flops=1000, region=0)
        b.node("tanh", [act], [out], key="tanh", flops=10, region=0)
        b.backward_reads.append(act)
        h = out
    final = b.value(MiB)
    b.node("scan_output", [h], [final], mode="save")  # the scan's last carry
    logits = b.value(6 * MiB)
    b.node("dot_general", [final], [logits], flops=5000, mode="save")  # the head
    b.backward_reads += [final, logits]
    return b.build()


def test_the_heads_residuals_are_freed_before_the_layers_backward() -> None:
    g = lm_step()
    region, outside = step_phases(g)
    fixed = [g.value_bytes[v] for v in fixed_residuals(g)]
    assert sorted(fixed) == [MiB, MiB, 6 * MiB]  # h0, the last layer's output, the logits
    assert region.fixed_residual_bytes == MiB  # h0 alone: the region reads it
    assert outside.fixed_residual_bytes == 8 * MiB  # every residual outside the region
    assert (region.working_bytes, outside.working_bytes) == (LAYER_WORKING, HEAD_WORKING)


def test_the_peak_is_the_largest_phase() -> None:
    g = lm_step()
    view = BudgetView.of(g, None)
    held = 12 * MiB
    assert view.held_bytes == held + max(LAYER_WORKING + MiB, HEAD_WORKING + 8 * MiB)
    assert view.peak_phase() is not None and view.peak_phase().region == -1
    # Saving every layer's activation: 4 x 2 MiB in every phase.
    saves = [True] * g.num_nodes
    assert view.predicted(saves) == held + 8 * MiB + HEAD_WORKING + 8 * MiB
    # With a small head the layers' backward sets the peak instead; the head's
    # residuals do not count there.
    small = BudgetView.of(lm_step(outside_working=0, layer_working=9 * MiB), None)
    assert small.peak_phase().region == 0
    assert small.held_bytes == held + 9 * MiB + MiB


def test_a_graph_priced_before_phases_keeps_its_answers() -> None:
    """No ``outside_working_bytes``: every residual counts against the layers' backward
    and the held bytes are the largest region working set, as they were."""
    g = lm_step(outside_working=None)
    assert fixed_residuals(g) == []
    view = BudgetView.of(g, None)
    assert view.held_bytes == 12 * MiB + LAYER_WORKING
    assert view.predicted([False] * g.num_nodes) == 12 * MiB + LAYER_WORKING + 8 * MiB


def test_the_solver_plans_every_phase() -> None:
    """A budget that the head's phase sets: the plan fits it in that phase, and the
    smallest feasible budget is the head phase's with the fewest residuals."""
    g = lm_step()
    floor = min_feasible_budget(g)
    assert floor == 12 * MiB + HEAD_WORKING + 8 * MiB
    roomy = solve(g, floor + 4 * MiB)
    assert roomy.peak_bytes is not None and roomy.peak_bytes <= floor + 4 * MiB
    assert roomy.peak_bytes == BudgetView.of(g, None).predicted(roomy.kept())
    assert sum(roomy.saved()) >= 2
