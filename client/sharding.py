"""What one device holds of each value on a mesh: the arguments' shardings, propagated.

(Over 400 lines: the layout and its propagation rules, one walk; issue 30's one
interpreter would give the rules a per-primitive registry of their own.)

On a mesh a budget is the peak one device holds, so every byte in a step's graph
is a per-device shard. The arguments' shardings are read from the arguments
themselves (``jax.Array.sharding``, ``jax.ShapeDtypeStruct(..., sharding=...)``);
an intermediate's is propagated through the jaxpr the graph is walked from, with
the rules SPMD partitioning follows for the primitives a layer is made of: an
elementwise op keeps its operands' split, a ``dot_general`` keeps its batch and
free dimensions' and loses a contracted one (its partial sums are all-reduced),
a reshape carries a split onto the major dimension of the group it maps to, a
reduction drops the reduced dimensions, a gather keeps its indices' split and its
operand's on the dimensions it slices whole (an embedding lookup is split as its
tokens), a broadcast takes the split of the elementwise op that reads it,
``with_sharding_constraint`` sets it.
A mesh axis splits at most one dimension of a value (XLA gathers the other, as it
does an FSDP parameter a batch-sharded activation multiplies). Why propagation and
not XLA's own shardings: ``docs/design.md``, "Sharded steps".

A *spec* is, per dimension, the mesh axes splitting it (``()``: whole on every
device); a value's per-device shape rounds each split dimension up, as XLA pads an
uneven shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

import optiremat.client._jax_internals as jx
from optiremat.client.primitives import Role, body, info
from optiremat.solver.errors import OptirematError

Spec = tuple[tuple[str, ...], ...]


class ShardingError(OptirematError, ValueError):
    """An argument's sharding that no mesh of this host can hold; names the argument."""


