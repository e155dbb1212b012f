"""Where a traced function's remat regions are (``client.peak.regions``).

One walk over the function's jaxpr, through call-like equations (``jit``,
``closed_call``; ``custom_jvp_call``'s outer call is not entered: JAX
differentiates its rule, not its body), tracking which values carry a tangent.
At each jaxpr it meets, in program order:

* a differentiated ``lax.scan`` is a ``ScanRegion``;
* a checkpoint the user wrote around differentiated code (and no scan) is a
  ``BlockRegion`` whose policy becomes the plan's;
* with ``scopes``, the equations under each named scope are a block each;
  without, the repeated units of straight-line code (``client.peak.repeats``):
  layers a Python loop unrolled, each a block.

A scan inside a ``cond`` or ``while_loop`` (run a data-dependent number of
times) cannot be given a static place: an error names it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import optiremat.client._jax_internals as jx
from optiremat.client.cost_model import aval_bytes
from optiremat.client.interpreter import CONTROL_FLOW, Analysis, ControlFlow, interpret
from optiremat.client.peak.block_region import BlockRegion
from optiremat.client.peak.regions import (
    PlacementError,
    Region,
    called,
    differentiated_outputs,
    eqn_signature,
    interface,
)
from optiremat.client.peak.repeats import crossing_bytes, repeated_runs
from optiremat.client.peak.scan_region import ScanRegion
from optiremat.solver.step import RegionFound

# What makes a block worth checkpointing: it holds a matmul or a convolution.
ANCHORS = {"dot_general", "conv_general_dilated"}
# How many of the scopes seen an error lists.
SCOPES_LISTED = 24


@dataclass(frozen=True)
class RegionMarker:
    """The policy of a region while it is extracted: the walker recognises its
    checkpoints by this object and leaves their equations to the solver."""

    index: int

    def __call__(self, prim, *avals, **params):  # never consulted: extraction only traces
        return jx.Recompute


def is_scan(eqn) -> bool:
    """Whether ``eqn`` runs its body once per layer (a ``lax.scan``)."""
    flow = CONTROL_FLOW.get(eqn.primitive)
    return flow is not None and flow.layers


def is_scan_region(eqn, ins: Sequence[bool]) -> bool:
    """A differentiated scan that runs: a scan of length 0 is left as it is, for the
    extraction to refuse with its place in the user's code."""
    return is_scan(eqn) and any(ins) and int(eqn.params["length"]) > 0


def subjaxprs(eqn) -> list[jx.Jaxpr]:
    """The jaxprs an equation runs (call bodies, branches, loop bodies)."""
    found = []
    for param in eqn.params.values():
        for p in param if isinstance(param, tuple | list) else (param,):
            if isinstance(p, jx.ClosedJaxpr):
                found.append(p.jaxpr)
            elif isinstance(p, jx.Jaxpr):
                found.append(p)
    return found


def holds(eqn, primitives: set[str]) -> bool:
    """Whether ``eqn`` is, or runs, one of ``primitives``."""
    if eqn.primitive.name in primitives:
        return True
    return any(holds(e, primitives) for sub in subjaxprs(eqn) for e in sub.eqns)


def holds_scan(eqn) -> bool:
    """Whether a jaxpr ``eqn`` runs holds a scan, at any depth."""
    return any(is_scan(e) or holds_scan(e)
               for sub in subjaxprs(eqn) for e in sub.eqns)


class _Differentiated(Analysis[bool]):
    """A flag per value: whether it carries a tangent (a literal, or a value made by no
    equation here, does not)."""

    def read(self, env: dict, x: Any) -> bool:
        return False if isinstance(x, jx.Literal) else env.get(x, False)

    def equation(self, eqn: Any, ins: list[bool], env: dict, scope: Any) -> list[bool]:
        return differentiated_outputs(eqn, ins)

    def control(self, flow: ControlFlow, eqn: Any, ins: list[bool]) -> list[bool]:
        return flow.differentiated(self, eqn, ins)


def flags_through(jaxpr: jx.Jaxpr, flags_in: Sequence[bool]) -> tuple[list[list[bool]], dict]:
    """Per equation, which of its inputs carry a tangent; and per variable."""
    analysis = _Differentiated()
    _, env = interpret(analysis, jaxpr, flags_in)
    return [[analysis.read(env, x) for x in eqn.invars] for eqn in jaxpr.eqns], env


