"""Suite-wide ordering: the modules marked ``slow`` (those that compile the most) run first.

``make test`` runs one worker per core with each file kept in one worker (``--dist
loadfile``); a long file handed out last leaves the other cores idle while it runs, so
the longest go out first.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: files keep order
