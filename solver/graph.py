"""The cost graph: what JAX's remat machinery sees, as data.

A graph is the known (primal) part of a JVP'd function. Each *node* is one
primitive application; each *value* is one array it reads or writes. On the
wire the graph is columnar: one list per field, node edges as CSR index arrays
(``input_ptr``/``input_ids``, ``output_ptr``/``output_ids``) that hold value ids.

Semantics (see ``optiremat.solver.semantics``, the single executable definition):

* every free node is either saved (runs only forward) or recomputed (staged
  into the backward pass too); ``mode`` fixes a node to one choice when the
  policy cannot change it (effects, control flow);
* a value is *needed* when it is in ``backward_reads``, when a recomputed node
  that runs in the backward pass reads it, or when it is the ``carry_out`` of
  a loop whose paired ``carry_in`` is needed (a scan body that reads its
  primal carry in the backward pass must rebuild the carry every iteration);
* a recomputed node runs in the backward pass when any of its outputs is needed;
* a needed value is a *residual* when it is a graph input or the output of a
  saved node; ``value_bytes`` is what it then costs (already multiplied by the
  scan lengths it is stacked over).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from enum import StrEnum
from functools import cached_property
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from optiremat.solver.step import StepMemory
from optiremat.solver.validation import BoundedInt as NonNegInt
from optiremat.solver.validation import GraphError as GraphError  # re-exported
from optiremat.solver.validation import check_graph, check_raw_columns

SCHEMA_VERSION = 2
# Version 1 graphs (no step, no regions) are read unchanged: they plan residual budgets.
# Version 3 is a graph of a step on a device mesh (``mesh``): its bytes are one device's.
# A graph on one device keeps version 2, so its JSON and content hash are unchanged.
MESH_SCHEMA_VERSION = 3
# Version 4 is a graph of a step with a region other than a scan (``RegionMemory.kind``),
# on one device or a mesh: a build that reads 3 would misprice its blocks as scans.
KINDS_SCHEMA_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)


def schema_version(mesh: DeviceMesh | None, step: StepMemory | None) -> int:
    """The version a graph with this mesh and step is written as."""
    if step is not None and step.has_blocks:
        return KINDS_SCHEMA_VERSION
    return SCHEMA_VERSION if mesh is None else MESH_SCHEMA_VERSION


class DeviceMesh(BaseModel):
    """The mesh a step runs on: its axes' names and sizes. Every byte of a graph that
    carries one is what one device holds (its shard); a graph without one is one device."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    axis_names: list[StrictStr]
    axis_sizes: list[Annotated[StrictInt, Field(ge=1, lt=2**31)]]

    @classmethod
    def of(cls, axes: Sequence[tuple[str, int]]) -> DeviceMesh:
        return cls(axis_names=[a for a, _ in axes], axis_sizes=[s for _, s in axes])

    @model_validator(mode="after")
    def _paired(self) -> DeviceMesh:
        if len(self.axis_names) != len(self.axis_sizes) or not self.axis_names:
            raise GraphError(f"mesh: {len(self.axis_names)} axis names and "
                             f"{len(self.axis_sizes)} sizes; give one size per axis, at least one")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise GraphError(f"mesh: axis names repeat: {self.axis_names}")
        return self

    @property
    def devices(self) -> int:
        return math.prod(self.axis_sizes)



class NodeMode(StrEnum):
    FREE = "free"
    SAVE = "save"
    RECOMPUTE = "recompute"


