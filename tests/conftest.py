"""Suite-wide: the modules marked ``slow`` (those that compile the most) run first, and the
service fixtures most modules share.

``make test`` runs one worker per core with each file kept in one worker (``--dist
loadfile``); a long file handed out last leaves the other cores idle while it runs, so
the longest go out first.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from optiremat.client.memory_cache import CACHE_DIR_ENV
from optiremat.client.remote import RematClient
from tests.service_harness import Server, running_server

# Every test compiles what it measures: a cache folder set where the suite runs would hand
# it another process's figures (tests/test_memory_cache.py sets its own).
os.environ.pop(CACHE_DIR_ENV, None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: files keep order


# A module's own server (its data in a temporary folder) on loopback, and a client of it;
# a module that needs other settings defines its own ``server``.
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running_server(tmp_path_factory)


@pytest.fixture
def remote(server: Server) -> Iterator[RematClient]:
    with RematClient(server.url) as client:
        yield client
