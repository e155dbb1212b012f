"""Structural checks on a CostGraph; every message names the offending id."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, StrictInt

from optiremat.solver.errors import OptirematError

if TYPE_CHECKING:
    from optiremat.solver.graph import CostGraph
    from optiremat.solver.step import StepMemory

# CP-SAT holds int64 and rejects a linear expression whose extremes may overflow it: every
# integer a request carries (bytes, FLOPs, rates, budgets), and every sum the formulation
# builds from them, stays below 2**62. (Far above any real step: 4 EiB, 4.6e18 FLOPs.)
INT_BOUND = 2**62
BoundedInt = Annotated[StrictInt, Field(ge=0, lt=INT_BOUND)]


class GraphError(OptirematError, ValueError):
    """A cost graph that breaks the schema; the message names the node or value."""


class OutOfRangeError(OptirematError, ValueError):
    """A request whose sums the solver's 64-bit integers cannot hold (offload prices
    found so while the formulation is built); the message names the fields."""


def _fail(msg: str) -> None:
    raise GraphError(msg)


def _check_regions(g: CostGraph, field: str, ids: list[int], what: str) -> None:
    """An optional per-value or per-node region column: one entry each, regions that exist."""
    column = getattr(g, field)
    if column is None:
        return
    if len(column) != len(ids):
        _fail(f"{field} has {len(column)} entries, there are {len(ids)} {what}s")
    regions = len(g.step.regions) if g.step is not None else 0
    for i, r in enumerate(column):
        if r >= regions:
            _fail(f"{what} {ids[i]} is in region {r}, but the step has {regions}")


def _check_columns(g: CostGraph) -> None:
    nv, nn = len(g.value_id), len(g.node_id)
    _check_regions(g, "value_region", g.value_id, "value")
    _check_regions(g, "node_region", g.node_id, "node")
    if g.value_extra_bytes is not None and len(g.value_extra_bytes) != nv:
        _fail(f"value_extra_bytes has {len(g.value_extra_bytes)} entries, value_id has {nv}")
    for field in ("value_bytes", "value_shape", "value_dtype"):
        if len(getattr(g, field)) != nv:
            _fail(f"{field} has {len(getattr(g, field))} entries, value_id has {nv}")
    for field in ("node_primitive", "node_key", "node_flops", "node_mode", "node_repeat",
                  "node_source"):
        if len(getattr(g, field)) != nn:
            _fail(f"{field} has {len(getattr(g, field))} entries, node_id has {nn}")
    if g.node_batch_dims is not None and len(g.node_batch_dims) != nn:
        _fail(f"node_batch_dims has {len(g.node_batch_dims)} entries, node_id has {nn}")
    if g.node_collective_bytes is not None:
        if len(g.node_collective_bytes) != nn:
            _fail(f"node_collective_bytes has {len(g.node_collective_bytes)} entries, "
                  f"node_id has {nn}")
        if g.mesh is None:
            _fail("node_collective_bytes without a mesh: only a graph of a step on a device "
                  "mesh (schema_version 3) moves bytes between devices")
    for ptr_name, ids_name in (("input_ptr", "input_ids"), ("output_ptr", "output_ids")):
        ptr, ids = getattr(g, ptr_name), getattr(g, ids_name)
        if len(ptr) != nn + 1 or (ptr and ptr[0] != 0) or (ptr and ptr[-1] != len(ids)):
            _fail(f"{ptr_name} must have {nn + 1} entries from 0 to len({ids_name})="
                  f"{len(ids)}")
        for n in range(nn):
            if ptr[n] > ptr[n + 1]:
                _fail(f"{ptr_name} decreases at node {g.node_id[n]}")
    if len(g.carry_in) != len(g.carry_out):
        _fail(f"carry_in has {len(g.carry_in)} entries, carry_out has {len(g.carry_out)}")


def _check_ids(g: CostGraph) -> None:
    for kind, ids in (("value", g.value_id), ("node", g.node_id)):
        seen: set[int] = set()
        for i in ids:
            if i in seen:
                _fail(f"duplicate {kind} id {i}")
            seen.add(i)
    values = set(g.value_id)
    for n, node in enumerate(g.node_id):
        for ptr, ids, what in ((g.input_ptr, g.input_ids, "reads"),
                               (g.output_ptr, g.output_ids, "writes")):
            for v in ids[ptr[n]:ptr[n + 1]]:
                if v not in values:
                    _fail(f"node {node} ({g.node_primitive[n]}) {what} value {v}, "
                          "which does not exist")
    for field in ("inputs", "backward_reads", "carry_in", "carry_out"):
        for v in getattr(g, field):
            if v not in values:
                _fail(f"{field} names value {v}, which does not exist")


def _check_producers(g: CostGraph) -> None:
    producer: dict[int, int] = {}
    for n, node in enumerate(g.node_id):
        for v in g.output_ids[g.output_ptr[n]:g.output_ptr[n + 1]]:
            if v in producer:
                _fail(f"value {v} is written by node {producer[v]} and node {node}")
            producer[v] = node
    inputs = set(g.inputs)
    for v in g.inputs:
        if v in producer:
            _fail(f"value {v} is a graph input but node {producer[v]} writes it")
    for v in g.value_id:
        if v not in producer and v not in inputs:
            _fail(f"value {v} has no producing node and is not a graph input")


def _check_acyclic(g: CostGraph) -> None:
    """Kahn's algorithm over nodes; a leftover node sits on a cycle."""
    producer = {}
    for n in range(len(g.node_id)):
        for v in g.output_ids[g.output_ptr[n]:g.output_ptr[n + 1]]:
            producer[v] = n
    succ: list[list[int]] = [[] for _ in g.node_id]
    indeg = [0] * len(g.node_id)
    for n in range(len(g.node_id)):
        for v in g.input_ids[g.input_ptr[n]:g.input_ptr[n + 1]]:
            p = producer.get(v)
            if p is not None:
                succ[p].append(n)
                indeg[n] += 1
    ready = [n for n, d in enumerate(indeg) if d == 0]
    done = 0
    while ready:
        n = ready.pop()
        done += 1
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
    if done != len(g.node_id):
        on_cycle = min(g.node_id[n] for n, d in enumerate(indeg) if d > 0)
        _fail(f"the graph has a cycle through node {on_cycle}")


