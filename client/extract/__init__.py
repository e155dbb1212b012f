"""From a JAX function to the cost graph ``jax.checkpoint`` (or ``jax.vjp``) will see.

``jax.checkpoint`` JVPs the traced function and splits it with
``partial_eval_jaxpr_custom``: primal inputs known, tangents unknown. Every
equation whose inputs are all known is offered to the policy; the rest is the
backward pass. The walk (``walker``) replays that split over the JVP'd jaxpr,
with a rule per control-flow primitive (its object in ``client.interpreter``; the
cond rule in ``cond``), and records, for every value, whether the backward pass reads it;
``known`` is the same analysis at the level of flags. A training step's graph
(``client.peak.step_graph``) is walked as ``jax.vjp`` differentiates it, its
regions' checkpoints left to the solver.

| module | what it holds |
|---|---|
| ``state`` | references, the tangent graph, the walk's context and who decides |
| ``walker`` | the walk and the rules of calls, checkpoints, scans, while loops |
| ``cond`` | the cond rule and its branch summaries |
| ``known`` | which outputs partial evaluation finds known |
| ``tracing`` | ``trace``: a function as ``jax.checkpoint`` traces it |
| ``graphs`` | ``graph_of_traced`` and the public ``extract_graph`` |
"""

from optiremat.client.extract.graphs import Extraction, extract_graph, graph_of_traced
from optiremat.client.extract.state import NAME_PREFIX, ExtractionError, NamesOnly
from optiremat.client.extract.tracing import Traced, trace

__all__ = [
    "NAME_PREFIX",
    "ExtractionError",
    "Extraction",
    "NamesOnly",
    "Traced",
    "extract_graph",
    "graph_of_traced",
    "trace",
]
