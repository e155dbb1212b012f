"""Failures the run layer reports to the HTTP layer, which answers them as problems."""

from __future__ import annotations


class Unavailable(Exception):
    """Something the service needs is down, full or stopping: answered ``503`` with
    ``Retry-After``. Nothing of the request was recorded."""

    def __init__(self, title: str, detail: str, retry_after_s: int = 5) -> None:
        super().__init__(detail)
        self.title, self.detail, self.retry_after_s = title, detail, retry_after_s
