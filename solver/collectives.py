"""Collectives on a mesh: what recomputing a node costs the interconnect, priced in FLOPs.

On a device mesh some nodes move bytes between devices each time they run: a
``dot_general`` whose contracted dimension is split all-reduces its partial sums,
a reshape that cannot keep a split gathers the value back (the graph's
``node_collective_bytes``, per device, measured by the client from the step's
shardings). The forward pass pays for them once whatever the plan; a plan that
recomputes such a node pays again in the backward pass, on the link, not in
FLOPs. So a search prices each node's recomputation as its FLOPs plus its
collective bytes at ``SolveOptions.interconnect_bandwidth``, converted to
FLOP-equivalents at the device's FLOP rate (``OffloadOptions.device_flop_rate``,
its default without offload).

A graph's FLOPs are the whole step's, over every device, while a collective
stalls every device at once: its seconds are priced at the FLOP rate of the whole
mesh, ``devices * device_flop_rate``. A gather of a parameter into a dot is not
counted: the gradient reads the gathered parameter too, and XLA gathers it once
in the backward pass for both (measured on FSDP: the same all-gathers in a
layer's backward with every dot recomputed as with none).

The search runs on ``priced``, a view whose ``node_flops`` carry the link's
price (so every part of the solver, repeats, nesting and offload included,
minimises the same cost), and ``report`` turns its answer back into the
graph's terms: ``recompute_flops`` in FLOPs, ``collective_bytes`` the bytes
the plan's recomputation moves, ``lower_bound_flops`` and ``gap`` on the
objective (FLOPs plus the link in FLOP-equivalents), as with offload.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from optiremat.solver.graph import CostGraph
from optiremat.solver.nesting import nested_nodes
from optiremat.solver.offload import DEFAULT_DEVICE_FLOP_RATE
from optiremat.solver.semantics import baseline_evaluation, evaluate
from optiremat.solver.solution import Solution, SolveOptions


def flops_per_link_byte(graph: CostGraph, options: SolveOptions) -> Fraction:
    """What one byte a device moves over the interconnect costs, in FLOPs of the step."""
    rate = options.offload.device_flop_rate if options.offload else DEFAULT_DEVICE_FLOP_RATE
    return Fraction(rate * graph.devices, options.interconnect_bandwidth)


def link_flops(graph: CostGraph, options: SolveOptions) -> list[int]:
    """Per node, its collective bytes in FLOP-equivalents (rounded up: a byte is never free)."""
    price = flops_per_link_byte(graph, options)
    return [-(-b * price.numerator // price.denominator)
            for b in graph.node_collective_bytes or [0] * graph.num_nodes]


def priced(graph: CostGraph, options: SolveOptions) -> CostGraph:
    """The graph a search minimises on: each node's FLOPs plus its link's price; the graph
    itself when no node moves bytes between devices."""
    if not any(graph.node_collective_bytes or ()):
        return graph
    flops = [f + link for f, link in zip(graph.node_flops, link_flops(graph, options),
                                         strict=True)]
    return CostGraph.model_construct(**{**dict(graph), "node_flops": flops,
                                        "node_collective_bytes": None})


def report(graph: CostGraph, answer: Solution) -> Solution:
    """An answer found on ``priced(graph, ...)``, in ``graph``'s terms: what its nodes run
    in the backward pass beyond saving everything (``semantics.recompute_flops``'s rule)
    and in nested groups' second forward pass (``nesting.forward_flops``'s), in FLOPs and
    in collective bytes."""
    update: dict[str, object] = {"graph_hash": graph.content_hash}
    if answer.planned:
        runs = [*evaluate(graph, answer.kept()).active, *nested_nodes(graph, answer.groups or ())]
        baseline = baseline_evaluation(graph).active

        def added(column: Sequence[int]) -> int:
            return sum(column[n] for n in runs) - sum(column[n] for n in baseline)

        update["recompute_flops"] = added(graph.node_flops)
        update["collective_bytes"] = added(graph.node_collective_bytes or [0] * graph.num_nodes)
    return answer.model_copy(update=update)
