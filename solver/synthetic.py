"""Synthetic transformer-like cost graphs for benchmarks and tests.

Shapes, FLOPs and backward reads follow a pre-LN transformer block (layer norm,
attention with softmax, tanh-GELU MLP, residual adds) as JAX's JVP would show
it; every layer has the same shapes, so policy keys repeat across layers as
they do in real models. About 45 nodes per layer.
"""

from __future__ import annotations

from math import prod

from optiremat.solver.graph import CostGraph, GraphBuilder

_DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


class _Tracer:
    """Adds nodes to a GraphBuilder, with the key a stateless policy would compute."""

    def __init__(self, builder: GraphBuilder) -> None:
        self.b = builder
        self.shape: dict[int, tuple[int, ...]] = {}
        self.dtype: dict[int, str] = {}

    def input(self, shape: tuple[int, ...], dtype: str = "bfloat16") -> int:
        v = self.b.input(prod(shape) * _DTYPE_BYTES[dtype], shape, dtype)
        self.shape[v], self.dtype[v] = shape, dtype
        return v

    def op(
        self,
        prim: str,
        inputs: list[int],
        shape: tuple[int, ...],
        *,
        flops: int | None = None,
        reads: tuple[int, ...] = (),  # positions in ``inputs`` the backward pass reads
        reads_output: bool = False,
        dtype: str = "bfloat16",
        batch_dims: int | None = None,
    ) -> int:
        out = self.b.value(prod(shape) * _DTYPE_BYTES[dtype], shape, dtype)
        self.shape[out], self.dtype[out] = shape, dtype
        key = f"{prim}(" + ",".join(
            f"{self.dtype[v]}{list(self.shape[v])}" for v in inputs
        ) + f")->{list(shape)}"
        self.b.node(prim, inputs, [out], key=key,
                    flops=prod(shape) if flops is None else flops,
                    batch_dims=batch_dims if batch_dims is not None else
                    (0 if prim == "dot_general" else None))
        self.b.backward_reads.extend(inputs[i] for i in reads)
        if reads_output:
            self.b.backward_reads.append(out)
        return out


def _layer_norm(t: _Tracer, h: int, scale: int, rows: tuple[int, ...]) -> int:
    stat = (*rows, 1)
    shape = t.shape[h]
    mean = t.op("reduce_mean", [h], stat, flops=prod(shape), dtype="float32")
    centered = t.op("sub", [h, mean], shape)
    square = t.op("mul", [centered, centered], shape, reads=(0,))
    var = t.op("reduce_mean", [square], stat, flops=prod(shape), dtype="float32")
    shifted = t.op("add", [var], stat, dtype="float32")
    rstd = t.op("rsqrt", [shifted], stat, reads_output=True, dtype="float32")
    normed = t.op("mul", [centered, rstd], shape, reads=(0, 1))
    return t.op("mul", [normed, scale], shape, reads=(0, 1))


def _dot(t: _Tracer, x: int, w: int, shape: tuple[int, ...], contracted: int) -> int:
    return t.op("dot_general", [x, w], shape, flops=2 * prod(shape) * contracted, reads=(0, 1))


def transformer_like(
    num_layers: int,
    *,
    batch: int = 4,
    seq: int = 512,
    d_model: int = 1024,
    heads: int = 16,
    mlp_ratio: int = 4,
) -> CostGraph:
    """A stack of ``num_layers`` identical pre-LN transformer blocks."""
    t = _Tracer(GraphBuilder(f"transformer_like_{num_layers}"))
    rows = (batch, seq)
    act, hidden = (*rows, d_model), (*rows, mlp_ratio * d_model)
    split = (batch, heads, seq, d_model // heads)
    scores = (batch, heads, seq, seq)
    h = t.input(act)
    softmax_scale = t.input((), "float32")
    for _ in range(num_layers):
        ln1, ln2 = t.input((d_model,)), t.input((d_model,))
        wq, wk, wv, wo = (t.input((d_model, d_model)) for _ in range(4))
        w_up, w_down = t.input((d_model, mlp_ratio * d_model)), t.input((mlp_ratio * d_model,
                                                                         d_model))
        # attention
        y = _layer_norm(t, h, ln1, rows)
        q, k, v = (t.op("reshape", [_dot(t, y, w, act, d_model)], split, flops=0)
                   for w in (wq, wk, wv))
        s = t.op("dot_general", [q, k], scores, flops=2 * prod(scores) * split[-1],
                 reads=(0, 1), batch_dims=2)
        s = t.op("mul", [s, softmax_scale], scores, reads=(1,))
        m = t.op("reduce_max", [s], (*scores[:-1], 1), flops=prod(scores))
        e = t.op("exp", [t.op("sub", [s, m], scores)], scores, reads_output=True)
        z = t.op("reduce_sum", [e], (*scores[:-1], 1), flops=prod(scores))
        p = t.op("div", [e, z], scores, reads=(0, 1))
        o = t.op("dot_general", [p, v], split, flops=2 * prod(split) * seq, reads=(0, 1),
                 batch_dims=2)
        o = t.op("reshape", [o], act, flops=0)
        h = t.op("add", [h, _dot(t, o, wo, act, d_model)], act)
        # tanh-GELU MLP
        y = _layer_norm(t, h, ln2, rows)
        u = _dot(t, y, w_up, hidden, d_model)
        u2 = t.op("mul", [u, u], hidden, reads=(0,))
        u3 = t.op("mul", [u2, u], hidden, reads=(0, 1))
        inner = t.op("add", [u, t.op("mul", [u3, softmax_scale], hidden, reads=(1,))], hidden)
        th = t.op("tanh", [t.op("mul", [inner, softmax_scale], hidden, reads=(1,))], hidden,
                  reads_output=True)
        gate = t.op("add", [th], hidden)
        g = t.op("mul", [u, gate], hidden, reads=(0, 1))
        h = t.op("add", [h, _dot(t, g, w_down, act, mlp_ratio * d_model)], act)
    return t.b.build()
