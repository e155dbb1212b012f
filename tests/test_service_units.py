"""Service pieces on their own: settings, body decoding, the store, the Pareto marks."""

from __future__ import annotations

import asyncio
import gzip
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from optiremat.service.api.middleware import BodyDecodingMiddleware
from optiremat.service.api.models import FrontierPoint
from optiremat.service.core.config import Settings
from optiremat.service.core.front import _mark_pareto
from optiremat.service.core.store import Store
from optiremat.service.core.worker import BudgetRange, Infeasible, Solved
from optiremat.solver.solution import SolveStatus


def test_settings_come_from_optiremat_variables(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    for name in ("PORT", "HOST", "DATA_DIR", "API_KEYS"):
        monkeypatch.delenv(f"OPTIREMAT_{name}", raising=False)
    defaults = Settings()
    assert (defaults.host, defaults.port, defaults.api_keys) == ("127.0.0.1", 8000, ())
    assert "optiremat" in str(defaults.data_dir)
    monkeypatch.setenv("OPTIREMAT_PORT", "9123")
    monkeypatch.setenv("OPTIREMAT_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("OPTIREMAT_API_KEYS", " one, two ,,")
    configured = Settings()
    assert configured.port == 9123 and configured.data_dir == tmp_path
    assert configured.api_keys == ("one", "two")
    assert configured.database_path.parent == tmp_path


async def _echo(request: Request) -> Response:
    return Response(await request.body(), media_type="application/octet-stream")


def decoding_client(limit: int) -> Starlette:
    app = Starlette(routes=[Route("/", _echo, methods=["POST"])])
    app.add_middleware(BodyDecodingMiddleware, max_body_bytes=limit)
    return app


def post(app: Starlette, content: bytes, encoding: str | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if encoding:
        headers["Content-Encoding"] = encoding

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/", content=content, headers=headers)

    return asyncio.run(send())


def test_gzip_bodies_are_decoded_including_multiple_members() -> None:
    client = decoding_client(1000)
    assert post(client, gzip.compress(b'{"a": 1}'), "gzip").content == b'{"a": 1}'
    two = gzip.compress(b'{"a": ') + gzip.compress(b"1}")
    assert post(client, two, "gzip").content == b'{"a": 1}'
    assert post(client, b"[1, 2]").content == b"[1, 2]"


def test_the_cap_applies_to_decoded_bytes() -> None:
    client = decoding_client(100_000)
    assert post(client, gzip.compress(b" " * 100_000), "gzip").status_code == 200
    bomb = post(client, gzip.compress(b" " * 10_000_000), "gzip")  # 10 kB on the wire
    assert bomb.status_code == 413 and "inflates past 100000" in bomb.json()["detail"]
    assert post(client, b" " * 100_001).status_code == 413


def test_broken_gzip_is_a_400() -> None:
    client = decoding_client(1000)
    assert post(client, gzip.compress(b"{}")[:-6], "gzip").status_code == 400
    assert post(client, b"plain", "gzip").status_code == 400


def test_the_store_keeps_results_and_jobs(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite3")
    for key, result in (("a", Solved('{"x": 1}')), ("b", Infeasible(5, 77)),
                        ("c", BudgetRange(1, 9))):
        store.put_result(key, result)
        assert store.get_result(key) == result
    store.put_result("a", Solved('{"x": 2}'))  # first answer wins: answers never change
    assert store.get_result("a") == Solved('{"x": 1}')
    assert store.get_result("missing") is None

    spec = {"graph_hash": "h", "budget_bytes": 5, "options": {}}
    store.put_job("j", "queued", spec, "{}")
    assert store.unfinished_jobs() == [("j", spec, "{}")]
    store.update_job("j", "succeeded", solution_json='{"x": 1}', progress={"elapsed_s": 1.0})
    store.close()
    reopened = Store(tmp_path / "db.sqlite3")
    job = reopened.get_job("j")
    assert job is not None and job.status == "succeeded" and job.solution_json == '{"x": 1}'
    assert job.progress == {"elapsed_s": 1.0} and reopened.unfinished_jobs() == []


def test_pareto_marks_the_points_nothing_beats() -> None:
    def point(budget: int, residual: int, flops: int) -> FrontierPoint:
        return FrontierPoint(budget_bytes=budget, status=SolveStatus.OPTIMAL,
                             residual_bytes=residual, recompute_flops=flops)

    points = [FrontierPoint(budget_bytes=1, status=SolveStatus.INFEASIBLE),
              point(10, 9, 50), point(20, 9, 50), point(30, 25, 60), point(40, 30, 0)]
    _mark_pareto(points)
    assert [p.pareto for p in points] == [False, True, True, False, True]
