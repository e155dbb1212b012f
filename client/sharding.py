"""What one device holds of each value on a mesh: the mesh, and the arguments' shardings.

On a mesh a budget is the peak one device holds, so every byte in a step's graph
is a per-device shard. The arguments' shardings are read from the arguments
themselves (``jax.Array.sharding``, ``jax.ShapeDtypeStruct(..., sharding=...)``);
an intermediate's is propagated through the jaxpr by per-primitive rules
(``client.sharding_rules``).

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