class CostGraph(BaseModel):
    """Columnar cost graph. Construct with keyword lists; validation is strict."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: StrictInt = SCHEMA_VERSION
    name: StrictStr = ""

    value_id: list[NonNegInt]
    value_bytes: list[NonNegInt]
    value_shape: list[list[NonNegInt]]
    value_dtype: list[StrictStr]

    node_id: list[NonNegInt]
    node_primitive: list[StrictStr]
    node_key: list[StrictStr]
    node_flops: list[NonNegInt]
    node_mode: list[NodeMode]
    node_repeat: list[Annotated[StrictInt, Field(ge=1, lt=2**31)]]
    node_source: list[StrictStr]
    input_ptr: list[NonNegInt]
    input_ids: list[NonNegInt]
    output_ptr: list[NonNegInt]
    output_ids: list[NonNegInt]

    inputs: list[NonNegInt]
    backward_reads: list[NonNegInt]
    carry_in: list[NonNegInt] = Field(default_factory=list)
    carry_out: list[NonNegInt] = Field(default_factory=list)
    # Optional (added after version 1, absent from older graphs): per node, the
    # number of batch dimensions of a dot_general (0 for every other primitive),
    # which ``dots_with_no_batch_dims_saveable`` needs. Left out of the JSON when
    # unset, so graphs without it keep their content hash and older readers.
    node_batch_dims: list[NonNegInt] | None = Field(
        default=None, exclude_if=lambda v: v is None
    )
    # Version 2: the training step the graph plans for (a peak budget needs it,
    # ``optiremat.solver.peak``) and, per node, the index of the region in
    # ``step.regions`` it belongs to (-1: outside every region).
    step: StepMemory | None = Field(default=None, exclude_if=lambda v: v is None)
    node_region: list[Annotated[StrictInt, Field(ge=-1, lt=2**31)]] | None = Field(
        default=None, exclude_if=lambda v: v is None
    )
    # Version 2, peak budgets only: per value, the bytes it costs on the device as a
    # residual beyond ``value_bytes`` (XLA on CPU widens stacked bf16 residuals to f32
    # for the backward pass: about their size again, measured in bench/peak.py).
    value_extra_bytes: list[NonNegInt] | None = Field(
        default=None, exclude_if=lambda v: v is None
    )
    # Version 2: per value, the region whose scan stacks it over its layers (-1: none).
    value_region: list[Annotated[StrictInt, Field(ge=-1, lt=2**31)]] | None = Field(
        default=None, exclude_if=lambda v: v is None
    )
    # Version 3: the device mesh of the step; value and held bytes are then per device.
    mesh: DeviceMesh | None = Field(default=None, exclude_if=lambda v: v is None)
    # Version 3: per node, the bytes one device moves over the interconnect each time
    # the node is recomputed, its runs over a scan's length included (the all-reduce of a
    # dot's partial sums, a gather that rebuilds a split value; ``solver.collectives``).
    # Left out of the JSON when no node moves any.
    node_collective_bytes: list[NonNegInt] | None = Field(
        default=None, exclude_if=lambda v: v is None
    )

    @model_validator(mode="before")
    @classmethod
    def _integer_costs(cls, data: object) -> object:
        # Pydantic runs "before" validators last-defined first: the version check wins.
        if isinstance(data, dict):
            check_raw_columns(data)
        return data

    @model_validator(mode="before")
    @classmethod
    def _known_schema_version(cls, data: object) -> object:
        if isinstance(data, dict):
            version = data.get("schema_version", SCHEMA_VERSION)
            if version not in READABLE_VERSIONS:
                raise GraphError(
                    f"unknown schema_version {version!r}; this build reads versions "
                    f"{', '.join(map(str, READABLE_VERSIONS))}"
                )
        return data

    @model_validator(mode="after")
    def _consistent(self) -> CostGraph:
        expected = schema_version(self.mesh, self.step)
        # A version 1 graph (before steps) reads as version 2.
        if self.schema_version != expected and (self.schema_version, expected) != (1, 2):
            blocks = self.step is not None and self.step.has_blocks
            raise GraphError(
                f"schema_version {self.schema_version} with "
                f"{'a' if self.mesh is not None else 'no'} mesh and "
                f"{'a' if blocks else 'no'} block region: such a graph is version "
                f"{expected} (a mesh is version "
                f"{MESH_SCHEMA_VERSION}, a step with a region other than a scan version "
                f"{KINDS_SCHEMA_VERSION}, else {SCHEMA_VERSION})")
        check_graph(self)
        return self

    @property
    def devices(self) -> int:
        """How many devices the step runs on (1 for a graph without a mesh)."""
        return 1 if self.mesh is None else self.mesh.devices

    # ---- derived views (positions, not ids) -------------------------------

    @property
    def num_nodes(self) -> int:
        return len(self.node_id)

    @property
    def num_values(self) -> int:
        return len(self.value_id)

    @cached_property
    def value_index(self) -> dict[int, int]:
        return {v: i for i, v in enumerate(self.value_id)}

    @cached_property
    def node_inputs(self) -> list[list[int]]:
        """Per node, the positions of the values it reads."""
        idx = self.value_index
        p, ids = self.input_ptr, self.input_ids
        return [[idx[v] for v in ids[p[n] : p[n + 1]]] for n in range(self.num_nodes)]

    @cached_property
    def node_outputs(self) -> list[list[int]]:
        """Per node, the positions of the values it writes."""
        idx = self.value_index
        p, ids = self.output_ptr, self.output_ids
        return [[idx[v] for v in ids[p[n] : p[n + 1]]] for n in range(self.num_nodes)]

    @cached_property
    def producer(self) -> list[int | None]:
        """Per value, the position of the node that writes it (None for inputs)."""
        out: list[int | None] = [None] * self.num_values
        for n, outs in enumerate(self.node_outputs):
            for v in outs:
                out[v] = n
        return out

    @cached_property
    def content_hash(self) -> str:
        """sha256 of the canonical JSON: the graph's identity everywhere."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def total_bytes(self) -> int:
        return sum(self.value_bytes)