@dataclass(frozen=True)
class MeshLayout:
    """The mesh the step runs on (axis names and sizes) and a spec per flat argument."""

    axes: tuple[tuple[str, int], ...]
    argument_specs: tuple[Spec, ...]
    mesh: Any = field(default=None, compare=False)  # the jax Mesh itself, to place by

    def sharding(self, spec: Spec | None) -> Any:
        """The ``NamedSharding`` of ``spec`` on this mesh (whole on every device: None)."""
        parts = [axes[0] if len(axes) == 1 else (axes or None) for axes in spec or ()]
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*parts))

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def devices(self) -> int:
        return math.prod(size for _, size in self.axes)

    def shard_shape(self, shape: Sequence[int], spec: Spec | None) -> tuple[int, ...]:
        """One device's block of an array of ``shape`` split as ``spec`` says."""
        if not spec:
            return tuple(shape)
        sizes = self.sizes
        return tuple(-(-int(d) // math.prod(sizes[a] for a in axes))
                     for d, axes in zip(shape, spec, strict=True))

    def shard_bytes(self, aval: Any, spec: Spec | None) -> int:
        """Bytes of one device's block of a value of ``aval``."""
        from optiremat.client.cost_model import aval_bytes

        whole = aval_bytes(aval)
        shape = tuple(getattr(aval, "shape", ()))
        if not spec or not shape or whole == 0:
            return whole
        return whole // math.prod(shape) * math.prod(self.shard_shape(shape, spec))


def spec_of(sharding: Any, ndim: int) -> Spec:
    """Per dimension, the mesh axes of a ``NamedSharding``'s partition spec."""
    entries = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    out: list[tuple[str, ...]] = []
    for entry in entries[:ndim]:
        if entry is None:
            out.append(())
        elif isinstance(entry, str):
            out.append((entry,))
        else:
            out.append(tuple(entry))
    return tuple(out)


def mesh_layout(flat_args: Sequence, names: Sequence[str]) -> MeshLayout | None:
    """The mesh the arguments are placed on and their specs; None on one device.

    Every ``NamedSharding`` among the arguments must name one mesh (the same axis
    names and sizes), the host must have its devices, and a spec may only name its
    axes; anything else is an error naming the argument."""
    axes: tuple[tuple[str, int], ...] | None = None
    mesh: Any = None
    first = ""
    shardings: list[Any] = []
    for leaf, name in zip(flat_args, names, strict=True):
        sharding = getattr(leaf, "sharding", None)
        shardings.append(sharding)
        if sharding is None:
            continue
        if not isinstance(sharding, jax.sharding.NamedSharding):
            if len(sharding.device_set) <= 1:
                continue
            raise ShardingError(f"argument {name} is placed by a {type(sharding).__name__}; "
                                "optiremat reads NamedSharding(mesh, PartitionSpec(...)) "
                                "placements: place it with one")
        mesh = sharding.mesh
        here = tuple((str(a), int(s)) for a, s in mesh.shape.items())
        size = math.prod(s for _, s in here)
        abstract = isinstance(mesh, jax.sharding.AbstractMesh)
        if size > len(jax.devices()) or abstract:
            raise ShardingError(
                f"argument {name} is sharded over a{'n abstract' if abstract else ''} "
                f"mesh of {size} devices {dict(here)}, and this host has "
                f"{len(jax.devices())} {jax.default_backend()} device(s): the step must be "
                "compiled on the mesh's devices to measure it (place the arguments on a "
                "jax.sharding.Mesh of this host's devices; on CPU, set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={size} before importing jax)")
        if axes is None:
            axes, first, mesh = here, name, sharding.mesh
        elif here != axes:
            raise ShardingError(f"argument {name} is sharded over mesh {dict(here)}, argument "
                                f"{first} over {dict(axes)}: a step runs on one mesh")
        known = {a for a, _ in here}
        for entry in spec_of(sharding, len(getattr(leaf, "shape", ()))):
            for axis in entry:
                if axis not in known:
                    raise ShardingError(f"argument {name} is sharded over axis {axis!r}, "
                                        f"which its mesh {dict(here)} lacks")
    if axes is None:
        return None
    specs = tuple(spec_of(s, len(getattr(leaf, "shape", ())))
                  if isinstance(s, jax.sharding.NamedSharding) else ()
                  for leaf, s in zip(flat_args, shardings, strict=True))
    return MeshLayout(axes, specs, mesh)


def argument_names(in_tree: Any, count: int) -> list[str]:
    """Each flat argument's path in the user's call, as errors name it."""
    tree = jax.tree_util.tree_unflatten(in_tree, list(range(count)))
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = [""] * count
    for path, i in paths:
        # The traced tree is ((args...), {kwargs}): drop the outer pair's index.
        where = "args" if path and path[0] == jax.tree_util.SequenceKey(0) else "kwargs"
        names[i] = f"{where}{jax.tree_util.keystr(path[1:])}"
    return names


# ---- propagation ---------------------------------------------------------------------

REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                        "reduce_or", "reduce_xor", "argmax", "argmin"})


def _dedupe(spec: Sequence[tuple[str, ...]]) -> Spec:
    """A mesh axis splits one dimension of a value: the first keeps it."""
    seen: set[str] = set()
    out = []
    for axes in spec:
        kept = tuple(a for a in axes if a not in seen)
        seen.update(kept)
        out.append(kept)
    return tuple(out)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(getattr(getattr(x, "aval", None), "shape", ()))


def _merge(specs: Sequence[Spec | None], shape: tuple[int, ...],
           shapes: Sequence[tuple[int, ...]]) -> Spec:
    """Operands of the output's shape, combined per dimension (the first split wins)."""
    out: list[tuple[str, ...]] = [()] * len(shape)
    for spec, s in zip(specs, shapes, strict=True):
        if spec and s == shape:
            out = [o or axes for o, axes in zip(out, spec, strict=True)]
    return _dedupe(out)


