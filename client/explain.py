"""A plan in words: what it holds, where, and what it costs.

One text for ``Plan.explain()`` and ``optiremat explain``. A peak plan's
prediction is broken down the way the peak model adds it up
(``optiremat.solver.peak``): arguments, gradients, residuals per layer x
layers for each region, and the working set of the backward pass.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from optiremat.solver.breakdown import WHOLE_STEP, PeakBreakdown, breakdown, residual_parts
from optiremat.solver.graph import CostGraph
from optiremat.solver.nesting import forward_flops
from optiremat.solver.peak import BudgetView
from optiremat.solver.semantics import Evaluation, evaluate
from optiremat.solver.solution import Decision, Solution
from optiremat.solver.step import RegionKind, StepMemory
from optiremat.solver.units import format_bytes


def explain_plan(graph: CostGraph, solution: Solution, top: int | None = 20,
                 names: Mapping[str, str] | None = None) -> str:
    """The plan's summary, its peak breakdown (peak plans) and its largest residuals;
    ``names``: the ``checkpoint_name`` per node key that binds one, shown by its value."""
    sol = solution
    lines = [f"plan for {graph.name or 'graph'} {graph.content_hash[:12]}: {sol.status}, "
             f"solved by {sol.solver} {sol.solver_version} in {sol.solve_seconds:.2f} s"]
    if not sol.planned:
        return "\n".join([*lines, "no plan: the solver stopped before it found one"])
    if sol.no_checkpoint:
        assert sol.peak_bytes is not None
        return "\n".join([*lines, f"no checkpoint: the training step as written peaks at "
                           f"{format_bytes(sol.peak_bytes)} as measured, within the budget of "
                           f"{format_bytes(sol.budget_bytes)}; nothing is recomputed"])
    evaluation = evaluate(graph, sol.kept())
    recomputed = [n for n in evaluation.active if graph.node_key[n]]
    lines.append(
        f"budget {format_bytes(sol.budget_bytes)}; residuals {format_bytes(sol.residual_bytes)} "
        f"in {len(evaluation.residuals)} values; {sol.recompute_flops:,} recompute FLOPs "
        f"over {len(recomputed)} equations (lower bound {sol.lower_bound_flops:,})")
    if sol.offload is not None:
        lines.append(f"offloaded to host memory: {format_bytes(sol.host_bytes)}; estimated "
                     f"{sol.offload.estimated_seconds * 1e3:.3f} ms added to the step by "
                     "recomputation and the transfers its compute does not hide")
    if sol.collective_bytes is not None:
        lines.append(f"collectives its recomputation repeats: {format_bytes(sol.collective_bytes)} "
                     f"per device over the interconnect (priced at "
                     f"{sol.options.interconnect_bandwidth:.3g} B/s; the lower bound counts them)")
    if sol.layer_groups:
        lines += ["", *layer_group_lines(graph, sol)]
    elif sol.peak_bytes is not None:
        lines += ["", *peak_breakdown(graph, sol, evaluation), "", *lever_breakdown(graph, sol)]
    lines += ["", *_residual_table(graph, sol, evaluation, top, names or {})]
    return "\n".join(lines)


def _row(name: str, nbytes: int, note: str = "") -> str:
    """One term of a peak's breakdown: its name, its bytes, what it is."""
    return f"  {name:<26}{format_bytes(nbytes):>12}  {note}".rstrip()


def _held_rows(step: StepMemory) -> list[str]:
    """What the whole step holds, whatever the plan: arguments, gradients, less donated."""
    rows = [_row("arguments", step.argument_bytes, "parameters and batch, the whole step"),
            _row("gradients", step.output_bytes, "the step's outputs")]
    if step.alias_bytes:
        rows.append(_row("- donated", step.alias_bytes, "gradients written over arguments"))
    return rows


def layer_group_lines(graph: CostGraph, solution: Solution) -> list[str]:
    """A plan whose scan layers (or repeated blocks) are planned apart: the measured peak
    term by term (arguments, gradients, each group's residuals per layer x its layers, or
    each block's, the rest), and what each group saves beyond the first (whose policy the
    residual table shows)."""
    assert solution.layer_groups and solution.peak_bytes is not None
    step = graph.step
    assert step is not None
    within = "within" if solution.peak_bytes <= solution.budget_bytes else "OVER"
    lines = [f"peak of the training step {format_bytes(solution.peak_bytes)} measured, "
             f"{within} the budget of {format_bytes(solution.budget_bytes)}, with the "
             "layers planned apart:", *_held_rows(step)]
    first = set(solution.layer_groups[0].saved_keys)
    accounted = step.held_bytes
    start = blocks = 0
    for group in solution.layer_groups:
        region = step.regions[group.region]
        keys = set(group.saved_keys)
        stacked, _, _ = residual_parts(graph, group.region, [k in keys for k in graph.node_key])
        per_layer = stacked // region.length
        extra = keys - first
        primitives = sorted({p for k, p in zip(graph.node_key, graph.node_primitive,
                                               strict=True) if k in extra})
        what = (f"also saves {len(extra)} keys ({', '.join(primitives)})" if extra
                else "the plan's policy")
        if region.kind == RegionKind.BLOCK:  # a block of a run planned apart, by itself
            lines.append(_row(f"residuals, block {blocks}", stacked,
                              f"the {region.describe()}: {what}"))
            blocks += 1
            accounted += stacked
            continue
        name = (f"layer {start}" if group.layers == 1
                else f"layers {start}-{start + group.layers - 1}")
        lines.append(_row(f"residuals, {name}", per_layer * group.layers,
                          f"{format_bytes(per_layer)} per layer x {group.layers} layers of the "
                          f"{region.describe()}: {what}"))
        accounted += per_layer * group.layers
        start += group.layers
    lines.append(_row("+ the rest", solution.peak_bytes - accounted,
                      "the peak phase's working set, residuals outside the layers and "
                      "XLA's own buffers"))
    return lines


