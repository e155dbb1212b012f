"""``/docs``: Swagger UI served from the service itself, never from a public CDN.

FastAPI's default page loads its script and styles from a CDN, so it is blank
offline and in air-gapped clusters. The assets come from the ``swagger-ui-py``
package (Swagger UI 5, which reads OpenAPI 3.1), mounted under ``/docs/assets``.
"""

from __future__ import annotations

from pathlib import Path

import swagger_ui
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_URL = "/docs"
ASSETS_URL = f"{DOCS_URL}/assets"
ASSETS_DIR = Path(swagger_ui.__file__).parent / "static"


def install_docs(app: FastAPI) -> None:
    """Serve Swagger UI at ``/docs`` with its own assets (create the app with
    ``docs_url=None``)."""
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS_DIR), name="docs-assets")

    @app.get(DOCS_URL, include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")  # behind a path prefix
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - API",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon-32x32.png")