# (column, id column, what the entry is, smallest allowed value)
_INTEGER_COLUMNS = (
    ("value_bytes", "value_id", "value", "bytes", 0),
    ("node_flops", "node_id", "node", "flops", 0),
    ("node_repeat", "node_id", "node", "repeat", 1),
    ("node_collective_bytes", "node_id", "node", "collective bytes", 0),
)


def check_raw_columns(data: dict[str, Any]) -> None:
    """Before field parsing: name the value or node whose cost is not an integer.

    Pydantic alone would report a list position (``value_bytes.3``), which is
    not the id a user can find in their graph.
    """
    for column, id_column, kind, what, least in _INTEGER_COLUMNS:
        entries, ids = data.get(column), data.get(id_column)
        if not isinstance(entries, list):
            continue
        ids = ids if isinstance(ids, list) else []
        for i, entry in enumerate(entries):
            if (isinstance(entry, bool) or not isinstance(entry, int) or entry < least
                    or entry >= INT_BOUND):
                who = f"{kind} {ids[i]!r}" if i < len(ids) else f"{column} position {i}"
                _fail(f"{who} has {what} {_short(entry)}; {what} must be an integer >= {least} "
                      f"and < 2**62")


def _short(entry: object) -> str:
    """An entry as a message shows it: a 300-digit integer by its size, not its digits."""
    text = repr(entry)
    if isinstance(entry, int) and not isinstance(entry, bool) and len(text) > 24:
        return f"{text[:8]}...({len(text)} digits)"
    return text


def _check_sum(what: str, total: int) -> None:
    if total >= INT_BOUND:
        _fail(f"the graph's {what} add up to {_short(total)} (about 2**{total.bit_length() - 1}); "
              "they must stay below 2**62, what the solver's 64-bit integers hold")


def _check_totals(g: CostGraph) -> None:
    """The sums the formulation builds stay within 64 bits: every residual at once plus
    what the step holds, and every FLOP recomputed at once."""
    held = 0 if g.step is None else g.step.held_bytes + g.step.working_bytes
    _check_sum("bytes (value_bytes, value_extra_bytes and the step's held and working bytes)",
               sum(g.value_bytes) + sum(g.value_extra_bytes or ()) + held)
    _check_sum("FLOPs (node_flops)", sum(g.node_flops))
    _check_sum("collective bytes (node_collective_bytes)", sum(g.node_collective_bytes or ()))


def check_step(step: StepMemory) -> None:
    """What a step holds is never negative: aliases are arguments that are also outputs."""
    if step.alias_bytes > step.argument_bytes + step.output_bytes:
        _fail(f"step.alias_bytes ({step.alias_bytes}) exceeds step.argument_bytes + "
              f"step.output_bytes ({step.argument_bytes} + {step.output_bytes}): aliased "
              "bytes are arguments that are also outputs")


def check_budget(budget_bytes: int, name: str = "budget_bytes") -> None:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {budget_bytes!r}")
    if budget_bytes >= INT_BOUND:
        raise ValueError(f"{name} is {_short(budget_bytes)}; it must be below 2**62 bytes "
                         "(4 EiB), what the solver's 64-bit integers hold")


def check_graph(g: CostGraph) -> None:
    _check_columns(g)
    _check_ids(g)
    _check_producers(g)
    _check_acyclic(g)
    _check_totals(g)
