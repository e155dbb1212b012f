"""The checkpointing MILP as backend-neutral data.

(Over 400 lines on purpose: the model's derivation below and the code that builds it
are read together.)

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

Offload (``optiremat.solver.offload``) is a layer on these variables, not
another model: offloading changes where a residual lives, not which values are
needed, so every clause above stays. Per decision whose node leaves a residual
variable, ``offload[d] -> save[d]``; per such residual, ``host[v] = residual[v]
and offload[d]`` as three exact clauses. Device bytes are the residual bytes
less the host ones, and the budget caps them; host bytes have a cap of their
own. The search then minimises the time the plan adds in FLOP-equivalents
(``offload.PlanTime``), exactly, in units of ``1 / bandwidth`` FLOPs over the gcd
of every coefficient (prices that overflow 64 bits are refused): outside scan
regions ``bandwidth * flops + 2 * flop_rate * host_bytes``; per region one
integer variable per pass, at least each term of its max (``AtLeast`` rows), so
the minimum sets each to its max. The layer is built
without the dominance reductions: the zero-FLOP chain rule moves a residual onto
its producer's output, which may be an input that cannot be offloaded, so it is
not sound once host bytes are free of the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from math import gcd

from optiremat.solver.graph import CostGraph, NodeMode
from optiremat.solver.offload import (
    BACKWARD_PER_FORWARD,
    TRANSFERS_PER_BYTE,
    OffloadOptions,
    PlanTime,
)
from optiremat.solver.reduction import bounds, dominated_choices
from optiremat.solver.semantics import Evaluation, baseline_backward_flops, evaluate
from optiremat.solver.validation import INT_BOUND, OutOfRangeError

# (variable index, polarity): (3, True) is x3, (3, False) is "not x3".
Lit = tuple[int, bool]

INT64_SAFE = INT_BOUND  # CP-SAT rejects linear expressions whose extremes may overflow int64


@dataclass(frozen=True)
class ScaledSum:
    """``offset + scale / divisor * sum(coef * x[var])``, exact in raw units.

    Raw units are bytes or FLOPs; the offload cost is in FLOP-equivalents,
    whose unit may be a fraction of a FLOP (``divisor`` > 1).
    """

    terms: tuple[tuple[int, int], ...]  # (variable index, coefficient in scaled units)
    scale: int
    offset: int
    divisor: int = 1

    @property
    def max_scaled(self) -> int:
        return sum(coef for _, coef in self.terms if coef > 0)

    def raw(self, scaled: int) -> Fraction:
        return self.offset + Fraction(self.scale * scaled, self.divisor)

    def cap(self, raw_limit: int | Fraction) -> int:
        """Largest scaled value whose raw value stays within ``raw_limit``."""
        return (raw_limit - self.offset) * self.divisor // self.scale

    def at_least(self, raw_bound: int | Fraction) -> int:
        """Smallest scaled value whose raw value is at least ``raw_bound``."""
        return -((self.offset - raw_bound) * self.divisor // self.scale)


@dataclass(frozen=True)
class AtLeast:
    """``x[var] >= sum(coef * x[v]) + constant``, in the offload cost's scaled units."""

    var: int
    terms: tuple[tuple[int, int], ...]
    constant: int


@dataclass(frozen=True)
class OffloadLayer:
    """Offload on the checkpointing variables (see the module docstring)."""

    offload_vars: tuple[tuple[int, int], ...]  # (variable, the decision it offloads)
    cost: ScaledSum  # recompute FLOPs plus transfers, in FLOP-equivalents
    device_bytes: ScaledSum  # residual bytes less host bytes: what the budget caps
    host_bytes: ScaledSum
    host_cap: int  # the host budget in host_bytes' scaled units
    time: PlanTime = field(compare=False)  # what ``cost`` poses, to price plans exactly
    # A scan region's time per pass: integer variables in [0, upper], not 0-1.
    integers: tuple[tuple[int, int], ...] = ()  # (variable, upper bound)
    at_least: tuple[AtLeast, ...] = ()

    def settle(self, values: list[int]) -> None:
        """Set each integer variable to the least value its rows allow."""
        least = {var: 0 for var, _ in self.integers}
        for row in self.at_least:
            value = row.constant + sum(coef * values[v] for v, coef in row.terms)
            least[row.var] = max(least[row.var], value)
        for var, value in least.items():
            values[var] = value


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
    offload: OffloadLayer | None = None

    @property
    def cost(self) -> ScaledSum:
        """What a search minimises: recompute FLOPs, with offload plus priced transfers."""
        return self.recompute_flops if self.offload is None else self.offload.cost

    @property
    def budgeted_bytes(self) -> ScaledSum:
        """What a budget caps: residual bytes, with offload those left on the device."""
        return self.residual_bytes if self.offload is None else self.offload.device_bytes

    def offloads(self, values: Sequence[float]) -> tuple[bool, ...]:
        """Per decision, whether a backend's assignment (every variable) offloads it."""
        offloaded = [False] * self.num_decisions
        for var, d in self.offload.offload_vars if self.offload is not None else ():
            offloaded[d] = values[var] > 0.5
        return tuple(offloaded)

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
        if self.offload is not None:
            self.offload.settle(values)
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


