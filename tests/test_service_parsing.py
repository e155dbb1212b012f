"""Request bodies validated in a thread (small) or a parse process (large): one answer
either way, every refusal intact across the process boundary, and a parse process
that dies costs one 503, not the server."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, NoReturn

import pytest
from fastapi.exceptions import RequestValidationError

from optiremat.service.api.models import FrontierRequest, SolveRequest, ValidFrontier
from optiremat.service.api.parsing import BodyParsers
from optiremat.service.api.problems import HTTPProblem
from optiremat.service.core.config import Settings
from optiremat.service.core.errors import Unavailable
from optiremat.service.core.graph_text import GraphText
from optiremat.service.core.memory import LARGE_BODY_BYTES
from optiremat.solver.offload import OffloadOptions, step_seconds
from tests.service_harness import body, chain

LARGE = 12_000  # nodes: a body of more than LARGE_BODY_BYTES


def parse(model: Any, raw: bytes, settings: Settings | None = None) -> Any:
    async def run() -> Any:
        parsers = BodyParsers(settings or Settings(max_concurrent_parses=1))
        try:
            return await parsers.parse(model, raw)
        finally:
            parsers.close()
    return asyncio.run(run())


@pytest.mark.parametrize("nodes", [20, LARGE], ids=["thread", "process"])
def test_a_body_is_kept_as_its_graph_text_and_fields(nodes: int) -> None:
    graph = chain(nodes, name="kept")
    raw = json.dumps(body(graph, 12345, time_limit_s=3)).encode()
    assert (len(raw) >= LARGE_BODY_BYTES) == (nodes == LARGE)
    valid = parse(SolveRequest, raw)
    assert valid.graph == GraphText.of(graph)
    assert (valid.budget_bytes, valid.options.time_limit_s) == (12345, 3)


def test_a_frontier_keeps_the_step_seconds_of_its_graph() -> None:
    graph = chain(LARGE, name="frontier")
    link = OffloadOptions(device_flop_rate=10**12, host_bandwidth=10**10)
    raw = json.dumps({"graph": graph.model_dump(mode="json"), "count": 3,
                      "options": {"offload": link.model_dump(mode="json")}}).encode()
    valid = parse(FrontierRequest, raw)
    assert isinstance(valid, ValidFrontier)
    assert valid.step_seconds == step_seconds(graph, link) and valid.count == 3


@pytest.mark.parametrize("nodes", [20, LARGE], ids=["thread", "process"])
def test_refusals_cross_the_process_boundary_intact(nodes: int) -> None:
    request = body(chain(nodes, name="refused"), 1)
    request["graph"]["input_ids"][-1] = request["graph"]["output_ids"][-1]  # a cycle
    with pytest.raises(RequestValidationError) as invalid:
        parse(SolveRequest, json.dumps(request).encode())
    [error] = invalid.value.errors()
    assert error["loc"][0] == "body" and "cycle" in error["msg"]

    with pytest.raises(RequestValidationError) as malformed:
        parse(SolveRequest, json.dumps(request).encode()[:-1])
    assert malformed.value.errors()[0]["type"] == "json_invalid"

    with pytest.raises(HTTPProblem) as over:  # the exact count, after the parse
        parse(SolveRequest, json.dumps(request).encode(),
              Settings(max_concurrent_parses=1, max_graph_nodes=nodes - 1))
    assert over.value.status == 413 and f"{nodes} nodes" in over.value.detail


class DiesInValidation:
    """A request model whose validation kills the process it runs in."""

    @classmethod
    def model_validate(cls, obj: Any) -> NoReturn:
        os._exit(3)

    def valid(self) -> None: ...


def test_a_parse_process_that_dies_is_a_503_and_the_next_body_is_parsed() -> None:
    raw = json.dumps(body(chain(LARGE, name="after"), 1)).encode()

    async def run() -> tuple[Unavailable, Any]:
        parsers = BodyParsers(Settings(max_concurrent_parses=1))
        try:
            with pytest.raises(Unavailable) as died:
                await parsers.parse(DiesInValidation, raw)  # type: ignore[arg-type]
            return died.value, await parsers.parse(SolveRequest, raw)
        finally:
            parsers.close()

    died, after = asyncio.run(run())
    assert "retry" in died.detail
    assert after.graph.content_hash == chain(LARGE, name="after").content_hash