@dataclass
class _Finder:
    scopes: tuple[str, ...]
    found: list[Region] = field(default_factory=list)
    matched: set[str] = field(default_factory=set)
    seen: set[str] = field(default_factory=set)

    def walk(self, jaxpr: jx.Jaxpr, flags_in: Sequence[bool], path: tuple[int, ...],
             inside: str | None, prefix: str = "") -> None:
        ins_of, env = flags_through(jaxpr, flags_in)
        claims = {} if inside is not None else self.claims(jaxpr, ins_of, prefix)
        last_read = last_reads(jaxpr)
        i = 0
        while i < len(jaxpr.eqns):
            if i in claims:
                end, how = claims[i]
                self.found.append(self.block(jaxpr, i, end, how, path, env, last_read))
                i = end
                continue
            eqn, ins = jaxpr.eqns[i], ins_of[i]
            flow = CONTROL_FLOW.get(eqn.primitive)
            if flow is None:
                pass  # a plain equation: no region inside
            elif flow.entered:
                self.walk(called(eqn).jaxpr, ins, (*path, i), inside,
                          _joined(prefix, str(eqn.source_info.name_stack)))
            elif is_scan_region(eqn, ins):
                if inside is not None:
                    raise PlacementError(
                        f"a differentiated lax.scan at {jx.source_of(eqn)} sits inside a "
                        f"{inside}: its layers cannot be given remat regions. Move the scan "
                        f"out of the {inside}, or plan with memory='residuals'.")
                self.found.append(ScanRegion.of(len(self.found), path, i, eqn, ins))
            elif flow.unplaceable_parent is not None and any(ins):
                for sub in subjaxprs(eqn):
                    self.walk(sub, [True] * len(sub.invars), (*path, i),
                              flow.unplaceable_parent)
            i += 1

    def block(self, jaxpr: jx.Jaxpr, start: int, end: int, how: RegionFound,
              path: tuple[int, ...], env: dict, last_read: dict) -> BlockRegion:
        eqns = jaxpr.eqns[start:end]
        inputs, outputs = interface(eqns, {v for v, u in last_read.items() if u >= end})
        return BlockRegion(index=len(self.found), path=path, start=start, end=end,
                           source=_user_source(eqns),
                           differentiated=tuple(bool(env.get(v, False)) for v in inputs),
                           how=how, eqns=tuple(eqns), inputs=tuple(inputs),
                           outputs=tuple(outputs))

    def claims(self, jaxpr: jx.Jaxpr, ins_of: Sequence[Sequence[bool]],
               prefix: str) -> dict[int, tuple[int, RegionFound]]:
        """The blocks of this jaxpr: start -> (end, how it was found)."""
        eqns = jaxpr.eqns
        claims: dict[int, tuple[int, RegionFound]] = {}
        barrier = [False] * len(eqns)
        for i, eqn in enumerate(eqns):
            flow = CONTROL_FLOW.get(eqn.primitive)
            barrier[i] = (flow is not None and flow.barrier) or holds_scan(eqn)
            if flow is not None and flow.checkpoint:
                user_wrote = not isinstance(eqn.params.get("policy"), RegionMarker)
                if user_wrote and any(ins_of[i]) and not holds_scan(eqn):
                    claims[i] = (i + 1, RegionFound.CHECKPOINT)
        if self.scopes:
            spans = self.scoped(eqns, prefix, barrier)
            how = RegionFound.SCOPE
        else:
            spans = self.repeated(jaxpr, barrier)
            how = RegionFound.REPEATED
        for start, end in spans:
            if any(any(ins_of[k]) for k in range(start, end)):
                claims[start] = (end, how)
        return claims

    def repeated(self, jaxpr: jx.Jaxpr, barrier: Sequence[bool]) -> list[tuple[int, int]]:
        """Repeated units: calls of one function of the user's from several places (a
        U-Net's blocks), then, in what is left, equations alike to the byte (a loop's
        layers), then of the same structure on other shapes."""
        eqns = jaxpr.eqns
        anchored = [not barrier[i] and holds(e, ANCHORS) for i, e in enumerate(eqns)]
        if sum(anchored) < 2:
            return []
        crossing, shared = _crossing(jaxpr), _shared_scopes(eqns)
        units = called_blocks(eqns, barrier, anchored)
        taken = list(barrier)
        for start, end in units:
            taken[start:end] = [True] * (end - start)
        for signature in (eqn_signature, _structure):
            signatures: list[object] = [("taken", i) if taken[i] else signature(e)
                                        for i, e in enumerate(eqns)]
            anchors = [a and not t for a, t in zip(anchored, taken, strict=True)]
            free = [not t for t in taken]
            for run in repeated_runs(signatures, anchors, crossing, free, shared):
                for start, end in run.units():
                    units.append((start, end))
                    taken[start:end] = [True] * (end - start)
        return sorted(units)

    def scoped(self, eqns: Sequence, prefix: str,
               barrier: Sequence[bool]) -> list[tuple[int, int]]:
        """Consecutive equations under the same instance of a named scope."""
        spans: list[tuple[int, int]] = []
        current: tuple[str, int] | None = None
        for i, eqn in enumerate(eqns):
            name = _joined(prefix, str(eqn.source_info.name_stack))
            if name:
                self.seen.add("/".join(name.split("/")[:2]))
            instance = None if barrier[i] else self.instance(name)
            if current is not None and instance != current[0]:
                spans.append((current[1], i))
                current = None
            if instance is not None and current is None:
                current = (instance, i)
        if current is not None:
            spans.append((current[1], len(eqns)))
        return spans

    def instance(self, name: str) -> str | None:
        """The scope instance ``name`` is under, for the first scope that matches it:
        ``layers_`` matches ``model/layers_3/mlp`` as ``model/layers_3``."""
        padded = "/" + name
        for scope in self.scopes:
            at = padded.find("/" + scope.strip("/"))
            if at < 0:
                continue
            self.matched.add(scope)
            end = padded.find("/", at + 1 + len(scope.strip("/")))
            return padded[1:] if end < 0 else padded[1:end]
        return None


