"""``/docs`` is Swagger UI served by the service itself: the page names no other host and
every asset it loads is served, so it works offline and in air-gapped clusters."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.service_harness import Server, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running_server(tmp_path_factory, workers="1")


def test_docs_load_their_assets_from_the_service_not_a_cdn(server: Server) -> None:
    with server.client() as client:
        page = client.get("/docs")
        assert page.status_code == 200 and "SwaggerUIBundle" in page.text
        assert not re.findall(r"https?://", page.text), "the page names another host"
        loaded = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", page.text)
        assert {"/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css"} <= set(loaded)
        for url in loaded:
            asset = client.get(url)
            assert asset.status_code == 200 and asset.content, url
        script = client.get("/docs/assets/swagger-ui-bundle.js")
        assert "javascript" in script.headers["content-type"]
        assert b"SwaggerUIBundle" in script.content
        assert "'/openapi.json'" in page.text and client.get("/openapi.json").status_code == 200