def _reshape(spec: Spec, old: tuple[int, ...], new: tuple[int, ...],
             sizes: dict[str, int]) -> Spec:
    """A split carried onto the major dimension of the group of dimensions it maps to."""
    out: list[tuple[str, ...]] = [()] * len(new)
    i = j = 0
    while i < len(old) and j < len(new):
        i0, j0 = i, j
        a, b = old[i], new[j]
        i += 1
        j += 1
        while a != b:
            if a < b:
                a *= old[i]
                i += 1
            else:
                b *= new[j]
                j += 1
        axes = spec[i0]
        if axes and j > j0 and new[j0] % math.prod(sizes[x] for x in axes) == 0:
            out[j0] = axes
        while i < len(old) and old[i] == 1:  # trailing unit dimensions join no group
            i += 1
        while j < len(new) and new[j] == 1:
            j += 1
    return _dedupe(out)


def _dot(eqn: Any, lhs: Spec, rhs: Spec) -> Spec:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ln, rn = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    lhs = lhs or ((),) * ln
    rhs = rhs or ((),) * rn
    batch = [lhs[i] or rhs[j] for i, j in zip(lb, rb, strict=True)]
    free_l = [lhs[i] for i in range(ln) if i not in lc and i not in lb]
    free_r = [rhs[i] for i in range(rn) if i not in rc and i not in rb]
    return _dedupe([*batch, *free_l, *free_r])


def _match_batch(eqn: Any, ins: list[Spec | None], env: dict, fixed: set) -> None:
    """A ``dot_general`` operand made here whose batch dimension is whole while the other
    operand's is split takes that split: XLA slices it locally rather than gather the
    other (measured: the keys and values ``jnp.repeat`` widens to every head, on a mesh
    whose model axis splits the heads but not the 2 KV heads they come from)."""
    (_, _), (lb, rb) = eqn.params["dimension_numbers"]
    for mine, other, var, dims in ((0, 1, eqn.invars[0], zip(lb, rb, strict=True)),
                                   (1, 0, eqn.invars[1], zip(rb, lb, strict=True))):
        split = ins[other]
        if isinstance(var, jx.Literal) or var in fixed or not split:
            continue
        spec = list(ins[mine] or ((),) * len(_shape(var)))
        for d, o in dims:
            if not spec[d]:
                spec[d] = split[o]
        env[var] = _dedupe(spec)


# Primitives ``_equation`` gives a rule of their own; any other is elementwise-like.
_OWN_RULES = frozenset({"sharding_constraint", "dot_general", "gather", "transpose",
                        "broadcast_in_dim", "reshape", "squeeze", "concatenate"}) | REDUCTIONS


def _split_broadcasts(eqn: Any, out: Spec, env: dict, broadcasts: set) -> None:
    """A ``broadcast_in_dim`` made in this jaxpr that an elementwise op meets with a split
    operand takes the op's split: each device builds its own block of a broadcast, so
    XLA splits it as its user (measured: the causal mask ``jnp.where`` broadcasts to the
    scores' shape, and the ``-1e9`` beside it, are one batch row per device on a
    data-parallel mesh in the compiled program, not whole)."""
    shape = _shape(eqn.outvars[0])
    for var in eqn.invars:
        if not isinstance(var, jx.Literal) and var in broadcasts and _shape(var) == shape:
            mine = env.get(var) or ((),) * len(shape)
            env[var] = _dedupe([a or b for a, b in zip(mine, out, strict=True)])