def called_blocks(eqns: Sequence, barrier: Sequence[bool],
                  anchored: Sequence[bool]) -> list[tuple[int, int]]:
    """Blocks that are calls of one function of the user's from several places in its code
    (a U-Net's block function, once per level, on other shapes each time).

    Down the traceback from the outermost frame, through calls that hold every anchor (the
    loss calling the model), to the first depth where the anchors part: there, the calls
    of a function outside the libraries made two or more times, each holding two anchors
    or more and the same structure. Calls one after another from one line (a Python
    loop's) read as one call there, whose inner calls are not looked at: loops are left
    to the patterns, as are helpers of one matmul. ``anchored``: per equation, whether it
    holds an anchor outside a barrier."""
    frames = [() if barrier[i] else tuple(reversed(jx.frames_of(e)))
              for i, e in enumerate(eqns)]
    # How many frames, lines included, each equation shares with the one before it.
    above = [0] + [len(os.path.commonprefix([x, y])) for x, y in zip(frames, frames[1:],
                                                                      strict=False)]
    for depth in range(max(map(len, frames), default=0)):
        spans: list[tuple[tuple[str, str] | None, int, int]] = []  # (function, start, end)
        for i, f in enumerate(frames):
            function = (f[depth][0], f[depth][2]) if len(f) > depth else None
            if (spans and function is not None and spans[-1][0] == function
                    and above[i] >= depth and spans[-1][2] == i):
                spans[-1] = (function, spans[-1][1], i + 1)
            else:
                spans.append((function, i, i + 1))
        parts = [(function, a, b) for function, a, b in spans if any(anchored[a:b])]
        if len(parts) == 1 and parts[0][0] is not None:
            continue  # one call holds every anchor: look inside it
        calls: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for function, a, b in parts:
            if function is not None and not _in_library(function[0]):
                calls.setdefault(function, []).append((a, b))
        return sorted(span for found in calls.values()
                      if _alike_calls(eqns, anchored, found) for span in found)
    return []


def _alike_calls(eqns: Sequence, anchored: Sequence[bool],
                 spans: list[tuple[int, int]]) -> bool:
    """Whether ``spans`` are two or more calls of one structure, each of two anchors or more."""
    structures = {tuple(_structure(e) for e in eqns[a:b]) for a, b in spans}
    first, end = spans[0]
    return len(spans) >= 2 and len(structures) == 1 and sum(anchored[first:end]) >= 2


def _user_source(eqns: Sequence) -> str:
    """Where a block is in the user's code, in words a user reads: the line of the first
    equation traced from the user's own code (the innermost frame outside installed
    libraries: an Equinox layer's first equation is in Equinox's LayerNorm, a penzai
    block's every operation in its named-axis wrappers), with the name scope all its
    equations run under, if any (a Flax module's path: ``h_2``)."""
    line, scope = _block_line(eqns), _common_scope(eqns)
    return f"{line} in {scope}" if scope else line


def _block_line(eqns: Sequence) -> str:
    return next((_line(frame) for e in eqns for frame in jx.frames_of(e)
                 if not _in_library(frame[0])), None) or jx.source_of(eqns[0])


def _line(frame: tuple[str, int, str]) -> str:
    file, line, function = frame
    return f"{os.path.basename(file)}:{line} ({function})"


def _in_library(file: str) -> bool:
    return any(part in file for part in _LIBRARIES)


