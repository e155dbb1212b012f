"""The language-model corpus: a Llama decoder with its embedding and LM head.

Each entry builds ``(loss, args)`` as LM training libraries write the model:
token embedding (tied with the head or not), ``layers`` decoder layers under
one ``lax.scan`` (grouped-query attention with RoPE, SwiGLU MLP), a final
RMSNorm, the LM head over ``vocab`` and a cross-entropy computed in f32 from
the activations' dtype, with a z-loss. The projections inside a layer carry
``checkpoint_name`` as such libraries name them, so that their named remat
presets (``PRESETS``, applied per layer) stand as anchors beside JAX's
built-ins. The head is what moves the peak: at these sizes its backward pass
(logits, softmax and their cotangents, with every layer's stacked residuals)
sets the step's peak from a vocabulary of about 8k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name as _named

from tests.peak_models import _rmsnorm, _rope

Params = dict[str, Any]

# The names the layers give their values, as LM libraries name them.
LAYER_INPUT = "decoder_layer_input"
QUERY, KEY, VALUE, CONTEXT, OUT = "query_proj", "key_proj", "value_proj", "context", "out_proj"
MLP_IN, MLP_OUT = "mlpwi", "mlpwo"

# The named remat presets such libraries ship, as the names each one saves.
PRESETS: dict[str, frozenset[str]] = {
    "save_qkv_proj": frozenset({QUERY, KEY, VALUE}),
    "save_out_proj": frozenset({OUT}),
    "save_dot_except_mlp": frozenset({QUERY, KEY, VALUE, CONTEXT, OUT}),
    "minimal": frozenset({QUERY, KEY, VALUE, OUT, MLP_IN, MLP_OUT}),
    "full": frozenset(),
}


def _unnamed(x: jax.Array, _: str) -> jax.Array:
    return x


def decoder_layer(heads: int, kv_heads: int,
                  named: bool = True) -> Callable[[jax.Array, Params], jax.Array]:
    """``named=False``: the same layer without its ``checkpoint_name``s (no named value for
    refinement to try as a candidate: each is a compile of the step)."""
    checkpoint_name = _named if named else _unnamed

    def layer(h: jax.Array, p: Params) -> jax.Array:
        b, t, d = h.shape
        hd = d // heads
        h = checkpoint_name(h, LAYER_INPUT)
        x = _rmsnorm(h, p["attn_norm"])
        q = _rope(checkpoint_name(x @ p["wq"], QUERY).reshape(b, t, heads, hd))
        k = _rope(checkpoint_name(x @ p["wk"], KEY).reshape(b, t, kv_heads, hd))
        v = checkpoint_name(x @ p["wv"], VALUE).reshape(b, t, kv_heads, hd)
        k = jnp.repeat(k, heads // kv_heads, axis=2)
        v = jnp.repeat(v, heads // kv_heads, axis=2)
        scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / np.sqrt(hd)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        attn = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(h.dtype)
        context = checkpoint_name(jnp.einsum("bhts,bshd->bthd", attn, v), CONTEXT)
        h = h + checkpoint_name(context.reshape(b, t, d) @ p["wo"], OUT)
        x = _rmsnorm(h, p["mlp_norm"])
        gate = checkpoint_name(x @ p["w_gate"], MLP_IN)
        up = checkpoint_name(x @ p["w_up"], MLP_IN)
        return h + checkpoint_name((jax.nn.silu(gate) * up) @ p["w_down"], MLP_OUT)
    return layer


def lm_loss(heads: int, kv_heads: int, tied: bool, z_loss: float = 1e-4,
            layer_output: Callable[[jax.Array], jax.Array] | None = None,
            named: bool = True) -> Callable[[Params, jax.Array], jax.Array]:
    """``layer_output`` is applied to each layer's output inside the scan (a sharded
    stack's ``with_sharding_constraint``, ``tests/mesh_models.py``)."""
    layer = decoder_layer(heads, kv_heads, named)

    def step(h: jax.Array, p: Params) -> tuple[jax.Array, None]:
        out = layer(h, p)
        return (out if layer_output is None else layer_output(out)), None

    def loss(params: Params, tokens: jax.Array) -> jax.Array:
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        h = params["embed"][inputs]
        h, _ = lax.scan(step, h, params["layers"])
        h = _rmsnorm(h, params["final_norm"])
        head = params["embed"].T if tied else params["head"]
        logits = (h @ head).astype(jnp.float32)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        return jnp.mean(log_z - label_logits) + z_loss * jnp.mean(jnp.square(log_z))
    return loss


def lm(layers: int = 4, d: int = 256, ffn: int = 688, heads: int = 8, kv_heads: int = 2,
       vocab: int = 8192, batch: int = 2, seq: int = 128, dtype: Any = jnp.float32,
       tied: bool = False, abstract: bool = False) -> tuple[Callable, tuple]:
    """A Llama LM; ``abstract`` gives ``jax.ShapeDtypeStruct`` arguments, no weights."""
    hd = d // heads
    shapes = {"wq": (d, d), "wk": (d, kv_heads * hd), "wv": (d, kv_heads * hd),
              "wo": (d, d), "w_gate": (d, ffn), "w_up": (d, ffn), "w_down": (ffn, d),
              "attn_norm": (d,), "mlp_norm": (d,)}
    top = {"embed": (vocab, d), "final_norm": (d,)} | ({} if tied else {"head": (d, vocab)})
    loss = lm_loss(heads, kv_heads, tied)
    if abstract:
        params: Params = {"layers": {n: jax.ShapeDtypeStruct((layers, *s), dtype)
                                     for n, s in shapes.items()}}
        params |= {n: jax.ShapeDtypeStruct(s, dtype) for n, s in top.items()}
        return loss, (params, jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32))
    # numpy, not jax.random: building the corpus compiles nothing.
    rng = np.random.default_rng(11)
    params = {"layers": {n: jnp.asarray(rng.standard_normal((layers, *s)) * 0.02, dtype)
                         for n, s in shapes.items()}}
    params |= {n: jnp.asarray(rng.standard_normal(s) * 0.02, dtype) for n, s in top.items()}
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)), jnp.int32)
    return loss, (params, tokens)


def dot_flops(fun: Callable, *args: Any) -> int:
    """The dot FLOPs of the training step ``jax.grad(fun)`` at ``args``, counted on its
    jaxpr, a scan's body times its length: one rule for a plan and a preset alike
    (XLA's CPU ``cost_analysis`` counts a loop's body once, so it cannot compare them)."""
    closed = jax.make_jaxpr(jax.grad(fun))(*args)
    return _dots(closed.jaxpr)


def _dots(jaxpr: Any, times: int = 1) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, _), (lb, _) = eqn.params["dimension_numbers"]
            lhs, out = eqn.invars[0].aval, eqn.outvars[0].aval
            contracted = int(np.prod([lhs.shape[i] for i in lc])) if lc else 1
            total += times * 2 * int(np.prod(out.shape)) * contracted
        inner = times * int(eqn.params["length"]) if eqn.primitive.name == "scan" else times
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += _dots(sub, inner)
    return total


@dataclass(frozen=True)
class LM:
    name: str
    build: Callable[[], tuple[Callable, tuple]]


CORPUS = [
    LM("lm_V1k_tied", lambda: lm(vocab=1024, seq=256, tied=True)),
    LM("lm_V8k", lambda: lm(layers=8, vocab=8192, batch=4)),
    LM("lm_V32k_bf16", lambda: lm(vocab=32768, dtype=jnp.bfloat16)),
    LM("lm_V128k_T32", lambda: lm(layers=2, vocab=131072, seq=32, batch=1)),
]
