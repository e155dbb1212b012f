"""The cost-graph wire format: round trips, and every malformed graph rejected by id.

Ids in the base graph differ from list positions (values 10..13, nodes 100..101)
so that a message naming a position instead of an id fails the test.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import pytest

from optiremat.solver import SCHEMA_VERSION, CostGraph, GraphBuilder
from optiremat.solver.graph import MESH_SCHEMA_VERSION
from optiremat.solver.offload import OffloadOptions
from optiremat.solver.solve import solve


def base() -> dict:
    """sin(x) -> a; mul(a, x) -> (b, c); the backward pass reads a."""
    return {
        "schema_version": SCHEMA_VERSION,
        "name": "base",
        "value_id": [10, 11, 12, 13],
        "value_bytes": [8, 16, 16, 4],
        "value_shape": [[2], [4], [4], [1]],
        "value_dtype": ["float32"] * 4,
        "node_id": [100, 101],
        "node_primitive": ["sin", "mul"],
        "node_key": ["sin[4]", "mul[4]"],
        "node_flops": [4, 4],
        "node_mode": ["free", "free"],
        "node_repeat": [1, 1],
        "node_source": ["model.py:1", "model.py:2"],
        "input_ptr": [0, 1, 3],
        "input_ids": [10, 11, 10],
        "output_ptr": [0, 1, 3],
        "output_ids": [11, 12, 13],
        "inputs": [10],
        "backward_reads": [11],
    }


def test_base_graph_is_valid() -> None:
    g = CostGraph.model_validate(base())
    assert g.num_nodes == 2 and g.num_values == 4
    assert g.producer == [None, 0, 1, 1]


def test_json_round_trip_keeps_content_hash() -> None:
    g = CostGraph.model_validate(base())
    again = CostGraph.model_validate_json(g.model_dump_json())
    assert again == g
    assert again.content_hash == g.content_hash
    assert CostGraph.model_validate_json(g.canonical_json()).content_hash == g.content_hash


def test_content_hash_changes_with_content() -> None:
    changed = base()
    changed["node_flops"] = [4, 5]
    assert CostGraph.model_validate(changed).content_hash != CostGraph.model_validate(
        base()
    ).content_hash


def test_builder_graph_round_trips() -> None:
    b = GraphBuilder("built")
    x = b.input(8, (2,), "float32")
    y = b.value(8, (2,), "float32")
    b.node("tanh", [x], [y], key="tanh[2]", flops=2, source="f.py:3")
    b.backward_reads.append(y)
    g = b.build()
    assert CostGraph.model_validate_json(g.model_dump_json()).content_hash == g.content_hash


def _set(field: str, value: object) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        d[field] = value

    return mutate

def _with_step(**columns) -> Callable[[dict], None]:
    """The base graph as a step with one region of two layers, and ``columns``."""
    def mutate(data: dict) -> None:
        data["step"] = {"argument_bytes": 8, "output_bytes": 8, "regions": [
            {"source": "model.py:3", "length": 2, "working_bytes": 64}]}
        data.update(columns)
    return mutate


def _on_mesh(**columns: object) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        d.update(schema_version=MESH_SCHEMA_VERSION,
                 mesh={"axis_names": ["data"], "axis_sizes": [2]}, **columns)
    return mutate


MALFORMED = {
    # node 100 reads c, which node 101 writes from a, which node 100 writes
    "cycle": (_set("input_ids", [12, 11, 10]), r"cycle through node 100"),
    "dangling edge read": (_set("input_ids", [10, 11, 99]), r"node 101 \(mul\) reads value 99"),
    "dangling edge write": (
        _set("output_ids", [11, 12, 98]),
        r"node 101 \(mul\) writes value 98",
    ),
    "dangling input": (_set("inputs", [10, 97]), r"inputs names value 97"),
    "dangling backward read": (
        _set("backward_reads", [11, 96]),
        r"backward_reads names value 96",
    ),
    "negative bytes": (_set("value_bytes", [8, -16, 16, 4]), r"value 11 has bytes -16"),
    "fractional bytes": (_set("value_bytes", [8, 16, 1.5, 4]), r"value 12 has bytes 1\.5"),
    "string bytes": (_set("value_bytes", [8, 16, 16, "12"]), r"value 13 has bytes '12'"),
    "duplicate value id": (_set("value_id", [10, 11, 11, 13]), r"duplicate value id 11"),
    "duplicate node id": (_set("node_id", [100, 100]), r"duplicate node id 100"),
    "value written twice": (
        _set("output_ids", [11, 11, 13]),
        r"value 11 is written by node 100 and node 101",
    ),
    "unknown schema version": (_set("schema_version", 7), r"unknown schema_version 7"),
    "value column too short": (
        _set("value_bytes", [8, 16, 16]),
        r"value_bytes has 3 entries, value_id has 4",
    ),
    "node column too long": (
        _set("node_flops", [4, 4, 4]),
        r"node_flops has 3 entries, node_id has 2",
    ),
    "edge pointer too short": (_set("input_ptr", [0, 3]), r"input_ptr must have 3 entries"),
    "value with no producer": (_set("inputs", []), r"value 10 has no producing node"),
    "node in a region the step lacks": (
        _with_step(node_region=[0, 1]), r"node 101 is in region 1, but the step has 1"),
    "region column too short": (
        _with_step(value_region=[0, -1]), r"value_region has 2 entries, there are 4 values"),
    # what the solver's 64-bit integers hold: each entry, and the sums the formulation builds
    "bytes past int64": (_set("value_bytes", [8, 10**300, 16, 4]),
                         r"value 11 has bytes 10000000\.\.\.\(301 digits\).*< 2\*\*62"),
    "flops past int64": (_set("node_flops", [4, 2**70]), r"node 101 has flops .*< 2\*\*62"),
    "bytes adding up past int64": (_set("value_bytes", [2**61] * 4),
                                   r"bytes .* add up to .*below 2\*\*62"),
    "flops adding up past int64": (_set("node_flops", [2**61, 2**61]),
                                   r"FLOPs \(node_flops\) add up to"),
    "held bytes adding up past int64": (
        _with_step(node_region=[-1, -1], value_region=[-1] * 4,
                   step={"argument_bytes": 2**61, "output_bytes": 2**61}),
        r"bytes .* add up to"),
    "working bytes past int64": (
        _with_step(node_region=[0, -1], value_region=[0, -1, -1, -1],
                   step={"argument_bytes": 8, "output_bytes": 8, "regions": [
                       {"source": "s", "length": 2, "working_bytes": 2**80}]}),
        r"working_bytes\s+Input should be less than 4611686018427387904"),
    "collective bytes off a mesh": (_set("node_collective_bytes", [0, 8]),
                                    r"node_collective_bytes without a mesh"),
    "collective bytes column too short": (
        _on_mesh(node_collective_bytes=[8]), r"node_collective_bytes has 1 entries"),
    "negative collective bytes": (_on_mesh(node_collective_bytes=[0, -8]),
                                  r"node 101 has collective bytes -8"),
    "aliases above arguments and outputs": (
        _with_step(node_region=[-1, -1], value_region=[-1] * 4,
                   step={"argument_bytes": 8, "output_bytes": 8, "alias_bytes": 17}),
        r"step.alias_bytes \(17\) exceeds step.argument_bytes \+ step.output_bytes"),
}



@pytest.mark.parametrize("wire", [False, True], ids=["dict", "json"])
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_graph_is_rejected_naming_the_offender(case: str, wire: bool) -> None:
    mutate, message = MALFORMED[case]
    data = copy.deepcopy(base())
    mutate(data)
    with pytest.raises(ValueError, match=message):
        if wire:
            CostGraph.model_validate_json(json.dumps(data))
        else:
            CostGraph.model_validate(data)


@pytest.mark.parametrize(("budget", "offload", "message"), [
    (10**29, None, r"^budget_bytes is 10000000\.\.\.\(30 digits\); it must be below 2\*\*62"),
    (2**62, None, r"^budget_bytes is 4611686018427387904; it must be below 2\*\*62"),
    (10**6, OffloadOptions(host_bandwidth=7, device_flop_rate=10**18),
     r"^options.offload: the offload objective does not fit 64-bit integers"),
])
def test_a_solve_past_what_64_bit_integers_hold_is_one_clear_line(
        budget: int, offload: OffloadOptions | None, message: str) -> None:
    graph = CostGraph.model_validate(base())
    with pytest.raises(ValueError, match=message) as error:
        solve(graph, budget, offload=offload)
    assert "\n" not in str(error.value)


def test_a_graph_on_a_mesh_is_version_3_and_older_graphs_read_as_one_device() -> None:
    plain = CostGraph(**base())
    assert plain.schema_version == SCHEMA_VERSION == 2 and plain.mesh is None
    assert plain.devices == 1 and "mesh" not in json.loads(plain.canonical_json())
    sharded = CostGraph(**{**base(), "schema_version": MESH_SCHEMA_VERSION,
                           "mesh": {"axis_names": ["data", "model"], "axis_sizes": [2, 4]}})
    assert sharded.devices == 8
    assert CostGraph.model_validate_json(sharded.canonical_json()) == sharded
    assert sharded.content_hash != plain.content_hash
    v1 = {k: v for k, v in base().items()} | {"schema_version": 1}
    assert CostGraph(**v1).devices == 1


@pytest.mark.parametrize(("version", "mesh", "message"), [
    (2, {"axis_names": ["data"], "axis_sizes": [8]}, "version 3"),
    (3, None, "no mesh and no block region: such a graph is version 2"),
    (3, {"axis_names": ["data"], "axis_sizes": [8, 2]}, "one size per axis"),
    (3, {"axis_names": ["data", "data"], "axis_sizes": [2, 2]}, "repeat"),
    (3, {"axis_names": ["data"], "axis_sizes": [0]}, "axis_sizes"),
])
def test_a_mesh_and_its_version_go_together(version: int, mesh: dict | None,
                                             message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CostGraph(**{**base(), "schema_version": version, "mesh": mesh})


BLOCK = {"source": "model.py:3", "length": 1, "working_bytes": 4, "carry_bytes": 8,
         "kind": "block", "found": "repeated"}


def _with_regions(version: int, *regions: dict) -> dict:
    return {**base(), "schema_version": version,
            "step": {"argument_bytes": 8, "output_bytes": 8, "regions": list(regions)}}


def test_a_block_region_is_version_4_and_round_trips() -> None:
    graph = CostGraph(**_with_regions(4, BLOCK))
    assert graph.step is not None and graph.step.regions[0].kind == "block"
    assert CostGraph.model_validate_json(graph.canonical_json()) == graph
    scan = {"source": "model.py:9", "length": 3, "working_bytes": 4}
    scans_only = CostGraph(**_with_regions(2, scan))
    assert "kind" not in scans_only.canonical_json()  # a scan's graph keeps its JSON


@pytest.mark.parametrize(("version", "region", "message"), [
    (2, BLOCK, "block region: such a graph is version 4"),
    (4, {"source": "s", "length": 3, "working_bytes": 4}, "version 2"),
    (4, {**BLOCK, "found": "scan"}, "cannot be found as 'scan'"),
    (4, {**BLOCK, "length": 2}, "runs once"),
    (4, {**BLOCK, "kind": "loop"}, "kind"),
])
def test_region_kinds_and_the_version_go_together(version: int, region: dict,
                                                  message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CostGraph(**_with_regions(version, region))