def _common_scope(eqns: Sequence) -> str:
    """The name scope every equation of ``eqns`` runs under (a module's path)."""
    stacks = [str(e.source_info.name_stack).split("/") for e in eqns]
    common = os.path.commonprefix(stacks)
    return "/".join(common)


def _numbered(regions: list[Region]) -> list[Region]:
    """Blocks at the same place in the user's code (a Python loop's layers: the same line
    each time) told apart by their place among them: "..., block 3 of 6"."""
    same: dict[str, list[int]] = {}
    for i, r in enumerate(regions):
        if isinstance(r, BlockRegion):
            same.setdefault(_block_line(r.eqns), []).append(i)
    numbered = list(regions)
    for indices in same.values():
        for k, i in enumerate(indices if len(indices) > 1 else []):
            numbered[i] = replace(regions[i], source=f"{regions[i].source}, block {k + 1} "
                                                     f"of {len(indices)}")
    return numbered


_LIBRARIES = ("site-packages", "dist-packages")


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix and name else prefix or name


def _structure(eqn) -> tuple:
    """What an equation does, whatever the sizes: its primitive on operands of these
    ranks and types (a U-Net's down blocks at each level)."""
    avals = [x.aval for x in eqn.invars]
    return (eqn.primitive.name, tuple(len(getattr(a, "shape", ())) for a in avals),
            tuple(str(getattr(a, "dtype", "")) for a in avals))


def _shared_scopes(eqns: Sequence) -> list[int]:
    """Per boundary between equations, how many name scopes the equations either side of
    it share: 0 between two modules' calls, more inside one (``h_1/attn | h_1/mlp``: 1)."""
    stacks = [str(e.source_info.name_stack).split("/") for e in eqns]
    return [0, *(len(os.path.commonprefix([a, b])) if a != [""] else 0
                 for a, b in zip(stacks, stacks[1:], strict=False)), 0]


def _crossing(jaxpr: jx.Jaxpr) -> list[int]:
    """Per boundary between equations, the bytes made before it and read after it."""
    defined: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.outvars:
            defined[v] = i
    last = last_reads(jaxpr)
    made = [v for v in defined if v in last]
    return crossing_bytes([defined[v] for v in made], [last[v] for v in made],
                          [aval_bytes(v.aval) for v in made], len(jaxpr.eqns))


def last_reads(jaxpr: jx.Jaxpr) -> dict:
    """Per variable, the last equation that reads it (``len(eqns)``: an output)."""
    last: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for x in eqn.invars:
            if not isinstance(x, jx.Literal):
                last[x] = i
    for x in jaxpr.outvars:
        if not isinstance(x, jx.Literal):
            last[x] = len(jaxpr.eqns)
    return last


def find_regions(closed: jx.ClosedJaxpr, differentiated: Sequence[bool],
                 scopes: Sequence[str] = ()) -> list[Region]:
    """The regions of a traced function whose inputs ``differentiated`` get tangents,
    in program order; with ``scopes`` (name-stack prefixes: a Flax module path, a
    ``jax.named_scope``), the blocks are those scopes' equations instead of the
    repeated ones.

    Raises PlacementError for a differentiated scan that cannot be placed (one inside
    a ``cond`` or ``while_loop``), and for a scope that names no equation.
    """
    finder = _Finder(tuple(scopes))
    finder.walk(closed.jaxpr, differentiated, (), None)
    missing = [s for s in scopes if s not in finder.matched]
    if missing:
        seen = sorted(finder.seen)
        listed = ", ".join(seen[:SCOPES_LISTED]) + (" ..." if len(seen) > SCOPES_LISTED else "")
        raise PlacementError(
            f"regions={list(missing)} names no equation of the function: no name scope "
            f"starts with it. Scopes seen: {listed or 'none (the function names no scope)'}")
    return _numbered(finder.found)


def why_no_regions(closed: jx.ClosedJaxpr, differentiated: Sequence[bool]) -> str:
    """Why a function has no region to checkpoint, and what would help: for an error
    refusing a budget below its no-remat peak."""
    for eqn in _all_eqns(closed.jaxpr):
        flow = CONTROL_FLOW.get(eqn.primitive)
        if flow is not None and flow.no_regions_because is not None:
            return flow.no_regions_because
    return ("it has no differentiated lax.scan, no checkpoint of yours and no repeated "
            "block holding a matmul: write the layers as lax.scan (nn.scan, nnx.scan, "
            "eqx scans), wrap each in jax.checkpoint, or name them with "
            "optimize(..., regions=[scope])")


def _all_eqns(jaxpr: jx.Jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in subjaxprs(eqn):
            yield from _all_eqns(sub)
