"""The published contract: openapi.json matches the app, the server honours it
(schemathesis), and the service never loads JAX."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from optiremat.service.api.main import create_app
from optiremat.service.api.openapi import render
from optiremat.service.core.config import Settings
from tests.service_harness import REPO, Server, running_server

OPENAPI = REPO / "openapi.json"


def test_openapi_json_is_the_apps_schema() -> None:
    assert OPENAPI.read_text() == render(create_app(Settings())), (
        "openapi.json is stale: run `.venv/bin/python -m optiremat.service.openapi`"
    )


def test_the_service_never_imports_jax() -> None:
    code = (
        "import sys\n"
        "import optiremat.service.api.main, optiremat.service.core.pool_worker\n"
        "from optiremat.service.core.config import Settings\n"
        "optiremat.service.api.main.create_app(Settings()).openapi()\n"
        "import optiremat, optiremat.solver\n"
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_cli_does_not_import_jax() -> None:
    # -X importtime lists every module the command imported
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "optiremat", "--help"],
                         cwd=REPO, capture_output=True, text=True, check=True)
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()}
    assert "optiremat.cli" in imported or "usage: optiremat" in out.stdout
    assert not {m for m in imported if m == "jax" or m.startswith("jax.")}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A tight graph cap keeps the rare valid random graph small enough to solve at once.
    yield from running_server(tmp_path_factory, workers="2", max_graph_nodes="50",
                              sync_time_limit_s="5", job_time_limit_s="5")


schema = schemathesis.openapi.from_path(OPENAPI)
# One test per operation, each with its own id: schemathesis' own parametrize gives all of
# them one node id, and pytest-xdist (make test) then runs only one of the nine.
OPERATIONS = [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda operation: operation.label)
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_server_honours_openapi_json(operation, server: Server, data: st.DataObject) -> None:
    case = data.draw(operation.as_strategy())
    response = case.call(base_url=server.url, timeout=30)
    case.validate_response(response, checks=[
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ])


def test_openapi_json_is_valid_json_with_problem_errors() -> None:
    document = json.loads(OPENAPI.read_text())
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            for code, response in operation["responses"].items():
                if int(code) >= 400:
                    assert list(response["content"]) == ["application/problem+json"], (
                        f"{method.upper()} {path} {code}")
