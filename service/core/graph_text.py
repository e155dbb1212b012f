"""A validated graph as the run layer holds it: its canonical JSON and content hash.

The API process validates a graph, then keeps only this. A parsed ``CostGraph`` of
200k nodes is millions of small objects; held through a solve of tens of seconds,
they interleave in the allocator's arenas with whatever else the process allocates
meanwhile, and those few survivors keep the arenas (and the memory) after the graph
is freed: four such graphs at once left the API process at x1.6 of its idle size.
One string is one block, handed back whole. It is also what a worker needs: the
pool's pipe and the cluster's Redis carry exactly this text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from optiremat.solver.graph import CostGraph


@dataclass(frozen=True, slots=True)
class GraphText:
    """``json`` is ``CostGraph.canonical_json()``; ``content_hash`` its sha256, as
    ``CostGraph.content_hash``."""

    content_hash: str
    json: str

    @classmethod
    def of(cls, graph: CostGraph) -> GraphText:
        text = graph.canonical_json()  # once: the hash and the workers share it
        return cls(hashlib.sha256(text.encode()).hexdigest(), text)

    def __repr__(self) -> str:  # never megabytes of JSON in a log line or a traceback
        return f"GraphText({self.content_hash[:12]}, {len(self.json)} chars)"
