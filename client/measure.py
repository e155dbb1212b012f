"""What JAX actually does with a policy: the ground truth plans are checked against."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax

import optiremat.client._jax_internals as jx
from optiremat.client.cost_model import aval_bytes, jaxpr_flops


@dataclass(frozen=True)
class Residual:
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    source: str
    host: bool = False  # offloaded: JAX keeps it in host memory (``Offloadable``)


def saved_residuals(checkpointed: Callable, *args, **kwargs) -> list[Residual]:
    """``jax.ad_checkpoint.saved_residuals``, with sizes."""
    return [
        Residual(tuple(getattr(a, "shape", ())), str(getattr(a, "dtype", "")), aval_bytes(a), src,
                 getattr(a, "memory_space", None) == jx.core.MemorySpace.Host)
        for a, src in jx.saved_residuals(checkpointed, *args, **kwargs)
    ]


def residual_bytes(checkpointed: Callable, *args, **kwargs) -> int:
    """Bytes of the residuals kept on the device (offloaded ones are not)."""
    return sum(r.bytes for r in saved_residuals(checkpointed, *args, **kwargs) if not r.host)


def _backward(checkpointed: Callable, args, kwargs):
    """The VJP function and a cotangent, abstractly: nothing is compiled or run."""
    out, vjp_fn = jax.eval_shape(
        lambda *a: jax.vjp(lambda *b: checkpointed(*b, **kwargs), *a), *args)
    return vjp_fn, out


def _apply(vjp_fn, cotangent):
    return vjp_fn(cotangent)


def backward_flops(checkpointed: Callable, *args, **kwargs) -> int:
    """FLOPs of the backward pass's jaxpr, counted with the project's cost model."""
    vjp_fn, ct = _backward(checkpointed, args, kwargs)
    return jaxpr_flops(jax.make_jaxpr(_apply)(vjp_fn, ct).jaxpr)


def xla_backward_flops(checkpointed: Callable, *args, **kwargs) -> float | None:
    """XLA's ``cost_analysis()`` FLOPs of the compiled backward pass, where it reports them."""
    vjp_fn, ct = _backward(checkpointed, args, kwargs)
    analysis = jax.jit(_apply).lower(vjp_fn, ct).compile().cost_analysis()
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else None
    if not analysis or "flops" not in analysis:
        return None
    return float(analysis["flops"])