def _gather(eqn: Any, operand: Spec | None, indices: Spec | None) -> Spec:
    """A gather's output dimensions are its indices' batch dimensions (all but the last,
    the index vector), split as the indices are, and the operand's offset dimensions in
    order, split as the operand is where the whole dimension is sliced. A split of an
    indexed (collapsed) dimension is lost: XLA gathers from its shard with the indices
    outside masked and all-reduces, or all-gathers the table; either way each device
    holds every row it asked for (measured: an embedding table split by vocabulary
    rows, over the batch's own axis (FSDP) or another (tensor parallel), gives the
    token batch's split and whole rows, in the compiled program's shapes)."""
    dn = eqn.params["dimension_numbers"]
    op_shape, out_rank = _shape(eqn.invars[0]), len(_shape(eqn.outvars[0]))
    operand = operand or ((),) * len(op_shape)
    indices = indices or ((),) * len(_shape(eqn.invars[1]))
    sliced = [d for d in range(len(op_shape))
              if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    batched = dict(zip(dn.start_indices_batching_dims, dn.operand_batching_dims, strict=True))
    out: list[tuple[str, ...]] = []
    offsets, batches = iter(sliced), iter(range(len(indices) - 1))
    for d in range(out_rank):
        if d in dn.offset_dims:
            o = next(offsets)
            whole = eqn.params["slice_sizes"][o] == op_shape[o]
            out.append(operand[o] if whole else ())
        else:
            i = next(batches)
            out.append(indices[i] or (operand[batched[i]] if i in batched else ()))
    return _dedupe(out)


def _equation(eqn: Any, ins: list[Spec | None], sizes: dict[str, int]) -> list[Spec]:
    name = eqn.primitive.name
    outs = [_shape(v) for v in eqn.outvars]
    in_shapes = [_shape(v) for v in eqn.invars]
    first = ins[0] if ins else None
    if name == "sharding_constraint":
        return [spec_of(eqn.params["sharding"], len(outs[0]))]
    if name == "dot_general":
        return [_dot(eqn, ins[0] or (), ins[1] or ())]
    if name == "gather":
        return [_gather(eqn, ins[0], ins[1])]
    if name == "transpose" and first:
        return [tuple(first[p] for p in eqn.params["permutation"])]
    if name == "broadcast_in_dim" and first:
        out: list[tuple[str, ...]] = [()] * len(outs[0])
        for i, d in enumerate(eqn.params["broadcast_dimensions"]):
            if in_shapes[0][i] == outs[0][d]:
                out[d] = first[i]
        return [_dedupe(out)]
    if name == "reshape" and first:
        return [_reshape(first, in_shapes[0], outs[0], sizes)]
    if (name in REDUCTIONS or name == "squeeze") and first:
        dropped = set(eqn.params.get("axes", eqn.params.get("dimensions", ())))
        return [tuple(a for i, a in enumerate(first) if i not in dropped)] * len(outs)
    if name == "concatenate":
        d = eqn.params["dimension"]
        merged = [list(s) if s else [()] * len(outs[0]) for s in ins]
        for m in merged:
            m[d] = ()
        return [_merge([tuple(m) for m in merged], outs[0], [outs[0]] * len(merged))]
    results = []
    for shape in outs:  # elementwise, selects, casts: operands of the output's shape
        spec = _merge(ins, shape, in_shapes)
        if not any(spec) and first and len(in_shapes[0]) == len(shape):
            # slices, pads, gathers along some dimension keep the split of the others
            spec = _dedupe([a if n == m else () for a, n, m in zip(first, in_shapes[0], shape,
                                                                   strict=True)])
        results.append(spec)
    return results


def propagate(jaxpr: jx.Jaxpr, specs: Sequence[Spec | None], sizes: dict[str, int],
              into: dict | None = None) -> tuple[list[Spec | None], dict]:
    """Specs of ``jaxpr``'s outputs given its inputs', and of every variable on the way
    (inner jaxprs' too, by variable: a scan body's per iteration)."""
    env: dict = {} if into is None else into
    env.update((v, s) for v, s in zip(jaxpr.invars, specs, strict=True))
    broadcasts: set = set()  # the variables broadcast_in_dim makes here

    def read(x: Any) -> Spec | None:
        return None if isinstance(x, jx.Literal) else env.get(x)

    for eqn in jaxpr.eqns:
        ins = [read(x) for x in eqn.invars]
        role = info(eqn.primitive).role
        outs: list[Spec | None] | None
        if role in (Role.CALL, Role.CHECKPOINT):
            outs, _ = propagate(body(eqn), ins, sizes, env)
        elif role == Role.SCAN:
            n_consts, n_carry = jx.scan_counts(eqn.params)
            xs = [s[1:] if s else s for s in ins[n_consts + n_carry:]]
            inner, _ = propagate(eqn.params["jaxpr"].jaxpr, [*ins[:n_consts + n_carry], *xs],
                                 sizes, env)
            # A carry keeps its initial split (XLA fixes a loop's state across iterations).
            outs = [*ins[n_consts:n_consts + n_carry],
                    *[((),) + s if s else s for s in inner[n_carry:]]]
        elif role == Role.COND:
            outs = None
            for branch in eqn.params["branches"]:
                outs, _ = propagate(branch.jaxpr, ins[1:], sizes, env)
        elif role == Role.WHILE:
            nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
            carry = ins[nc + nb:]
            propagate(eqn.params["body_jaxpr"].jaxpr, [*ins[nc:nc + nb], *carry], sizes, env)
            outs = carry
        else:
            outs = list(_equation(eqn, ins, sizes))
            name = eqn.primitive.name
            if name == "dot_general":
                _match_batch(eqn, ins, env, set(jaxpr.invars))
            elif name == "broadcast_in_dim":
                broadcasts.add(eqn.outvars[0])
            elif name not in _OWN_RULES and outs and outs[0] and any(outs[0]):
                _split_broadcasts(eqn, outs[0], env, broadcasts)
        assert outs is not None
        env.update((v, s) for v, s in zip(eqn.outvars, outs, strict=True))
    return [read(x) for x in jaxpr.outvars], env


# ---- collectives ---------------------------------------------------------------------

# Equations that move a value without changing its elements: when one device's block
# of the output is larger than of the input, the split was lost and XLA gathers it.
_RELAYOUTS = frozenset({"reshape", "transpose", "sharding_constraint", "convert_element_type",
                        "copy", "copy_p", "squeeze", "expand_dims"})


def collective_bytes(eqn: Any, specs: dict, layout: MeshLayout) -> int:
    """The bytes one device moves over the interconnect when ``eqn`` runs once, as SPMD
    partitioning lowers it under the propagated ``specs``.

    Two kinds, each of which a recomputation repeats: the all-reduce of partial sums
    (a ``dot_general`` contracting a dimension both operands split on the same axes,
    a reduction over a split dimension), a ring's ``2 (k - 1) / k`` times one device's
    block of the result; and the gather of a value whose split an equation that only
    moves elements cannot keep, the blocks it receives. A gather of a dot's operand is
    not counted: the gradient reads that operand too and XLA gathers it once for both
    (``solver.collectives``)."""
    def spec(x: Any) -> Spec | None:
        return None if isinstance(x, jx.Literal) else specs.get(x)

    name = eqn.primitive.name
    sizes = layout.sizes
    if not eqn.outvars:
        return 0
    out = eqn.outvars[0]
    split: set[str] = set()
    if name == "dot_general":
        (lc, rc), _ = eqn.params["dimension_numbers"]
        lhs, rhs = spec(eqn.invars[0]) or (), spec(eqn.invars[1]) or ()
        for i, j in zip(lc, rc, strict=True):
            if lhs and rhs and lhs[i] and lhs[i] == rhs[j]:
                split.update(lhs[i])
    elif name in REDUCTIONS:
        first = spec(eqn.invars[0]) or ()
        for d in eqn.params.get("axes", ()):
            if first and d < len(first):
                split.update(first[d])
    elif name in _RELAYOUTS and not isinstance(eqn.invars[0], jx.Literal):
        held = math.prod(layout.shard_shape(_shape(eqn.invars[0]), spec(eqn.invars[0])))
        wanted = math.prod(layout.shard_shape(_shape(out), spec(out)))
        block = layout.shard_bytes(out.aval, spec(out))
        return block * (wanted - held) // wanted if wanted > held else 0
    if not split:
        return 0
    k = math.prod(sizes[a] for a in split)
    return 2 * (k - 1) * layout.shard_bytes(out.aval, spec(out)) // k
