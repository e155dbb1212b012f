"""The training step's cost graph: its regions placed, its memory measured.

A step's graph is a traced function's graph (``client.extract``) walked as
``jax.vjp`` differentiates it, with a remat region in every differentiated
``lax.scan`` (``client.peak.placement``) and what the step holds, each region's
working set included (``client.peak.calibration``), travelling with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import jax

import optiremat.client._jax_internals as jx
from optiremat.client.extract.graphs import Extraction, graph_of_traced
from optiremat.client.extract.state import NamesOnly
from optiremat.client.extract.tracing import Traced, trace
from optiremat.client.peak.calibration import assumed_working_bytes, calibrate_phases
from optiremat.client.peak.finding import RegionMarker, find_regions
from optiremat.client.peak.placement import Placement, keeps_barriers, place
from optiremat.client.peak.regions import Region
from optiremat.client.step import Step, StepMemoryAnalysis, compile_ahead, lowered_memory
from optiremat.solver.graph import CostGraph, NodeMode
from optiremat.solver.semantics import kept_anyway
from optiremat.solver.step import StepMemory


@dataclass(frozen=True)
class StepExtraction:
    """The graph of a training step whose regions the plan decides."""

    extraction: Extraction  # its graph carries the step's memory (CostGraph.step)
    regions: tuple[Region, ...]
    differentiated: tuple[bool, ...]  # per flattened argument: whether the step differentiates it
    traced: Traced  # the function, traced once: every later compile evaluates its jaxpr
    scopes: tuple[str, ...] = ()  # the name scopes its blocks were found by, if any

    @property
    def graph(self) -> CostGraph:
        return self.extraction.graph


def step_extraction(fun: Callable, args: Sequence, step: Step, *, name: str = "",
                    name_inputs: bool = False, scopes: Sequence[str] = (),
                    names: NamesOnly | None = None) -> StepExtraction:
    """The cost graph of ``step`` (``jax.jit(jax.grad(fun, argnums))``) with a remat
    region in every differentiated ``lax.scan`` (``client.peak.placement``), and what
    the step holds and each region's working set (one compile per distinct layer).
    With ``name_inputs`` each layer's input is offered to the plan too (to offload); with
    ``names`` only the names it offers are (a names-only plan's graph)."""
    return traced_step_extraction(trace(fun, args, {}), args, step, name=name,
                                  name_inputs=name_inputs, scopes=scopes, names=names)


def traced_step_extraction(traced: Traced, args: Sequence, step: Step, *, name: str = "",
                           name_inputs: bool = False, scopes: Sequence[str] = (),
                           names: NamesOnly | None = None) -> StepExtraction:
    """``step_extraction`` of a function already traced at ``args``: every later trace
    and compile evaluates its jaxpr, never the function again. With ``names`` the plan
    decides only the names it offers (``optimize(..., saveable=)``)."""
    step.check(args)
    traced.check_differentiable()  # before the compiles that measure working sets
    flags = step.differentiated(args)
    closed = jx.ClosedJaxpr(traced.open_jaxpr, traced.consts)
    regions = tuple(find_regions(closed, flags, scopes))
    # Each layer's operands split as the step splits them.
    specs = traced.layout.variable_specs(
        traced.closed.jaxpr, [*[None] * traced.num_consts, *traced.layout.argument_specs])
    regions = tuple(replace(r, layout=traced.layout,
                            operand_specs=tuple(specs.get(v) for v in r.operand_vars))
                    for r in regions)
    markers = [RegionMarker(r.index) for r in regions]

    def marked(*leaves):
        return place(closed, leaves, regions, markers, flags, name_inputs=name_inputs,
                     scopes=scopes)

    every_layer = Placement(regions, tuple(flags), step, scopes=tuple(scopes))

    lowered_by_policy: dict[object, jax.stages.Lowered] = {}

    def step_lowered(policy) -> jax.stages.Lowered:
        """The step with every region under ``policy``, lowered (once: a compile started
        ahead is read from the same program)."""
        def placed(*args):
            return every_layer.evaluate(traced, jax.tree_util.tree_leaves(args), policy)
        if policy not in lowered_by_policy:
            lowered_by_policy[policy] = step.function(placed).lower(*args)
        return lowered_by_policy[policy]

    def step_memory(policy) -> StepMemoryAnalysis:
        """XLA's memory analysis of the step with every region under ``policy``."""
        return lowered_memory(step_lowered(policy), keeps_barriers(regions))

    # Calibration's first compile runs while the regions' programs compile and the graph
    # is extracted.
    compile_ahead(step_lowered(jax.checkpoint_policies.nothing_saveable),
                  keeps_barriers(regions))
    if not traced.layout.on_mesh:
        arguments, outputs, aliases = step.held_memory(args)
    else:
        # On a mesh the step holds each argument's shard and each gradient as its out
        # sharding says (an FSDP gradient reduce-scattered, a replicated one whole): read
        # from the compile that calibrates the phases below, which is remembered.
        held = step_memory(jax.checkpoint_policies.nothing_saveable)
        arguments, outputs, aliases = held.argument_bytes, held.output_bytes, held.alias_bytes
    memory = StepMemory(argument_bytes=arguments, output_bytes=outputs, alias_bytes=aliases,
                        regions=[r.memory(assumed_working_bytes(r)) for r in regions])
    extraction = graph_of_traced(trace(marked, traced.flat_args, {}), name=name, step=True,
                                 differentiated=flags, step_memory=memory,
                                 names=names or False)

    calibrated = calibrate_phases(
        extraction.graph, regions, lambda policy: step_memory(policy).peak_bytes,
        lambda policy: compile_ahead(step_lowered(policy), keeps_barriers(regions)))
    graph = CostGraph.model_construct(**{**dict(extraction.graph), "step": calibrated})
    if names is not None:
        graph = _idle_names_recomputed(graph)
    return StepExtraction(replace(extraction, graph=graph), regions, tuple(flags), traced,
                          tuple(scopes))


def _idle_names_recomputed(graph: CostGraph) -> CostGraph:
    """A names-only graph with the names whose values are kept anyway (a layer's carry,
    named: Levanter's ``scan(layers)__carry``) left to JAX's rules: saving one would tie
    with recomputing it in the cost model while JAX adds a ``reduce_precision`` op on the
    saved value, and the framework's config would differ from its preset that saves
    nothing (Levanter's ``full``) for no byte or FLOP."""
    free = {k for k, m in zip(graph.node_key, graph.node_mode, strict=True)
            if k and m == NodeMode.FREE}
    idle = kept_anyway(graph, free)
    if not idle:
        return graph
    modes = [NodeMode.RECOMPUTE if k in idle else m
             for k, m in zip(graph.node_key, graph.node_mode, strict=True)]
    return CostGraph.model_construct(**{**dict(graph), "node_mode": modes})


def extract_step(fun: Callable, *args, argnums: int | Sequence[int] = 0,
                 donate_argnums: int | Sequence[int] = (), name_inputs: bool = False,
                 regions: Sequence[str] = ()) -> CostGraph:
    """The cost graph of the training step ``jax.jit(jax.grad(fun, argnums))`` at
    ``args``: a remat region in every differentiated ``lax.scan``, every checkpoint the
    user wrote and every repeated block of straight-line code (or, with ``regions``, the
    blocks under those name scopes), and what the step holds (one compile per distinct
    region measures its working set). Solving it plans peak budgets;
    ``optiremat.optimize`` is this and a solve. ``name_inputs`` names each layer's input
    inside its checkpoint, so that an offload plan may move the stacked inputs to host
    memory (``client.peak.regions.LAYER_INPUT``)."""
    name = getattr(fun, "__qualname__", getattr(fun, "__name__", ""))
    return step_extraction(fun, args, Step.of(argnums, donate_argnums), name=name,
                           name_inputs=name_inputs, scopes=tuple(regions)).graph
