"""The checkpointing MILP as backend-neutral data.

``semantics.evaluate`` is a least fixpoint: a value is needed when the backward
pass reads it, a recomputed node runs when one of its outputs is needed, and a
running node needs its inputs. Written as implications over 0-1 variables,

* ``needed(out) -> active(n) or save(n)``  (active(n) >= needed(out) - save(n))
* ``active(n) -> needed(in)``              (needed(in) >= active(n))
* ``needed(carry_in) -> needed(carry_out)``
* ``needed(v) and save(producer) -> residual(v)``  (residual >= needed + save - 1)

every constraint is a clause. One more clause, ``needed(v) -> residual(v) or
active(producer)``, follows from these for 0-1 values but not for fractions: a
needed value must be paid for, in bytes or in its producer's FLOPs. Without it
the LP relaxation prices a half-needed value at nothing, and CP-SAT's bound on
the untied 96-layer stack stayed at 0; with it that bound is within 0.1% of
the optimum (bench/solver.py). The clauses only push variables up, while the
objective (FLOPs of active nodes) and the budget (bytes of residuals) push them
down, so at any optimum the auxiliary variables can be lowered to the exact
fixpoint of the decisions without loss: the MILP's optimum is the optimum of
``evaluate``, and the auxiliaries may even be continuous in an LP-based solver.

``reduction.bounds`` fixes what no decision can change before anything is
built: values that are never needed have no variable, values needed by every
plan are the constant 1, and FLOPs of nodes that run in every plan (forced
recomputes read by the backward pass) drop out of the objective, which is
therefore the recompute FLOPs of the plan up to a constant.

Both sums are divided by the gcd of their coefficients; the budget becomes
``floor((budget - always-residual bytes) / gcd)``, an exact rewrite for integers
that keeps the numbers a floating-point solver sees small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd

from optiremat.solver.graph import CostGraph, NodeMode
from optiremat.solver.reduction import bounds, dominated_choices
from optiremat.solver.semantics import Evaluation, baseline_backward_flops, evaluate

# (variable index, polarity): (3, True) is x3, (3, False) is "not x3".
Lit = tuple[int, bool]


@dataclass(frozen=True)
class ScaledSum:
    """``offset + scale * sum(coef * x[var])``, exact integers in raw units."""

    terms: tuple[tuple[int, int], ...]  # (variable index, coefficient in scaled units)
    scale: int
    offset: int

    @property
    def max_scaled(self) -> int:
        return sum(coef for _, coef in self.terms)

    def raw(self, scaled: int) -> int:
        return self.offset + self.scale * scaled

    def cap(self, raw_limit: int) -> int:
        """Largest scaled value whose raw value stays within ``raw_limit``."""
        return (raw_limit - self.offset) // self.scale


@dataclass(frozen=True)
class Formulation:
    """Variables ``[0, num_decisions)`` are save decisions, the rest auxiliary 0-1."""

    var_names: tuple[str, ...]
    num_decisions: int
    decision_nodes: tuple[tuple[int, ...], ...]  # free node positions a decision sets
    decision_keys: tuple[str, ...]  # policy key of a tied decision, "" for a per-node one
    clauses: tuple[tuple[Lit, ...], ...]
    recompute_flops: ScaledSum
    residual_bytes: ScaledSum
    # What each auxiliary variable stands for: (variable, value or node position).
    needed_vars: tuple[tuple[int, int], ...] = ()
    active_vars: tuple[tuple[int, int], ...] = ()
    residual_vars: tuple[tuple[int, int], ...] = ()

    def node_saves(self, graph: CostGraph, decisions: Sequence[bool]) -> list[bool]:
        """Per node save flags; forced modes applied, undecided free nodes recompute."""
        saves = [mode == NodeMode.SAVE for mode in graph.node_mode]
        for d, nodes in enumerate(self.decision_nodes):
            for n in nodes:
                saves[n] = bool(decisions[d])
        return saves

    def assignment(self, graph: CostGraph, decisions: Sequence[bool]) -> list[int]:
        """Every variable's value for ``decisions``: the exact fixpoint of ``evaluate``.

        A complete, feasible assignment, so a backend can start from it (a hint).
        """
        ev = evaluate(graph, self.node_saves(graph, decisions))
        needed, active, residual = set(ev.needed), set(ev.active), set(ev.residuals)
        values = [0] * len(self.var_names)
        for d, decided in enumerate(decisions):
            values[d] = int(bool(decided))
        for var, v in self.needed_vars:
            values[var] = int(v in needed)
        for var, n in self.active_vars:
            values[var] = int(n in active)
        for var, v in self.residual_vars:
            values[var] = int(v in residual)
        return values

    def canonical(
        self, graph: CostGraph, decisions: Sequence[bool]
    ) -> tuple[list[bool], Evaluation]:
        """The same plan with every save that has no effect turned into recompute.

        A saved node none of whose outputs is needed neither runs nor leaves a
        residual, and recomputing it instead changes no needed value, so the cost
        is identical. Dropping such saves makes the answer independent of which
        of these equivalent vectors a solver happened to return.
        """
        needed = set(evaluate(graph, self.node_saves(graph, decisions)).needed)
        outs = graph.node_outputs
        canonical = [
            bool(decisions[d]) and any(v in needed for n in nodes for v in outs[n])
            for d, nodes in enumerate(self.decision_nodes)
        ]
        return canonical, evaluate(graph, self.node_saves(graph, canonical))


class _Builder:
    """Collects named variables and clauses; constants are folded away."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.clauses: list[tuple[Lit, ...]] = []

    def var(self, name: str) -> int:
        self.names.append(name)
        return len(self.names) - 1

    def clause(self, *lits: Lit | bool) -> None:
        """Add ``or(lits)``; a True literal satisfies it, False literals vanish."""
        if any(lit is True for lit in lits):
            return
        kept = tuple(lit for lit in lits if not isinstance(lit, bool))
        assert kept, "a clause of constants that is false: the reduction is unsound"
        self.clauses.append(kept)