def peak_breakdown(graph: CostGraph, solution: Solution, evaluation: Evaluation) -> list[str]:
    """The predicted peak, term by term: the terms above the phases add up to it.

    (Long on purpose: the lines in the order ``explain()`` prints them.)"""
    step = graph.step
    assert step is not None and solution.peak_bytes is not None
    arguments = {graph.value_index[v] for v in graph.inputs}
    extra = graph.value_extra_bytes or [0] * graph.num_values
    regions = graph.node_region or [-1] * graph.num_nodes
    per_region = [0] * (len(step.regions) + 1)  # the last: outside every region
    for v in evaluation.residuals:
        if v in arguments:
            continue
        producer = graph.producer[v]
        index = regions[producer] if producer is not None else -1
        per_region[index] += graph.value_bytes[v] + extra[v]

    terms = breakdown(graph, solution)
    peak = terms.peak
    groups = list(solution.groups or [1] * len(step.regions))
    within = "within" if solution.peak_bytes <= solution.budget_bytes else "OVER"
    lines = [f"peak of the training step {format_bytes(solution.peak_bytes)} predicted, "
             f"{within} the budget of {format_bytes(solution.budget_bytes)}:",
             *_held_rows(step)]
    nested = [(k, region) for k, region in zip(groups, step.regions, strict=True) if k != 1]
    if nested:
        lines.append(_row("nested groups' buffers", terms.nesting_bytes,
                          "; ".join(f"{format_bytes(k * r.carry_bytes)} of group inputs "
                                    f"({format_bytes(r.carry_bytes)} x {k} groups) and one "
                                    f"group's parameter slices, "
                                    f"{format_bytes(r.length // k * r.slice_bytes)}"
                                    for k, r in nested)))
    lines.append(_row("+ the peak phase", peak.total, f"{peak.name}, below"))
    lines.append("residuals the plan keeps, by the region that makes them (live in every "
                 "phase):")
    for k, region in enumerate(step.regions):
        per_layer = per_region[k] // region.length
        where = f"({region.describe()})"
        if region.kind == RegionKind.BLOCK:
            lines.append(_row(f"residuals, region {k}", per_region[k],
                              f"a checkpoint around the block {where}"))
        elif groups[k] == 1:
            lines.append(_row(f"residuals, region {k}", per_region[k],
                              f"{format_bytes(per_layer)} per layer x {region.length} layers, a "
                              f"checkpoint per layer {where}"))
        else:
            layers = region.length // groups[k]
            lines.append(_row(f"residuals, region {k}", per_region[k] // groups[k],
                              f"one group's: {format_bytes(per_layer)} per layer x {layers} "
                              f"layers, {groups[k]} rematerialised groups {where}"))
    if per_region[-1] or not step.regions:
        lines.append(_row("residuals, elsewhere", per_region[-1], "outside every region"))
    if not step.regions:
        lines.append("  no region to place remat in (no differentiated lax.scan, checkpoint "
                     "of yours or repeated block holding a matmul): the plan cannot move the "
                     "peak. Write the layers as lax.scan or a loop of jax.checkpoint blocks, "
                     "or name them with optimize(..., regions=[scope]).")
    lines += phase_breakdown(graph, solution, terms)
    return lines


