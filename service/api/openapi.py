"""The app's OpenAPI document: problem+json errors and the request bodies the routes
parse themselves. ``python -m optiremat.service.openapi`` writes it to ``openapi.json``."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from optiremat.service.api.models import FrontierRequest, SolveRequest
from optiremat.service.api.problems import PROBLEM_MEDIA_TYPE


def _file_errors_as_problems(schema: dict[str, Any]) -> None:
    # FastAPI files every response model under application/json; errors are problem+json.
    # Its automatic 422 (for path parameters) cannot happen here: routes that can
    # answer 422 declare it.
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            for code, response in list(responses.items()):
                content = response.get("content", {})
                if "HTTPValidationError" in json.dumps(content):
                    del responses[code]
                elif int(code) >= 400 and "application/json" in content:
                    content[PROBLEM_MEDIA_TYPE] = content.pop("application/json")


def _add_request_models(schema: dict[str, Any]) -> None:
    # Routes validate their bodies off the event loop (service.deps.parse_body), so
    # FastAPI never sees the request models: file their schemas here.
    _, defs = models_json_schema([(SolveRequest, "validation"), (FrontierRequest, "validation")],
                                 ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in defs["$defs"].items():
        if components.setdefault(name, definition) != definition:
            raise RuntimeError(f"two different OpenAPI schemas are named {name!r}")
    # FastAPI files these for its own 422 answer, which problem+json replaces.
    for unused in ("HTTPValidationError", "ValidationError"):  # the first refers to the second
        if f"#/components/schemas/{unused}" not in json.dumps(schema):
            components.pop(unused, None)
    schema["components"]["schemas"] = dict(sorted(components.items()))


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                                 routes=app.routes)
            _file_errors_as_problems(schema)
            _add_request_models(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def render(app: FastAPI) -> str:
    return json.dumps(app.openapi(), indent=2, sort_keys=False) + "\n"

