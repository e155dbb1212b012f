"""The scan-layout corpus: layer stacks under ``lax.scan``, as models are trained.

Each entry builds ``(loss, args)``: ``loss(params, x)`` is a scalar, the layers'
parameters are stacked along a leading axis of length ``layers`` and the body
of one ``lax.scan`` applies one layer. Shapes are small enough that the whole
corpus compiles on two CPU cores in well under a minute, and large enough that
activations, not bookkeeping, decide the peak.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Params = dict[str, jax.Array]


def _weights(seed: int, layers: int, shapes: dict[str, tuple[int, ...]], dtype,
             abstract: bool = False) -> Params:
    if abstract:  # shapes only: an 8B-parameter stack is planned without its weights
        return {name: jax.ShapeDtypeStruct((layers, *shape), dtype)
                for name, shape in shapes.items()}
    # numpy, not jax.random: building the corpus compiles nothing.
    rng = np.random.default_rng(seed)
    return {name: jnp.asarray(rng.standard_normal((layers, *shape)) * 0.02, dtype)
            for name, shape in shapes.items()}


def _stack(layer: Callable[[jax.Array, Params], jax.Array]) -> Callable[[Params, jax.Array],
                                                                        jax.Array]:
    def loss(params: Params, x: jax.Array) -> jax.Array:
        def body(h, p):
            return layer(h, p), None
        h, _ = lax.scan(body, x, params)
        return jnp.mean(jnp.square(h.astype(jnp.float32)))
    return loss


# ---- Llama: RMSNorm, RoPE, grouped-query attention, SwiGLU ----------------------


def _rmsnorm(x: jax.Array, scale: jax.Array) -> jax.Array:
    var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return (x * lax.rsqrt(var + 1e-6).astype(x.dtype)) * (1 + scale)


def _rope(x: jax.Array) -> jax.Array:
    _, t, _, d = x.shape
    freq = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angle = jnp.arange(t, dtype=jnp.float32)[:, None] * freq[None, :]
    sin = jnp.sin(angle)[None, :, None, :].astype(x.dtype)
    cos = jnp.cos(angle)[None, :, None, :].astype(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def llama_layer(heads: int, kv_heads: int,
                window: int | None = None) -> Callable[[jax.Array, Params], jax.Array]:
    """A Llama layer; its attention sees the last ``window`` positions (None: all)."""
    def layer(h: jax.Array, p: Params) -> jax.Array:
        b, t, d = h.shape
        hd = d // heads
        x = _rmsnorm(h, p["attn_norm"])
        q = _rope((x @ p["wq"]).reshape(b, t, heads, hd))
        k = _rope((x @ p["wk"]).reshape(b, t, kv_heads, hd))
        v = (x @ p["wv"]).reshape(b, t, kv_heads, hd)
        k = jnp.repeat(k, heads // kv_heads, axis=2)
        v = jnp.repeat(v, heads // kv_heads, axis=2)
        scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / np.sqrt(hd)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        if window is not None:
            causal = causal & jnp.triu(jnp.ones((t, t), dtype=bool), -window)
        scores = jnp.where(causal, scores, -1e9)
        attn = jax.nn.softmax(scores, axis=-1).astype(h.dtype)
        o = jnp.einsum("bhts,bshd->bthd", attn, v).reshape(b, t, d)
        h = h + o @ p["wo"]
        x = _rmsnorm(h, p["mlp_norm"])
        return h + (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]
    return layer


def llama(layers: int = 8, d: int = 256, ffn: int = 688, heads: int = 8, kv_heads: int = 2,
          batch: int = 2, seq: int = 128, dtype: Any = jnp.float32,
          abstract: bool = False) -> tuple[Callable, tuple]:
    """A Llama stack; ``abstract`` gives ``jax.ShapeDtypeStruct`` arguments, no weights."""
    hd = d // heads
    params = _weights(0, layers, {
        "wq": (d, d), "wk": (d, kv_heads * hd), "wv": (d, kv_heads * hd), "wo": (d, d),
        "w_gate": (d, ffn), "w_up": (d, ffn), "w_down": (ffn, d),
        "attn_norm": (d,), "mlp_norm": (d,)}, dtype, abstract)
    if abstract:
        return _stack(llama_layer(heads, kv_heads)), (
            params, jax.ShapeDtypeStruct((batch, seq, d), dtype))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((batch, seq, d)), dtype)
    return _stack(llama_layer(heads, kv_heads)), (params, x)


# ---- ViT encoder block: LayerNorm, full attention, GELU MLP ------------------------


def small_llama() -> tuple[Callable, tuple]:
    """The 8-layer stack tests/test_layer_groups.py plans apart (D 128, B 2, T 128), small
    enough to plan in seconds; ``bench/layer_groups.py --sweep`` plans it too."""
    return llama(layers=8, d=128, ffn=344, heads=4, kv_heads=2, batch=2, seq=128)


def _layernorm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + 1e-6) * (1 + scale) + bias


def vit_layer(heads: int) -> Callable[[jax.Array, Params], jax.Array]:
    def layer(h: jax.Array, p: Params) -> jax.Array:
        b, t, d = h.shape
        x = _layernorm(h, p["ln1_scale"], p["ln1_bias"])
        qkv = (x @ p["w_qkv"] + p["b_qkv"]).reshape(b, t, 3, heads, d // heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        attn = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // heads), -1)
        h = h + jnp.einsum("bhts,bshd->bthd", attn, v).reshape(b, t, d) @ p["w_o"]
        x = _layernorm(h, p["ln2_scale"], p["ln2_bias"])
        return h + jax.nn.gelu(x @ p["w_1"] + p["b_1"]) @ p["w_2"]
    return layer


def vit(layers: int = 12, d: int = 192, heads: int = 3, mlp: int = 768, batch: int = 4,
        patches: int = 197) -> tuple[Callable, tuple]:
    params = _weights(2, layers, {
        "w_qkv": (d, 3 * d), "b_qkv": (3 * d,), "w_o": (d, d), "w_1": (d, mlp), "b_1": (mlp,),
        "w_2": (mlp, d), "ln1_scale": (d,), "ln1_bias": (d,), "ln2_scale": (d,),
        "ln2_bias": (d,)}, jnp.float32)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((batch, patches, d)), jnp.float32)
    return _stack(vit_layer(heads)), (params, x)


# ---- residual MLP ------------------------------------------------------------------


def mlp_layer(h: jax.Array, p: Params) -> jax.Array:
    x = _layernorm(h, p["scale"], p["bias"])
    return h + jnp.tanh(x @ p["w_in"]) @ p["w_out"]


def mlp(layers: int = 32, d: int = 512, hidden: int = 2048,
        batch: int = 256) -> tuple[Callable, tuple]:
    params = _weights(4, layers, {"w_in": (d, hidden), "w_out": (hidden, d), "scale": (d,),
                                  "bias": (d,)}, jnp.float32)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((batch, d)), jnp.float32)
    return _stack(mlp_layer), (params, x)


# ---- residual CNN: two 3x3 convolutions with GroupNorm -----------------------------


def _groupnorm(x: jax.Array, scale: jax.Array, groups: int = 8) -> jax.Array:
    n, hh, ww, c = x.shape
    g = x.reshape(n, hh, ww, groups, c // groups)
    mu = jnp.mean(g, axis=(1, 2, 4), keepdims=True)
    var = jnp.mean(jnp.square(g - mu), axis=(1, 2, 4), keepdims=True)
    return ((g - mu) * lax.rsqrt(var + 1e-5)).reshape(x.shape) * (1 + scale)


def cnn_layer(h: jax.Array, p: Params) -> jax.Array:
    dn = ("NHWC", "HWIO", "NHWC")
    x = jax.nn.relu(_groupnorm(h, p["gn1"]))
    x = lax.conv_general_dilated(x, p["k1"], (1, 1), "SAME", dimension_numbers=dn)
    x = jax.nn.relu(_groupnorm(x, p["gn2"]))
    return h + lax.conv_general_dilated(x, p["k2"], (1, 1), "SAME", dimension_numbers=dn)


def cnn(layers: int = 6, channels: int = 64, batch: int = 8,
        size: int = 32) -> tuple[Callable, tuple]:
    params = _weights(6, layers, {"k1": (3, 3, channels, channels),
                                  "k2": (3, 3, channels, channels),
                                  "gn1": (channels,), "gn2": (channels,)}, jnp.float32)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((batch, size, size, channels)),
                    jnp.float32)
    return _stack(cnn_layer), (params, x)


def residual_stack(layers: int = 16, d: int = 128, batch: int = 512) -> tuple[Callable, tuple]:
    """A stack whose activations outweigh its parameters (offload's case)."""
    def loss(ws: jax.Array, x: jax.Array) -> jax.Array:
        def layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
            return h + jnp.tanh(h @ w) @ w.T, None
        h, _ = lax.scan(layer, x, ws)
        return jnp.mean(h ** 2)

    key = jax.random.PRNGKey(0)
    ws = jax.random.normal(key, (layers, d, d)) * 0.05
    x = jax.random.normal(jax.random.fold_in(key, 1), (batch, d))
    return loss, (ws, x)


# ---- named axes: every op mapped over the token axes, the stack fully unrolled ------


def named_axes_layer(heads: int) -> Callable[[jax.Array, Params], jax.Array]:
    """A decoder layer as libraries with named-axis arrays write it (penzai's
    ``nmap``): each op a function of one token or one head, ``vmap``-ed over the
    others, the axes moved around each contraction."""
    def tokens(f: Callable) -> Callable:  # over batch and sequence
        return jax.vmap(jax.vmap(f))

    def norm(x: jax.Array, scale: jax.Array) -> jax.Array:
        return x * lax.rsqrt(jnp.mean(x * x) + 1e-6) * (1 + scale)

    def layer(h: jax.Array, p: Params) -> jax.Array:
        b, t, d = h.shape
        x = tokens(lambda v: norm(v, p["norm1"]))(h)
        q, k, v = (jnp.moveaxis(tokens(lambda v, w=p[w]: v @ w)(x).reshape(b, t, heads, -1),
                                2, 1) for w in ("w_q", "w_k", "w_v"))
        heads_of = jax.vmap(jax.vmap(lambda q, k: jax.nn.softmax(q @ k.T / 8.0, -1)))
        o = jax.vmap(jax.vmap(lambda a, v: a @ v))(heads_of(q, k), v)
        h = h + tokens(lambda v: v @ p["w_o"])(jnp.moveaxis(o, 1, 2).reshape(b, t, d))
        x = tokens(lambda v: norm(v, p["norm2"]))(h)
        return h + tokens(lambda v: jax.nn.gelu(v @ p["w_1"]) @ p["w_2"])(x)
    return layer


def named_axes(layers: int = 4, d: int = 256, ffn: int = 1024, heads: int = 8,
               batch: int = 4, seq: int = 128) -> tuple[Callable, tuple]:
    """penzai's layer stack: a ``lax.scan`` with ``unroll=True``, which XLA sees as
    straight-line code (plans place it as a loop: ``scan_region.looped_unroll``)."""
    params = _weights(8, layers, {
        "w_q": (d, d), "w_k": (d, d), "w_v": (d, d), "w_o": (d, d), "w_1": (d, ffn),
        "w_2": (ffn, d), "norm1": (d,), "norm2": (d,)}, jnp.float32)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((batch, seq, d)), jnp.float32)
    layer = named_axes_layer(heads)

    def loss(params: Params, x: jax.Array) -> jax.Array:
        h, _ = lax.scan(lambda h, p: (layer(h, p), None), x, params, unroll=True)
        return jnp.mean(jnp.square(h))
    return loss, (params, x)


@dataclass(frozen=True)
class Model:
    name: str
    build: Callable[[], tuple[Callable, tuple]]


CORPUS = [
    Model("llama_f32_L8", lambda: llama(layers=8)),
    Model("llama_bf16_L16", lambda: llama(layers=16, dtype=jnp.bfloat16)),
    Model("llama_f32_L4", lambda: llama(layers=4, seq=256)),
    Model("vit_L12", lambda: vit(layers=12)),
    Model("mlp_L32", lambda: mlp(layers=32)),
    Model("cnn_L6", lambda: cnn(layers=6)),
    Model("named_axes_L4", lambda: named_axes(layers=4)),
]