def phase_breakdown(graph: CostGraph, solution: Solution,
                    terms: PeakBreakdown | None = None) -> list[str]:
    """What each phase of the step holds beyond the arguments, gradients and nested
    groups' buffers (``solver.breakdown``), and which one sets the peak."""
    step = graph.step
    assert step is not None
    terms = breakdown(graph, solution) if terms is None else terms
    measured = solution.working_bytes is not None
    lines = ["phases of the step, beyond arguments, gradients and nested groups' buffers "
             "(the largest sets the peak):"]
    for share in terms.phases:
        if share.region >= 0:
            region = step.regions[share.region]
            if region.kind == RegionKind.BLOCK:
                where = f"the {region.describe()}, recomputed once"
                working = "working set of its backward"
            else:
                where = f"one layer at a time, {region.length} layers ({region.describe()})"
                working = "working set of one layer's backward"
        elif share.name == WHOLE_STEP:
            where, working = "the step", "working set"
        else:
            where = "the forward pass's end and the backward of what follows the last region"
            working = "working set"
        if share.peak:
            working += " (measured for this plan)" if measured else " (calibrated)"
        mark = "<- peak" if share.peak else (
            f"at most (priced {format_bytes(share.priced)}, over the peak measured)"
            if share.capped else "")
        lines.append(f"  {share.name:<26}{format_bytes(share.total):>12}  {mark}".rstrip())
        freed = (f", less {format_bytes(share.freed)} of residuals XLA frees before then"
                 if share.freed else "")
        lines.append(f"    {where}: the plan's residuals {format_bytes(share.planned)}, "
                     f"others live there {format_bytes(share.others)}, "
                     f"{working} {format_bytes(share.working)}{freed}")
    peak = terms.peak
    if peak.region >= 0:
        lines.append(f"peak at the {peak.name}")
    elif peak.name != WHOLE_STEP:
        lines.append("peak outside the regions (the head's backward, where the step has one)")
    return lines


def lever_breakdown(graph: CostGraph, solution: Solution) -> list[str]:
    """What each lever bought: the bytes of the peak model (working set aside) that
    the plan's policy, its nested groups and its offload each take off saving
    everything in every layer, and what each costs."""
    saves = solution.kept()
    view = BudgetView.of(graph, None)
    everything = view.predicted([True] * graph.num_nodes)
    per_layer = view.predicted(saves)  # offloaded residuals still on the device here
    groups = solution.groups or [1]
    second_pass = forward_flops(graph, groups) if any(k != 1 for k in groups) else 0

    def row(name: str, nbytes: int, note: str) -> str:
        return f"  {name:<26}{format_bytes(nbytes):>12}  {note}"

    lines = [f"what each lever bought, against saving everything in every layer "
             f"({format_bytes(everything)}):",
             row("recomputation", everything - per_layer,
                 f"the policy; {solution.recompute_flops - second_pass:,} FLOPs recomputed")]
    if second_pass:
        nested = BudgetView.of(graph, None, groups).predicted(saves)
        lines.append(row("nested groups", per_layer - nested,
                         f"groups {list(groups)}; a second forward pass, {second_pass:,} FLOPs"))
    if solution.offload is not None and solution.host_bytes:
        lines.append(row("offload", solution.host_bytes,
                         f"to host memory; {format_bytes(solution.offload.transfer_bytes)} "
                         "over the link"))
    return lines


def _residual_table(graph: CostGraph, sol: Solution, evaluation: Evaluation,
                    top: int | None, names: Mapping[str, str]) -> list[str]:
    inputs = {graph.value_index[v] for v in graph.inputs}
    rows = []
    for v in evaluation.residuals:
        node = graph.producer[v]
        shape = value_text(graph.value_dtype[v], graph.value_shape[v], graph.value_bytes[v])
        if node is None:
            rows.append((graph.value_bytes[v], "input", shape, -1,
                         "argument" if v in inputs else ""))
        else:
            offloaded = sol.node_decisions[node] == Decision.OFFLOAD
            named = names.get(graph.node_key[node])
            op = graph.node_primitive[node] + (f" {named!r}" if named else "")
            rows.append((graph.value_bytes[v], op + (" (host)" if offloaded else ""), shape,
                         graph.node_flops[node], graph.node_source[node]))
    rows.sort(key=lambda r: (-r[0], r[4], r[1]))
    shown = rows[:top] if top else rows
    lines = [f"{'bytes':>11} {'share':>6} {'FLOPs':>12}  {'op':<16} {'value':<22} source"]
    total = max(sol.residual_bytes + sol.host_bytes, 1)
    for nbytes, op, shape, flops, source in shown:
        lines.append(f"{format_bytes(nbytes):>11} {nbytes / total:>6.1%} "
                     f"{'-' if flops < 0 else f'{flops:,}':>12}  {op:<16} {shape:<22} "
                     f"{source or '-'}")
    if len(shown) < len(rows):
        lines.append(f"... and {len(rows) - len(shown)} smaller values")
    return lines


def value_text(dtype: str, shape: list[int], nbytes: int) -> str:
    """``float32[32,64]``, with ``x16`` when a scan stacks it sixteen times."""
    text = f"{dtype}[{','.join(map(str, shape))}]"
    bits = re.search(r"(\d+)$", dtype)
    one = math.prod(shape) * (int(bits.group(1)) // 8 if bits else 1)
    if one and nbytes > one and nbytes % one == 0:
        text += f" x{nbytes // one}"
    return text
