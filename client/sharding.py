"""What one device holds of each value on a mesh: the mesh, and the arguments' shardings.

On a mesh a budget is the peak one device holds, so every byte in a step's graph
is a per-device shard. The arguments' shardings are read from the arguments
themselves (``jax.Array.sharding``, ``jax.ShapeDtypeStruct(..., sharding=...)``);
an intermediate's is propagated through the jaxpr by per-primitive rules
(``client.sharding_rules``). A step on one device has the null layout
(``SingleDevice``: every value whole, nothing moved), so no caller tests for a mesh:
``Layout.value_bytes`` weighs every value of a graph either way.

A *spec* is, per dimension, the mesh axes splitting it (``()``: whole on every
device); a value's per-device shape rounds each split dimension up, as XLA pads an
uneven shard.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import jax

from optiremat.client.cost_model import aval_bytes
from optiremat.client.sharding_rules import Spec, collective_bytes, propagate, spec_of
from optiremat.solver.errors import OptirematError
from optiremat.solver.graph import DeviceMesh


class ShardingError(OptirematError, ValueError):
    """An argument's sharding that no mesh of this host can hold; names the argument."""


class Layout(ABC):
    """Where a step's values live: what one device holds of each, the sharding to place
    one by, what an equation moves between devices. ``SingleDevice`` is the null layout
    (every value whole, nothing moved), so that callers never ask which one they have."""

    argument_specs: tuple[Spec | None, ...]  # per flat argument
    on_mesh: ClassVar[bool]

    @abstractmethod
    def shard_shape(self, shape: Sequence[int], spec: Spec | None) -> tuple[int, ...]:
        """One device's block of an array of ``shape`` split as ``spec`` says."""

    def value_bytes(self, aval: Any, spec: Spec | None) -> int:
        """Bytes of one device's block of a value of ``aval`` split as ``spec`` says: what
        a value weighs everywhere in a graph."""
        whole = aval_bytes(aval)
        shape = tuple(getattr(aval, "shape", ()))
        if not spec or not shape or whole == 0:
            return whole
        return whole // math.prod(shape) * math.prod(self.shard_shape(shape, spec))

    @abstractmethod
    def sharding(self, spec: Spec | None) -> Any:
        """What to place a value split as ``spec`` by (``ShapeDtypeStruct(sharding=)``)."""

    @abstractmethod
    def variable_specs(self, jaxpr: Any, input_specs: Sequence[Spec | None]) -> dict:
        """Each variable's spec in ``jaxpr`` (inner jaxprs' too) given its inputs'."""

    @abstractmethod
    def moved_bytes(self, eqn: Any, specs: dict) -> int:
        """Bytes one device moves over the interconnect when ``eqn`` runs once."""

    @abstractmethod
    def device_mesh(self) -> DeviceMesh | None:
        """The mesh as a graph records it."""

    @abstractmethod
    def devices(self) -> list:
        """The devices the step runs on."""


@dataclass(frozen=True)
class SingleDevice(Layout):
    """One device: every value whole there, nothing moved, no mesh recorded."""

    # Not compared: one device is one device (calibrations of a region are shared).
    argument_specs: tuple[Spec | None, ...] = field(default=(), compare=False)
    on_mesh: ClassVar[bool] = False

    def shard_shape(self, shape: Sequence[int], spec: Spec | None) -> tuple[int, ...]:
        return tuple(shape)

    def sharding(self, spec: Spec | None) -> None:
        return None

    def variable_specs(self, jaxpr: Any, input_specs: Sequence[Spec | None]) -> dict:
        return {}

    def moved_bytes(self, eqn: Any, specs: dict) -> int:
        return 0

    def device_mesh(self) -> None:
        return None

    def devices(self) -> list:
        return [jax.devices()[0]]


ONE_DEVICE = SingleDevice()


@dataclass(frozen=True)
class MeshLayout(Layout):
    """The mesh the step runs on (axis names and sizes) and a spec per flat argument."""

    axes: tuple[tuple[str, int], ...]
    argument_specs: tuple[Spec | None, ...]
    mesh: Any = field(default=None, compare=False)  # the jax Mesh itself, to place by
    on_mesh: ClassVar[bool] = True

    def sharding(self, spec: Spec | None) -> Any:
        """The ``NamedSharding`` of ``spec`` on this mesh (whole on every device: None)."""
        parts = [axes[0] if len(axes) == 1 else (axes or None) for axes in spec or ()]
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*parts))

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.axes)

    def shard_shape(self, shape: Sequence[int], spec: Spec | None) -> tuple[int, ...]:
        if not spec:
            return tuple(shape)
        sizes = self.sizes
        return tuple(-(-int(d) // math.prod(sizes[a] for a in axes))
                     for d, axes in zip(shape, spec, strict=True))

    def variable_specs(self, jaxpr: Any, input_specs: Sequence[Spec | None]) -> dict:
        return propagate(jaxpr, input_specs, self.sizes)[1]

    def moved_bytes(self, eqn: Any, specs: dict) -> int:
        return collective_bytes(eqn, specs, self)

    def device_mesh(self) -> DeviceMesh:
        return DeviceMesh.of(self.axes)

    def devices(self) -> list:
        return list(self.mesh.devices.flat)


def mesh_layout(flat_args: Sequence, names: Sequence[str]) -> Layout:
    """The mesh the arguments are placed on and their specs (on one device, ``SingleDevice``).

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
        return SingleDevice((None,) * len(flat_args))
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
