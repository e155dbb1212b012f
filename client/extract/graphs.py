"""The entry points: a traced function's cost graph, and a training step's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax

import optiremat.client._jax_internals as jx
from optiremat.client.extract.state import (
    Context,
    NamesOnly,
    Ref,
    decide_by_policy,
    widens_stacked_halves,
)
from optiremat.client.extract.tracing import Traced, trace
from optiremat.client.extract.walker import Walker
from optiremat.solver.graph import CostGraph, GraphBuilder, NodeMode
from optiremat.solver.step import StepMemory


def differentiated_inputs(traced: Traced, arguments: Sequence[bool] | None) -> list[bool]:
    """Which inputs get tangents: the ``arguments`` flagged (every float argument
    when None, as ``jax.vjp`` does), never consts."""
    avals = traced.closed.in_avals[traced.num_consts:]
    if arguments is None:
        arguments = [bool(jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)) for a in avals]
    return [False] * traced.num_consts + list(arguments)


@dataclass(frozen=True)
class Extraction:
    graph: CostGraph
    names_by_key: dict[str, str]  # policy key -> checkpoint name, for names graphs
    # A node key standing for several policy keys that must share a decision
    # (every key inside a cond's branches): representative -> the keys.
    key_aliases: dict[str, frozenset[str]] = field(default_factory=dict)


def graph_of_traced(traced: Traced, *, names: bool | NamesOnly = False, name: str = "",
                    step: bool = False, differentiated: Sequence[bool] | None = None,
                    step_memory: StepMemory | None = None) -> Extraction:
    """The cost graph of ``traced``; with ``names``, as ``save_only_these_names`` sees it
    (a ``NamesOnly``: over those names only), one decision per name wherever it is bound.

    By default the whole function is under one ``jax.checkpoint``. With ``step``
    it is differentiated as it stands (``traced`` is a placed function: its
    regions' checkpoints carry ``RegionMarker`` policies): the plan's policy is
    offered the equations of the regions only. ``differentiated`` flags the
    arguments that get tangents (default: every float argument). ``step_memory``
    travels with the graph, which then plans peak budgets.
    """
    traced.check_differentiable()
    nonzeros = differentiated_inputs(traced, differentiated)
    jvp, jvp_consts = jx.jvp_jaxpr(traced.closed, nonzeros)
    b = GraphBuilder(name)
    b.step = step_memory
    offered = NamesOnly() if names is True else names or None
    walker = Walker(b, decide_by_policy if offered is None else offered.decide,
                    None if offered is None else offered.fixed,
                    widen_stacked_halves=step_memory is not None and widens_stacked_halves())
    layout = walker.layout = traced.layout
    # Tangents are split as their primals; constants are whole on every device.
    primal_specs = [None] * traced.num_consts + list(layout.argument_specs)
    tangent_specs = [s for s, nz in zip(primal_specs, nonzeros, strict=True) if nz]
    walker.specs = layout.variable_specs(jvp, [*[None] * len(jvp_consts), *primal_specs,
                                               *tangent_specs])
    b.mesh = layout.device_mesh()
    refs: list[Ref] = []
    for c in jvp_consts:
        aval = jax.typeof(c)
        refs.append(Ref(b.input(layout.value_bytes(aval, None), tuple(aval.shape),
                                str(aval.dtype)), True))
    for aval, spec in zip(traced.closed.in_avals, primal_specs, strict=True):
        refs.append(Ref(b.input(layout.value_bytes(aval, spec), tuple(aval.shape),
                                str(aval.dtype)), True))
    refs.extend(Ref(t, False) for t in walker.tangents.node([], [], sum(nonzeros)))
    top = Context(under_checkpoint=False) if step else Context(decide=walker.decide)
    walker.finish(walker.walk(jvp, refs, top))
    # Equations inside cond branches are offered to the policy too; they appear
    # as fixed nodes whose outputs nothing reads, so the plan's policy knows
    # their keys, and every node sharing such a key takes the same decision.
    for n in walker.branch_nodes:
        b.node(n["primitive"], [], [b.value(0)], key=n["key"], flops=0, mode=n["mode"],
               repeat=n["repeat"], source=n["source"])
    for n in b.nodes:
        if n["key"] in walker.keys_forced_save:
            n["mode"] = NodeMode.SAVE
    if offered is not None:  # a names policy decides by name, whatever its shape
        walker.tie_groups.extend(keys_by_name(walker.names_by_key).values())
    aliases = merge_tie_groups(walker.tie_groups)
    for n in b.nodes:
        for representative, keys in aliases.items():
            if n["key"] in keys:
                n["key"] = representative
    return Extraction(b.build(), dict(walker.names_by_key), aliases)


def keys_by_name(names_by_key: dict[str, str]) -> dict[str, set[str]]:
    """The policy keys of each checkpoint name."""
    keys: dict[str, set[str]] = {}
    for key, name in names_by_key.items():
        keys.setdefault(name, set()).add(key)
    return keys


def merge_tie_groups(groups: Sequence[set[str]]) -> dict[str, frozenset[str]]:
    """Union of overlapping groups; each named by its smallest key."""
    merged: list[set[str]] = []
    for group in groups:
        group = set(group)
        for other in [m for m in merged if m & group]:
            group |= other
            merged.remove(other)
        merged.append(group)
    return {min(g): frozenset(g) for g in merged}


def extract_graph(fun: Callable, *args, **kwargs) -> CostGraph:
    """The cost graph of ``jax.checkpoint(fun)`` differentiated at ``args``.

    Float arguments are differentiated, integer ones are not, as with
    ``jax.grad``. Example::

        >>> import jax.numpy as jnp
        >>> g = extract_graph(lambda x: jnp.sin(jnp.sin(x)).sum(), jnp.ones(4))
        >>> sorted(set(g.node_primitive))
        ['cos', 'reduce_sum', 'sin']
    """
    name = getattr(fun, "__qualname__", getattr(fun, "__name__", ""))
    return graph_of_traced(trace(fun, args, kwargs), name=name).graph
