"""Where a plan puts its remat regions, and the function rebuilt with them.

One ``jax.checkpoint`` around a whole training step leaves the step's peak
where it was: the backward pass recomputes the whole forward pass at once
(measured on a 16-layer ``lax.scan`` stack: 695 MiB of temporaries before and
after cutting residuals from 704 to 54 MiB). A checkpoint around each layer
recomputes one layer at a time and brings the same stack to 74 MiB. So a plan
is a placement: its regions (``client.peak.regions``: the bodies of
differentiated scans, blocks of straight-line code), found by
``client.peak.finding``, each checkpointed with the plan's policy.

``place`` evaluates the function's jaxpr with each region evaluated by its
kind (``Region.place``); a region is met where the finder met it (its path
through call-like equations and its equations there), and must have the same
signature, or the function traced differently from when it was planned.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax

import optiremat.client._jax_internals as jx
from optiremat.client.extract.tracing import Traced, trace
from optiremat.client.interpreter import CONTROL_FLOW
from optiremat.client.peak.block_region import BlockRegion
from optiremat.client.peak.finding import RegionMarker, find_regions, flags_through
from optiremat.client.peak.regions import PlacementError, Policy, Region, called
from optiremat.client.peak.scan_region import (
    LAYER_INPUT,
    ScanRegion,
    check_groups,
    check_layer_groups,
    divisors,
)

if TYPE_CHECKING:
    from optiremat.client.step import Step

__all__ = ["LAYER_INPUT", "BlockRegion", "Placement", "PlacementError", "Region",
           "RegionMarker", "ScanRegion", "TraceCache", "check_groups", "divisors",
           "find_regions", "keeps_barriers", "measured_with_barriers", "place"]


@dataclass
class _Placer:
    policies: Sequence[Policy]
    regions: Sequence[Region]
    groups: Sequence[int]  # per region: 1 checkpoints each layer; k > 1 also k groups of them
    name_inputs: bool = False  # offer each layer's input to the policy (``LAYER_INPUT``)
    # Per region index, where its layers are planned apart: (layers, policy) per group.
    layer_policies: Mapping[int, Sequence[tuple[int, Policy]]] = field(default_factory=dict)
    at: dict[tuple[int, ...], dict[int, Region]] = field(default_factory=dict)
    entered: set[tuple[int, ...]] = field(default_factory=set)

    def __post_init__(self) -> None:
        for r in self.regions:
            self.at.setdefault(r.path, {})[r.start] = r
            self.entered.update(r.path[:k] for k in range(1, len(r.path) + 1))

    def eval(self, jaxpr: jx.Jaxpr, consts: Sequence, args: Sequence,
             differentiated: Sequence[bool], path: tuple[int, ...] = ()) -> list:
        env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        ins_of, _ = flags_through(jaxpr, differentiated)
        here = self.at.get(path, {})

        def read(x):
            return x.val if isinstance(x, jx.Literal) else env[x]

        i = 0
        while i < len(jaxpr.eqns):
            eqn = jaxpr.eqns[i]
            region = here.get(i)
            if region is not None:
                eqns = jaxpr.eqns[i:region.end]
                inputs, outputs = region.boundary(eqns)
                invals = [read(x) for x in inputs]
                split = self.layer_policies.get(region.index)
                if split is not None and isinstance(region, ScanRegion):
                    outs = region.place_layer_groups(eqns, invals, split, self.name_inputs)
                elif split is not None:  # a block with a policy of its own
                    ((_, policy),) = split
                    outs = region.place(eqns, invals, policy, 1, self.name_inputs)
                else:
                    outs = region.place(eqns, invals, self.policies[region.index],
                                        self.groups[region.index], self.name_inputs)
                env.update(zip(outputs, outs, strict=True))
                i = region.end
                continue
            invals = [read(x) for x in eqn.invars]
            flow = CONTROL_FLOW.get(eqn.primitive)
            if flow is not None and flow.entered and (*path, i) in self.entered:
                inner = called(eqn)
                outs = self.eval(inner.jaxpr, inner.consts, invals, ins_of[i], (*path, i))
            else:
                outs = jx.bind_equation(eqn, invals)
            env.update(zip(eqn.outvars, outs, strict=True))
            i += 1
        return [read(x) for x in jaxpr.outvars]


def keeps_barriers(regions: Sequence[Region]) -> bool:
    """Whether a step with these regions is measured under the schedule that keeps
    checkpoints in straight-line code apart from the forward pass (``client.schedule``)."""
    return any(isinstance(r, BlockRegion) for r in regions)


def measured_with_barriers(regions: Sequence[Region], schedule: str) -> bool:
    """Whether a plan for ``schedule`` (``optimize(..., schedule=)``) is measured with
    checkpoints' barriers kept: where it has blocks and is for a compile that keeps them.
    A plan for this process is measured as this process compiles."""
    return schedule == "barriers_kept" and keeps_barriers(regions)


def place(closed: jx.ClosedJaxpr, args: Sequence, regions: Sequence[Region],
          policies: Sequence[Policy], differentiated: Sequence[bool],
          groups: Sequence[int] | None = None, name_inputs: bool = False,
          scopes: Sequence[str] = (),
          layer_policies: Mapping[int, Sequence[tuple[int, Policy]]] | None = None) -> list:
    """Evaluate ``closed`` at ``args`` with each of the planned ``regions`` checkpointed
    by its policy (and, where ``groups`` says k > 1, in k rematerialised groups of
    layers); ``differentiated`` flags the inputs that get tangents and ``scopes`` names
    the blocks, as when the regions were found. With ``name_inputs``, each layer's input
    is named ``LAYER_INPUT`` inside its checkpoint, so that the policy is offered it (to
    offload it).

    The regions are found again in ``closed`` (a trace of its own may differ outside
    them: a value closed over from an enclosing trace is an input there, a constant
    here) and must be the planned ones, in order, with the same signatures."""
    groups = [1] * len(regions) if groups is None else list(groups)
    if not len(policies) == len(groups) == len(regions):
        raise ValueError(f"{len(regions)} regions but {len(policies)} policies and "
                         f"{len(groups)} group counts")
    layer_policies = dict(layer_policies or {})
    for region, k in zip(regions, groups, strict=True):
        check_groups(region, k)
        if region.index in layer_policies:
            if k != 1:
                raise PlacementError(f"region {region.index} is nested in {k} groups: its "
                                     "layers cannot also be planned apart")
            check_layer_groups(region, layer_policies[region.index])
    here = _regions_in(closed, differentiated, scopes)
    if len(here) != len(regions):
        raise PlacementError(
            f"the plan has {len(regions)} regions but the function has {len(here)}: it "
            "traced differently from when it was planned; plan again for these arguments")
    for planned, met in zip(regions, here, strict=True):
        if met.signature != planned.signature or type(met) is not type(planned):
            raise PlacementError(
                f"the {met.describe()} does not match region {planned.index} of the plan "
                f"(the {planned.describe()}): shapes or structure differ; plan again for "
                "these arguments")
    placer = _Placer(policies, here, groups, name_inputs, layer_policies)
    return placer.eval(closed.jaxpr, closed.consts, args, differentiated)


# The regions of the last few jaxprs placed: a step's jaxpr is placed once per policy its
# calibration and refinement compile, and finding its regions walks it whole.
_FOUND: dict[int, tuple[jx.Jaxpr, tuple, list[Region]]] = {}
_FOUND_SIZE = 16


def _regions_in(closed: jx.ClosedJaxpr, differentiated: Sequence[bool],
                scopes: Sequence[str]) -> list[Region]:
    key = (tuple(differentiated), tuple(scopes))
    cached = _FOUND.get(id(closed.jaxpr))
    if cached is not None and cached[0] is closed.jaxpr and cached[1] == key:
        return cached[2]
    found = find_regions(closed, differentiated, scopes)
    if len(_FOUND) >= _FOUND_SIZE:
        _FOUND.pop(next(iter(_FOUND)))
    _FOUND[id(closed.jaxpr)] = (closed.jaxpr, key, found)
    return found


@dataclass(frozen=True)
class Placement:
    """Where a peak plan checkpoints: its regions and the step they were found in."""

    regions: tuple[Region, ...]
    differentiated: tuple[bool, ...]  # per flattened argument, as the step differentiates
    step: Step
    name_inputs: bool = False  # layer inputs offered to the policy (offload plans)
    scopes: tuple[str, ...] = ()  # the name scopes its blocks were found by (regions=)

    def apply(self, fun: Callable, policy: Policy, groups: Sequence[int] | None = None,
              layer_policies: Mapping[int, Sequence[tuple[int, Policy]]] | None = None
              ) -> Callable:
        """``fun`` with every region checkpointed by ``policy`` (in ``groups[r]``
        rematerialised groups of layers where that is more than 1, and region r's layers
        in groups of their own policies where ``layer_policies[r]`` says): same signature
        and outputs. Like ``jax.jit``, ``fun`` is traced once per structure and types of its
        arguments and the jaxpr reused (not where it closes over another trace's values)."""
        jaxprs = TraceCache(fun)

        @functools.wraps(fun)
        def placed(*args, **kwargs):
            traced = jaxprs.traced(args, kwargs)
            if len(traced.flat_args) != len(self.differentiated):
                raise PlacementError(
                    f"the plan was made for {len(self.differentiated)} array arguments, the "
                    f"function got {len(traced.flat_args)}")
            return self.evaluate(traced, jax.tree_util.tree_leaves((args, kwargs)), policy,
                                 groups, layer_policies)

        return placed

    def evaluate(self, traced: Traced, leaves: Sequence, policy: Policy,
                 groups: Sequence[int] | None = None,
                 layer_policies: Mapping[int, Sequence[tuple[int, Policy]]] | None = None
                 ) -> Any:
        """``traced``'s function at the flat arguments ``leaves`` with every region
        checkpointed by ``policy``: its outputs, as the function returns them."""
        closed = jx.ClosedJaxpr(traced.open_jaxpr, traced.consts)
        out = place(closed, leaves, self.regions, [policy] * len(self.regions),
                    self.differentiated, groups, self.name_inputs, self.scopes,
                    layer_policies)
        return jax.tree_util.tree_unflatten(traced.out_tree, out)


class TraceCache:
    """``fun`` traced once per tree structure and types (``jax.typeof``) of its arguments."""

    def __init__(self, fun: Callable) -> None:
        self.fun = fun
        self._traced: dict[Any, Traced] = {}

    def traced(self, args: Sequence, kwargs: dict) -> Traced:
        leaves, tree = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))
        key = (tree, tuple(jax.typeof(x) for x in leaves))
        found = self._traced.get(key)
        if found is None:
            found = trace(self.fun, args, kwargs)
            # A jaxpr holding a value of an enclosing trace (a closed-over tracer) is that
            # trace's alone: reused in another it would leak the tracer.
            if not any(isinstance(c, jax.core.Tracer) for c in found.consts):
                self._traced[key] = found
        return found
