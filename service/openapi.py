"""The OpenAPI document: built from the app, written to ``openapi.json`` at the repo root.

    python -m optiremat.service.openapi            # regenerate openapi.json
    python -m optiremat.service.openapi --check    # exit 1 when openapi.json is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from optiremat.service.models import FrontierRequest, SolveRequest
from optiremat.service.problems import PROBLEM_MEDIA_TYPE

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "openapi.json"


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


def main(argv: list[str] | None = None) -> int:
    from optiremat.service.config import Settings
    from optiremat.service.main import create_app

    parser = argparse.ArgumentParser(prog="python -m optiremat.service.openapi",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--path", type=Path, default=DEFAULT_PATH)
    args = parser.parse_args(argv)
    text = render(create_app(Settings()))
    if args.check:
        if not args.path.exists() or args.path.read_text() != text:
            print(f"{args.path} is stale: run python -m optiremat.service.openapi", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(text)
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
