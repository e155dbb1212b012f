"""cond: branches under a fixed decision, with their residuals merged as JAX merges them.

A stateless policy gives every branch equation the decision of its key. Tied
graphs offer the solver two configurations per cond, tied to one decision
together with every key inside the branches: all saved (the residuals merged
across branches as JAX merges them) or all recomputed (the staged branches
rerun from the operands). Each branch is summarised by walking it alone
(``BranchSummary``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jax
import numpy as np

import optiremat.client._jax_internals as jx
from optiremat.client.extract.state import (
    Context,
    Decide,
    ExtractionError,
    Ref,
    fixed_recompute,
    fixed_save,
    primal_mode,
)
from optiremat.client.interpreter import CONTROL_FLOW
from optiremat.client.primitives import shape
from optiremat.solver.graph import CostGraph, NodeMode
from optiremat.solver.semantics import evaluate

if TYPE_CHECKING:  # the walker's rule table names cond_rule: walker.py imports this module
    from optiremat.client.extract.walker import Walker


def cond_rule(walker: Walker, eqn, refs: Sequence[Ref], ctx: Context) -> list[Ref]:
    """The staged cond reads merged branch residuals, or recomputes its branches.

    A stateless policy gives every branch equation the decision of its key.
    Tied graphs offer the solver two configurations per cond, tied to one
    decision together with every key inside the branches: all saved (the
    residuals merged across branches as JAX merges them) or all recomputed
    (the staged branches rerun from the operands). Names graphs fix the
    branches to what a names policy does: names saved, the rest recomputed.
    Outside every checkpoint (a plan's step graph) jax.vjp keeps what the
    staged branches read: the branches are saved and no policy is offered them.

    (Long on purpose: one primitive's rule, each branch's walk and the merge of their
    residuals reading the same refs.)
    """
    index, ops = refs[0], refs[1:]
    if not index.known:
        return walker.staged(refs, len(eqn.outvars))
    reject_nested_control_flow(eqn)
    unoffered = not ctx.under_checkpoint
    tied = walker.branch_decide is None and not unoffered
    varying = frozenset().union(*(r.varying for r in refs))
    fixed: Decide = fixed_save if tied or unoffered or walker.branch_decide is None \
        else walker.branch_decide
    saved = [BranchSummary.of(b.jaxpr, ops, walker.alone(fixed))
             for b in eqn.params["branches"]]
    out_known = [all(b.out_known[k] for b in saved) for k in range(len(eqn.outvars))]
    sinks = [None, *(k for k, known in enumerate(out_known) if known)]
    source = jx.source_of(eqn)

    # JAX merges residuals across branches by type: the i-th residual of a
    # given aval in any branch shares one slot.
    slot_of: dict[tuple[str, int], int] = {}
    slot_avals: list = []
    for b in saved:
        for tag, aval in b.residual_tags():
            if tag not in slot_of:
                slot_of[tag] = len(slot_avals)
                slot_avals.append(aval)

    token: int | None = None
    if tied:
        recomputed = [BranchSummary.of(b.jaxpr, ops, walker.alone(fixed_recompute))
                      for b in eqn.params["branches"]]
        operands: set[int] = set()
        flops = 0
        for b in recomputed:
            ops_b, flops_b = b.needs_all(sinks)
            operands |= {v for i in ops_b if (v := ops[i].value) is not None}
            flops = max(flops, flops_b)
        key = f"cond-branches:{walker.next_cond}"
        walker.next_cond += 1
        walker.tie_groups.append({key, *(k for b in saved for k in b.keys)})
        slots = walker.virtual("cond_branches", sorted(operands), slot_avals, varying,
                             ctx, mode=NodeMode.FREE, flops=flops,
                             source=source, key=key)
        # A zero-byte output every reader takes, so that recomputing the
        # branches is charged even when no residual slot exists.
        token = walker.builder.value(0, (), "token")
        walker.builder.nodes[-1]["outputs"].append(token)
    elif unoffered:
        slots = walker.virtual("cond_residuals", [], slot_avals, varying, ctx,
                             mode=NodeMode.SAVE, source=source) if slot_avals else []
    else:
        for b in saved:
            walker.branch_nodes.extend(b.keyed_nodes)
            walker.names_by_key.update(b.names_by_key)
            walker.keys_forced_save.update(b.keys_forced_save)
        slots = walker.virtual("cond_residuals", [], slot_avals, varying, ctx,
                             mode=NodeMode.SAVE, source=source) if slot_avals else []

    def needs(sink: int | None) -> tuple[list[int], int]:
        vals = {v for v in (index.value, token) if v is not None}
        flops = 0
        for b in saved:
            res, operands, f = b.needs(sink)
            vals |= {slots[slot_of[t]] for t in res}
            vals |= {v for i in operands if (v := ops[i].value) is not None}
            flops = max(flops, f)
        return sorted(vals), flops

    # Work a names policy makes the staged branches redo carries a key:
    # everything_saveable, the FLOPs baseline, would have saved it.
    tangent_vals, tangent_flops = needs(None)
    tangent_outs: list[Ref] = []
    if not all(out_known):
        (marker,) = walker.virtual("cond_backward", tangent_vals,
                                 [jax.core.ShapedArray((), np.bool_)], varying, ctx,
                                 flops=tangent_flops,
                                 key="" if tied or unoffered else "cond_backward",
                                 source=source)
        tangent_outs = walker.staged([r for r in ops if not r.known],
                                   len(out_known) - sum(out_known), [marker])
    results = []
    for k, var in enumerate(eqn.outvars):
        if not out_known[k]:
            results.append(tangent_outs.pop(0))
            continue
        vals, flops = needs(k)
        (v,) = walker.virtual("cond_output", vals, [var.aval], varying, ctx,
                            flops=max(flops - tangent_flops, 0), mode=primal_mode(ctx),
                            key="" if tied or unoffered else "cond_output", source=source,
                            out_vars=[var])
        results.append(Ref(v, True, varying))
    return results


def reject_nested_control_flow(eqn) -> None:
    for branch in eqn.params["branches"]:
        for e in branch.jaxpr.eqns:
            flow = CONTROL_FLOW.get(e.primitive)
            if flow is not None and flow.refused_in_cond:
                raise ExtractionError(
                    f"{e.primitive.name} inside a cond branch ({jx.source_of(eqn)}) is not "
                    "supported: its residuals could not be predicted exactly")


@dataclass
class BranchSummary:
    """One cond branch, partially evaluated under the fixed branch decision."""

    graph: CostGraph
    operand_inputs: dict[int, int]  # local input value position -> operand index
    out_refs: list[Ref]
    out_known: list[bool]
    avals: list  # per local value
    keyed_nodes: list[dict] = field(default_factory=list)  # equations the policy is offered
    keys_forced_save: set[str] = field(default_factory=set)
    names_by_key: dict[str, str] = field(default_factory=dict)
    _tag_of: dict[int, tuple[str, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, jaxpr: jx.Jaxpr, ops: Sequence[Ref], walker: Walker) -> BranchSummary:
        """``jaxpr`` walked alone by ``walker`` (``Walker.alone``) on ``ops``."""
        b, decide = walker.builder, walker.decide
        ins, operand_inputs = [], {}
        for i, (ref, var) in enumerate(zip(ops, jaxpr.invars, strict=True)):
            if not ref.known:
                ins.append(Ref(walker.tangents.node([], [], 1)[0], False))
                continue
            v = b.input(walker.layout.value_bytes(var.aval, None), shape(var),
                        str(getattr(var.aval, "dtype", "")))
            operand_inputs[v] = i
            ins.append(Ref(v, True))
        outs = walker.walk(jaxpr, ins, Context(decide=decide))
        walker.finish(outs)
        keyed = [n for n in b.nodes if n["key"]]
        forced = {n["key"] for n in keyed if n["mode"] == NodeMode.SAVE}
        avals = [jax.core.ShapedArray(tuple(shape), jax.numpy.dtype(dtype))
                 for _, shape, dtype in b.values]
        return cls(b.build(), operand_inputs, outs, [r.known for r in outs], avals,
                   keyed_nodes=keyed, keys_forced_save=forced,
                   names_by_key=dict(walker.names_by_key))

    @property
    def keys(self) -> set[str]:
        return {n["key"] for n in self.keyed_nodes}

    def _sink(self, sink: int | None) -> list[int]:
        if sink is None:
            return list(self.graph.backward_reads)
        ref = self.out_refs[sink]
        return [] if ref.value is None else [ref.value]

    def _residuals(self, sink: int | None):
        g = self.graph.model_copy(update={"backward_reads": self._sink(sink)})
        ev = evaluate(g, [True] * g.num_nodes)
        produced = [v for v in ev.residuals if g.producer[v] is not None]
        operands = sorted(self.operand_inputs[v] for v in ev.residuals if v in self.operand_inputs)
        return produced, operands, ev.backward_flops

    def residual_order(self) -> list[int]:
        """Residual values in JAX's order: read by the backward pass, then outputs."""
        order, _, _ = self._residuals(None)
        for k in range(len(self.out_refs)):
            if self.out_known[k]:
                for v in self._residuals(k)[0]:
                    if v not in order:
                        order.append(v)
        return order

    def residual_tags(self) -> list[tuple[tuple[str, int], object]]:
        counts: dict[str, int] = {}
        tags = []
        for v in self.residual_order():
            text = f"{self.graph.value_dtype[v]}{self.graph.value_shape[v]}"
            n = counts.get(text, 0)
            counts[text] = n + 1
            self._tag_of[v] = (text, n)
            tags.append(((text, n), self.avals[v]))
        return tags

    def needs_all(self, sinks: Sequence[int | None]) -> tuple[set[int], int]:
        """Operands and FLOPs of rebuilding every sink at once."""
        reads = sorted({v for sink in sinks if sink is None or self.out_known[sink]
                        for v in self._sink(sink)})
        g = self.graph.model_copy(update={"backward_reads": reads})
        ev = evaluate(g, [False] * g.num_nodes)
        return {self.operand_inputs[v] for v in ev.residuals if v in self.operand_inputs}, \
            ev.backward_flops

    def needs(self, sink: int | None) -> tuple[list[tuple[str, int]], list[int], int]:
        if sink is not None and not self.out_known[sink]:
            return [], [], 0
        produced, operands, flops = self._residuals(sink)
        return [self._tag_of[v] for v in produced], operands, flops
