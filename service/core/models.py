"""The run layer's own resource: readiness. Jobs, frontiers and problems are the
shared wire models of ``optiremat.solver.wire``, which the client parses too;
request bodies are the HTTP layer's (``optiremat.service.api.models``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class Readiness(BaseModel):
    status: Literal["ready"] = "ready"
    workers: int
    queue_depth: int
