"""The OpenAPI document: built from the app, written to ``openapi.json`` at the repo root.

    python -m service.openapi            # regenerate openapi.json
    python -m service.openapi --check    # exit 1 when openapi.json is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from service.problems import PROBLEM_MEDIA_TYPE

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "openapi.json"


def _file_errors_as_problems(schema: dict[str, Any]) -> None:
    # FastAPI files every response model under application/json; errors are problem+json.
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            for code, response in operation.get("responses", {}).items():
                content = response.get("content", {})
                if int(code) >= 400 and "application/json" in content:
                    content[PROBLEM_MEDIA_TYPE] = content.pop("application/json")


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                                 routes=app.routes)
            _file_errors_as_problems(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def render(app: FastAPI) -> str:
    return json.dumps(app.openapi(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    from service.config import Settings
    from service.main import create_app

    parser = argparse.ArgumentParser(prog="python -m service.openapi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--path", type=Path, default=DEFAULT_PATH)
    args = parser.parse_args(argv)
    text = render(create_app(Settings()))
    if args.check:
        if not args.path.exists() or args.path.read_text() != text:
            print(f"{args.path} is stale: run python -m service.openapi", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(text)
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
