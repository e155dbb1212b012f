"""Failures the run layer reports to the HTTP layer, which answers them as problems."""

from __future__ import annotations

from optiremat.solver.wire import QUEUE_FULL, ProblemType

# A queue at its bound drains one solve at a time; asking again after about a short
# solve's time is neither a stampede nor a long wait.
QUEUE_FULL_RETRY_S = 10


class Unavailable(Exception):
    """Something the service needs is down, full or stopping: answered ``503`` with
    ``Retry-After``. Nothing of the request was recorded."""

    def __init__(self, title: str, detail: str, retry_after_s: int = 5, *,
                 type: str = "about:blank") -> None:
        super().__init__(detail)
        self.title, self.detail, self.retry_after_s = title, detail, retry_after_s
        self.type = type

    @classmethod
    def of(cls, kind: ProblemType, detail: str, retry_after_s: int = 5) -> Unavailable:
        """One of the problem types the service defines, with that type's title."""
        return cls(kind.title, detail, retry_after_s, type=kind.uri)


def queue_full(queued: int, limit: int) -> Unavailable:
    return Unavailable.of(
        QUEUE_FULL,
        f"{queued} solves are waiting for a worker, the most this server queues "
        f"(OPTIREMAT_MAX_QUEUED_JOBS={limit}); retry later",
        QUEUE_FULL_RETRY_S)