class GraphBuilder:
    """Row-at-a-time construction of a CostGraph (used by extraction and tests)."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.step: StepMemory | None = None
        self.mesh: DeviceMesh | None = None
        self.extra_bytes: list[int] = []
        self.value_regions: list[int] = []
        self.values: list[tuple[int, list[int], str]] = []
        self.nodes: list[dict[str, Any]] = []
        self.inputs: list[int] = []
        self.backward_reads: list[int] = []
        self.carry_in: list[int] = []
        self.carry_out: list[int] = []

    def value(self, nbytes: int, shape: tuple[int, ...] = (), dtype: str = "",
              extra: int = 0, region: int | None = None) -> int:
        self.values.append((int(nbytes), [int(d) for d in shape], dtype))
        self.extra_bytes.append(int(extra))
        self.value_regions.append(-1 if region is None else region)
        return len(self.values) - 1

    def input(self, nbytes: int, shape: tuple[int, ...] = (), dtype: str = "") -> int:
        v = self.value(nbytes, shape, dtype)
        self.inputs.append(v)
        return v

    def node(
        self,
        primitive: str,
        inputs: list[int],
        outputs: list[int],
        *,
        key: str = "",
        flops: int = 0,
        mode: NodeMode | str = NodeMode.FREE,
        repeat: int = 1,
        source: str = "",
        batch_dims: int | None = None,
        region: int | None = None,
        collective_bytes: int = 0,
    ) -> int:
        self.nodes.append(
            dict(
                primitive=primitive,
                inputs=list(inputs),
                outputs=list(outputs),
                key=key,
                flops=int(flops),
                mode=NodeMode(mode),
                repeat=int(repeat),
                source=source,
                batch_dims=batch_dims,
                region=region,
                collective_bytes=int(collective_bytes),
            )
        )
        return len(self.nodes) - 1

    def build(self) -> CostGraph:
        input_ptr, input_ids, output_ptr, output_ids = [0], [], [0], []
        for n in self.nodes:
            input_ids.extend(n["inputs"])
            input_ptr.append(len(input_ids))
            output_ids.extend(n["outputs"])
            output_ptr.append(len(output_ids))
        return CostGraph(
            schema_version=schema_version(self.mesh, self.step),
            mesh=self.mesh,
            name=self.name,
            value_id=list(range(len(self.values))),
            value_bytes=[v[0] for v in self.values],
            value_shape=[v[1] for v in self.values],
            value_dtype=[v[2] for v in self.values],
            node_id=list(range(len(self.nodes))),
            node_primitive=[n["primitive"] for n in self.nodes],
            node_key=[n["key"] for n in self.nodes],
            node_flops=[n["flops"] for n in self.nodes],
            node_mode=[n["mode"] for n in self.nodes],
            node_repeat=[n["repeat"] for n in self.nodes],
            node_source=[n["source"] for n in self.nodes],
            input_ptr=input_ptr,
            input_ids=input_ids,
            output_ptr=output_ptr,
            output_ids=output_ids,
            inputs=self.inputs,
            backward_reads=sorted(set(self.backward_reads)),
            carry_in=self.carry_in,
            carry_out=self.carry_out,
            node_batch_dims=(
                [n["batch_dims"] or 0 for n in self.nodes]
                if any(n["batch_dims"] is not None for n in self.nodes) else None
            ),
            step=self.step,
            node_region=(
                [-1 if n["region"] is None else n["region"] for n in self.nodes]
                if self.step is not None else None
            ),
            value_extra_bytes=list(self.extra_bytes) if any(self.extra_bytes) else None,
            value_region=list(self.value_regions) if self.step is not None else None,
            node_collective_bytes=(
                [n["collective_bytes"] for n in self.nodes]
                if any(n["collective_bytes"] for n in self.nodes) else None
            ),
        )