def _scaled(terms: list[tuple[int, int]], offset: int, divisor: int = 1) -> ScaledSum:
    terms = [(v, c) for v, c in terms if c]
    scale = 0
    for _, c in terms:
        scale = gcd(scale, c)
    scale = scale or 1
    return ScaledSum(tuple((v, c // scale) for v, c in terms), scale, offset, divisor)


def build(graph: CostGraph, tie: bool, reduce: bool = True,
          offload: OffloadOptions | None = None) -> Formulation:
    """The MILP for ``graph``; ``tie`` gives all free nodes of one policy key one decision.

    ``reduce`` fixes decisions whose other choice is dominated
    (``reduction.dominated_choices``); without it the model is the direct one,
    the reference the reductions are tested against. ``offload`` adds the
    offload layer, on the direct model (see the module docstring).

    (Long on purpose: the variables and constraints in the order the module docstring
    states them, one reading of the model; its steps share the builder and the maps of
    active nodes.)
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

    if reduce and offload is None:
        fixed = dominated_choices(graph, b, tie)
        for d, decided in enumerate(decision_nodes):
            choices = {fixed.get(n) for n in decided}
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
    recompute_flops = _scaled(flop_terms, flops_offset)
    residual_bytes = _scaled(byte_terms, always_bytes)
    layer = None
    if offload is not None:
        layer = _offload_layer(graph, builder, decision_of, residual_vars, active,
                               b.always_active, residual_bytes, offload)
    return Formulation(
        var_names=tuple(builder.names),
        num_decisions=len(decision_nodes),
        decision_nodes=tuple(decision_nodes),
        decision_keys=tuple(decision_keys),
        clauses=tuple(builder.clauses),
        recompute_flops=recompute_flops,
        residual_bytes=residual_bytes,
        needed_vars=tuple(needed_vars),
        active_vars=tuple(active_vars),
        residual_vars=tuple(residual_vars),
        offload=layer,
    )


def _offload_layer(
    graph: CostGraph,
    builder: _Builder,
    decision_of: dict[int, int],
    residual_vars: list[tuple[int, int]],
    active: dict[int, Lit | bool],
    always_active: frozenset[int],
    residual_bytes: ScaledSum,
    options: OffloadOptions,
) -> OffloadLayer:
    """The offload variables and clauses, added to ``builder``, and the layer's sums."""
    offload_of: dict[int, int] = {}  # decision -> its offload variable
    host_of: dict[int, int] = {}  # residual variable -> its host copy
    host_terms: list[tuple[int, int, int]] = []  # (host variable, value, bytes)
    for var, v in residual_vars:
        p = graph.producer[v]
        assert p is not None, "a residual variable stands for a free node's output"
        d = decision_of[p]
        if d not in offload_of:
            offload_of[d] = builder.var(f"offload[{builder.names[d]}]")
            builder.clause((offload_of[d], False), (d, True))
        off, host = offload_of[d], builder.var(f"host[{builder.names[var]}]")
        builder.clause((var, False), (off, False), (host, True))
        builder.clause((host, False), (var, True))
        builder.clause((host, False), (off, True))
        host_of[var] = host
        host_terms.append((host, v, graph.value_bytes[v]))

    device_terms: list[tuple[int, int]] = []
    for var, coef in residual_bytes.terms:
        device_terms.append((var, coef * residual_bytes.scale))
        if var in host_of:
            device_terms.append((host_of[var], -coef * residual_bytes.scale))
    time = PlanTime(graph, options)
    cost, integers, rows = _time_sum(graph, builder, active, always_active, host_terms, time)
    host_bytes = _scaled([(host, nbytes) for host, _, nbytes in host_terms], 0)
    return OffloadLayer(
        offload_vars=tuple((off, d) for d, off in offload_of.items()),
        cost=cost,
        device_bytes=_scaled(device_terms, residual_bytes.offset),
        host_bytes=host_bytes,
        host_cap=options.host_budget_bytes // host_bytes.scale,
        time=time,
        integers=integers,
        at_least=rows,
    )


def _time_sum(
    graph: CostGraph,
    builder: _Builder,
    active: dict[int, Lit | bool],
    always_active: frozenset[int],
    host_terms: list[tuple[int, int, int]],
    time: PlanTime,
) -> tuple[ScaledSum, tuple[tuple[int, int], ...], tuple[AtLeast, ...]]:
    """``time``'s sum on the variables: the offload cost and, per region with
    transfers, the integer variables and rows of its maxima (the module docstring).
    (Long on purpose: one scaling, in ticks, holds for every term and row it writes.)

    Everything is first in ticks of ``1 / rate.denominator`` FLOPs (a FLOP is
    ``den`` ticks, a byte one way ``num``), then divided by the gcd of every
    coefficient and constant, so that the rows stay exact in scaled units.
    """
    rate = time.options.flops_per_transfer_byte
    num, den = rate.numerator, rate.denominator
    count = len(time.regions)
    outside: list[tuple[int, int]] = []
    recompute: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    transfer: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    always = [0] * count
    outside_always = 0
    for n, lit in active.items():
        r = time.node_region[n]
        (recompute[r] if r >= 0 else outside).append((_index(lit), graph.node_flops[n] * den))
    for n in always_active:
        r = time.node_region[n]
        if r >= 0:
            always[r] += graph.node_flops[n]
        else:
            outside_always += graph.node_flops[n]
    for host, v, nbytes in host_terms:
        r = time.value_region[v]
        if r >= 0:
            transfer[r].append((host, nbytes * num))
        else:
            outside.append((host, TRANSFERS_PER_BYTE * nbytes * num))
    raw_rows: list[tuple[int, list[tuple[int, int]], int]] = []  # x >= terms + constant
    passes: list[int] = []
    for r, region in enumerate(time.regions):
        if not transfer[r]:
            # Nothing to hide: the region adds its recomputation, as outside.
            outside.extend(recompute[r])
            outside_always += always[r] - region.baseline_flops
            continue
        forward = builder.var(f"time[region {r} forward]")
        backward = builder.var(f"time[region {r} backward]")
        passes += [forward, backward]
        hidden = region.forward_flops * den
        raw_rows.append((forward, transfer[r], -hidden))
        raw_rows.append((backward, recompute[r], (always[r] - region.baseline_flops) * den))
        raw_rows.append((backward, transfer[r], -BACKWARD_PER_FORWARD * hidden))
    scale = 0
    for _, c in outside:
        scale = gcd(scale, c)
    for _, terms, constant in raw_rows:
        scale = gcd(scale, constant, *(c for _, c in terms))
    scale = scale or 1
    rows = tuple(AtLeast(var, tuple((v, c // scale) for v, c in terms if c), constant // scale)
                 for var, terms, constant in raw_rows)
    upper: dict[int, int] = {var: 0 for var in passes}
    for row in rows:
        most = row.constant + sum(c for _, c in row.terms if c > 0)
        upper[row.var] = max(upper[row.var], most)
    cost = ScaledSum(tuple((v, c // scale) for v, c in outside if c)
                     + tuple((var, 1) for var in passes),
                     scale, outside_always - time.baseline_outside, den)
    largest = sum(abs(c) for _, c in cost.terms) + sum(upper.values())
    largest += sum(abs(row.constant) + sum(abs(c) for _, c in row.terms) for row in rows)
    if largest >= INT64_SAFE:
        raise OutOfRangeError(
            "options.offload: the offload objective does not fit 64-bit integers: choose "
            "host_bandwidth and device_flop_rate with a larger common divisor (round numbers, "
            "e.g. 25e9 and 4e14)")
    return cost, tuple(upper.items()), rows