def _neg(lit: Lit | bool) -> Lit | bool:
    return (not lit) if isinstance(lit, bool) else (lit[0], not lit[1])


def _index(lit: Lit | bool) -> int:
    assert not isinstance(lit, bool), "a constant where a variable was expected"
    return lit[0]


def _scaled(terms: list[tuple[int, int]], offset: int) -> ScaledSum:
    terms = [(v, c) for v, c in terms if c]
    scale = 0
    for _, c in terms:
        scale = gcd(scale, c)
    scale = scale or 1
    return ScaledSum(tuple((v, c // scale) for v, c in terms), scale, offset)


def build(graph: CostGraph, tie: bool, reduce: bool = True) -> Formulation:
    """The MILP for ``graph``; ``tie`` gives all free nodes of one policy key one decision.

    ``reduce`` fixes decisions whose other choice is dominated
    (``reduction.dominated_choices``); without it the model is the direct one,
    the reference the reductions are tested against.
    """
    b = bounds(graph)
    modes = graph.node_mode
    outs, ins, producer = graph.node_outputs, graph.node_inputs, graph.producer
    builder = _Builder()

    # Decisions: only free nodes that write a value some plan needs can matter.
    # A tied decision still sets every free node of its key, as the policy would.
    relevant = [
        modes[n] == NodeMode.FREE and any(v in b.maybe_needed for v in outs[n])
        for n in range(graph.num_nodes)
    ]
    key_nodes: dict[str, list[int]] = {}
    if tie:
        for n in range(graph.num_nodes):
            if modes[n] == NodeMode.FREE and graph.node_key[n]:
                key_nodes.setdefault(graph.node_key[n], []).append(n)
    decision_of: dict[int, int] = {}
    decision_nodes: list[tuple[int, ...]] = []
    decision_keys: list[str] = []
    for n in range(graph.num_nodes):
        if not relevant[n] or n in decision_of:
            continue
        key = graph.node_key[n] if tie else ""
        nodes = key_nodes[key] if key else [n]
        name = f"save[key {key}]" if key else f"save[node {graph.node_id[n]}]"
        d = builder.var(name)
        decision_nodes.append(tuple(nodes))
        decision_keys.append(key)
        for m in nodes:
            decision_of[m] = d

    if reduce:
        fixed = dominated_choices(graph, b, tie)
        for d, nodes in enumerate(decision_nodes):
            choices = {fixed.get(n) for n in nodes}
            if len(choices) == 1 and None not in choices:
                builder.clause((d, choices.pop() is True))

    def save(n: int) -> Lit | bool:
        if modes[n] != NodeMode.FREE:
            return modes[n] == NodeMode.SAVE
        return (decision_of[n], True)

    needed: dict[int, Lit | bool] = {}
    needed_vars: list[tuple[int, int]] = []
    active_vars: list[tuple[int, int]] = []
    residual_vars: list[tuple[int, int]] = []
    for v in range(graph.num_values):
        if v in b.always_needed:
            needed[v] = True
        elif v in b.maybe_needed:
            var = builder.var(f"needed[value {graph.value_id[v]}]")
            needed[v] = (var, True)
            needed_vars.append((var, v))
        else:
            needed[v] = False

    active: dict[int, Lit | bool] = {}
    reasons: dict[int, list[Lit | bool]] = {v: [] for v in range(graph.num_values)}
    for n in sorted(b.maybe_active - b.always_active):
        var = builder.var(f"active[node {graph.node_id[n]} {graph.node_primitive[n]}]")
        active[n] = (var, True)
        active_vars.append((var, n))
        for v in outs[n]:
            builder.clause(_neg(needed[v]), active[n], save(n))
        for v in ins[n]:
            builder.clause(_neg(active[n]), needed[v])
            reasons[v].append(active[n])
        # Support: a node runs only when recomputed and one of its outputs is needed.
        builder.clause(_neg(active[n]), _neg(save(n)))
        builder.clause(_neg(active[n]), *(needed[v] for v in outs[n]))

    idx = graph.value_index
    for cin, cout in zip(graph.carry_in, graph.carry_out, strict=True):
        builder.clause(_neg(needed[idx[cin]]), needed[idx[cout]])
        reasons[idx[cout]].append(needed[idx[cin]])

    # Support: a value is needed only for a reason. The least fixpoint satisfies
    # these, so the optimum stays; with them the decisions determine every
    # auxiliary variable by propagation alone, and search branches on decisions.
    for v, lit in needed.items():
        if not isinstance(lit, bool):
            builder.clause(_neg(lit), *reasons[v])

    def _active(n: int) -> Lit | bool:
        return active.get(n, n in b.always_active)

    byte_terms: list[tuple[int, int]] = []
    always_bytes = 0
    for v in sorted(b.maybe_needed):
        nbytes, p = graph.value_bytes[v], producer[v]
        if nbytes == 0 or (p is not None and modes[p] == NodeMode.RECOMPUTE):
            continue
        if p is None or modes[p] == NodeMode.SAVE:
            lit = needed[v]  # an input or a forced save's output is a residual iff needed
        else:
            lit = (builder.var(f"residual[value {graph.value_id[v]}]"), True)
            residual_vars.append((lit[0], v))
            builder.clause(_neg(needed[v]), _neg(save(p)), lit)
            builder.clause(_neg(lit), needed[v])
            builder.clause(_neg(lit), save(p))
            builder.clause(_neg(needed[v]), lit, _active(p))  # the covering clause above
        if lit is True:
            always_bytes += nbytes
        else:
            byte_terms.append((_index(lit), nbytes))

    flop_terms = [(_index(lit), graph.node_flops[n]) for n, lit in active.items()]
    # Recompute FLOPs count from JAX's everything_saveable, which may run fewer
    # nodes than any plan (it saves keyed nodes a plan must recompute).
    always_flops = sum(graph.node_flops[n] for n in b.always_active)
    flops_offset = always_flops - baseline_backward_flops(graph)
    return Formulation(
        var_names=tuple(builder.names),
        num_decisions=len(decision_nodes),
        decision_nodes=tuple(decision_nodes),
        decision_keys=tuple(decision_keys),
        clauses=tuple(builder.clauses),
        recompute_flops=_scaled(flop_terms, flops_offset),
        residual_bytes=_scaled(byte_terms, always_bytes),
        needed_vars=tuple(needed_vars),
        active_vars=tuple(active_vars),
        residual_vars=tuple(residual_vars),
    )
