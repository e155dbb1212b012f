"""The corpus: small JAX functions covering what extraction must get exactly right.

Each entry is ``name -> (fun, args)``; every float argument is differentiated.
Shapes are small so the whole corpus traces and solves in seconds.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _rng(seed: int, *shape, dtype=jnp.float32):
    # numpy, not jax.random: building the corpus should compile nothing.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def mlp(x, w1, w2, w3):
    h = jnp.tanh(x @ w1)
    h = jax.nn.relu(h @ w2)
    return jnp.sum((h @ w3) ** 2)


def _layernorm(x, scale):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + 1e-5) * scale


def _block(x, p):
    """Pre-norm transformer block: causal softmax attention, gelu MLP."""
    wq, wk, wv, wo, w1, w2, s1, s2 = p
    t, d = x.shape
    h = _layernorm(x, s1)
    q, k, v = h @ wq, h @ wk, h @ wv
    logits = (q @ k.T) / jnp.sqrt(jnp.float32(d))
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    logits = jnp.where(mask, logits, -1e9)
    x = x + jax.nn.softmax(logits, axis=-1) @ v @ wo
    h = _layernorm(x, s2)
    return x + jax.nn.gelu(h @ w1) @ w2


def _block_params(seed: int, d: int, f: int):
    return tuple(_rng(seed + i, *shape) * 0.1 for i, shape in enumerate(
        [(d, d), (d, d), (d, d), (d, d), (d, f), (f, d)])) + (jnp.ones(d), jnp.ones(d))


def transformer_block(x, p):
    return jnp.sum(_block(x, p))


def conv_net(x, k1, k2, w):
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.nn.relu(lax.conv_general_dilated(x, k1, (1, 1), "SAME", dimension_numbers=dn))
    h = jax.nn.relu(lax.conv_general_dilated(h, k2, (2, 2), "SAME", dimension_numbers=dn))
    h = jnp.mean(h, axis=(1, 2))
    return jnp.sum(jax.nn.log_softmax(h @ w))


def scan_stack(x, ws, bs):
    """Twelve residual layers under lax.scan, the usual way deep stacks are written."""
    def layer(h, wb):
        w, b = wb
        return h + jnp.tanh(h @ w + b), None
    h, _ = lax.scan(layer, x, (ws, bs))
    return jnp.sum(h ** 2)


def with_inner_jit(x, w):
    @jax.jit
    def inner(a, b):
        return jnp.sin(a @ b) * a
    h = inner(x, w)
    return jnp.sum(jnp.exp(inner(h, w)))


@jax.custom_jvp
def _softplus(x):
    return jnp.logaddexp(x, 0.0)


@_softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _softplus(x), jax.nn.sigmoid(x) * t


def custom_jvp_fn(x, w):
    return jnp.sum(_softplus(x @ w) * x)


@jax.custom_vjp
def _clip_grad_tanh(x):
    return jnp.tanh(x)


def _cgt_fwd(x):
    y = jnp.tanh(x)
    return y, (y,)


def _cgt_bwd(res, g):
    (y,) = res
    return (jnp.clip((1 - y * y) * g, -1.0, 1.0),)


_clip_grad_tanh.defvjp(_cgt_fwd, _cgt_bwd)


def custom_vjp_fn(x, w):
    h = _clip_grad_tanh(x @ w)
    return jnp.sum(jnp.sin(h @ w))


def cond_fn(x, w, flag):
    h = jnp.tanh(x @ w)
    h = lax.cond(flag > 0, lambda a: jnp.sin(a) * a, lambda a: jnp.cos(a) + 1.0, h)
    return jnp.sum(h @ w)


def while_fn(x, w):
    h = jnp.tanh(x @ w)
    # A data-dependent trip count computed on non-differentiated values.
    n = lax.while_loop(lambda c: c[1] < 100.0, lambda c: (c[0] + 1, c[1] * 2.0),
                       (0, lax.stop_gradient(jnp.max(jnp.abs(h))) + 1.0))[0]
    return jnp.sum(jnp.sin(h) * n.astype(jnp.float32))


def mixed_precision(x, w1, w2):
    h = (x.astype(jnp.bfloat16) @ w1.astype(jnp.bfloat16))
    h = jax.nn.gelu(h).astype(jnp.float32)
    return jnp.sum(jnp.tanh(h @ w2))


def integer_side(x, w):
    h = x @ w
    idx = jnp.argmax(h, axis=-1)
    counts = jnp.cumsum(idx) % 7
    onehot = jax.nn.one_hot(counts, h.shape[-1])
    return jnp.sum(jnp.tanh(h) * onehot) + jnp.sum(jnp.sin(h[jnp.arange(h.shape[0]), idx]))


def transformer_stack(x, params):
    """Transformer blocks under lax.scan, with a per-layer side output."""
    def layer(h, p):
        return _block(h, p), jnp.sum(h)
    h, sums = lax.scan(layer, x, params)
    return jnp.sum(h) + jnp.sum(sums)


def nested_scan(x, ws):
    def outer(h, w):
        def inner(g, _):
            return jnp.tanh(g @ w) + g, None
        g, _ = lax.scan(inner, h, None, length=3)
        return g, None
    h, _ = lax.scan(outer, x, ws)
    return jnp.sum(h ** 2)


def _stacked_block_params(layers: int, d: int, f: int):
    per_layer = [_block_params(10 * i, d, f) for i in range(layers)]
    return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *per_layer)


def _corpus() -> dict[str, tuple[Callable, tuple]]:
    d, f, t = 16, 32, 8
    return {
        "mlp": (mlp, (_rng(0, 8, 16), _rng(1, 16, 32), _rng(2, 32, 32), _rng(3, 32, 4))),
        "transformer_block": (transformer_block, (_rng(4, t, d), _block_params(10, d, f))),
        "conv_net": (conv_net, (_rng(5, 2, 8, 8, 3), _rng(6, 3, 3, 3, 8) * 0.3,
                                _rng(7, 3, 3, 8, 8) * 0.3, _rng(8, 8, 10))),
        "scan_stack": (scan_stack, (_rng(9, 4, 16), _rng(20, 12, 16, 16) * 0.2,
                                    _rng(21, 12, 16) * 0.1)),
        "inner_jit": (with_inner_jit, (_rng(22, 8, 8), _rng(23, 8, 8) * 0.3)),
        "custom_jvp": (custom_jvp_fn, (_rng(24, 8, 8), _rng(25, 8, 8))),
        "custom_vjp": (custom_vjp_fn, (_rng(26, 8, 8), _rng(27, 8, 8))),
        "cond": (cond_fn, (_rng(28, 8, 8), _rng(29, 8, 8), jnp.int32(1))),
        "while_loop": (while_fn, (_rng(30, 8, 8), _rng(31, 8, 8))),
        "mixed_bf16": (mixed_precision, (_rng(32, 8, 16), _rng(33, 16, 32), _rng(34, 32, 8))),
        "integer_side": (integer_side, (_rng(35, 8, 16), _rng(36, 16, 16))),
        "transformer_stack": (transformer_stack, (_rng(37, t, d), _stacked_block_params(4, d, f))),
        "nested_scan": (nested_scan, (_rng(38, 4, 8), _rng(39, 3, 8, 8) * 0.3)),
    }


CORPUS = _corpus()
