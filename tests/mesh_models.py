"""The sharded corpus: the Llama-style ``lax.scan`` stack and an LM on a device mesh.

Three layouts, as training libraries shard a stack of layers, each with or
without a ``with_sharding_constraint`` on the layer's output (inside the scan
body):

* ``dp``: data parallel, the batch split over every device, parameters replicated;
* ``fsdp``: the batch and every parameter split over every device (a parameter on
  its first axis after the layer axis);
* ``tp``: a 2 x 4 mesh, data x model: the batch over ``data``, the attention's and
  the MLP's input projections split by columns over ``model``, their output
  projections by rows (Megatron's layout).

The LM (``sharded_lm``: ``tests/lm_models.py``'s, embedding gather, decoder scan,
final norm, head and cross-entropy with z-loss) takes the same layouts, its tokens
split as the stack's activations; outside the layers, FSDP splits each parameter
on its first axis (the embedding by vocabulary rows, the head by its ``d`` rows,
the final norm) and tensor parallelism splits the embedding by vocabulary rows and
the head by vocabulary columns over ``model`` (Megatron's vocabulary-parallel
embedding and head).

The process must have at least the mesh's devices: on CPU, set
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.lm_models import lm, lm_loss
from tests.peak_models import llama, llama_layer

LAYOUTS = ("dp", "fsdp", "tp")
# Megatron's split of each stacked parameter (layers, in, out) on the tensor axis.
COLUMNS = ("wq", "wk", "wv", "w_gate", "w_up")
ROWS = ("wo", "w_down")


@dataclass(frozen=True)
class Sharded:
    name: str
    loss: Callable
    args: tuple  # (params, x), placed on the mesh
    mesh: Mesh


def mesh_of(layout: str) -> Mesh:
    devices = np.array(jax.devices()[:8])
    if layout == "tp":
        return Mesh(devices.reshape(2, 4), ("data", "model"))
    return Mesh(devices, ("data",))


def param_spec(layout: str, name: str, ndim: int) -> P:
    if layout == "fsdp":
        return P(None, "data")
    if layout == "tp" and name in COLUMNS:
        return P(None, None, "model")
    if layout == "tp" and name in ROWS:
        return P(None, "model", None)
    return P()


def lm_param_spec(layout: str, name: str) -> P:
    """The LM's parameters outside the layers ("embed", "head", "final_norm")."""
    if layout == "fsdp":
        return P("data")
    if layout == "tp" and name == "embed":
        return P("model", None)
    if layout == "tp" and name == "head":
        return P(None, "model")
    return P()


def _place(value: Any, sharding: NamedSharding, abstract: bool) -> Any:
    if abstract:
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
    return jax.device_put(value, sharding)


def sharded_llama(layout: str, constrained: bool, *, layers: int = 8, seq: int = 128,
                  batch: int = 8, d: int = 256, ffn: int = 688,
                  abstract: bool = False) -> Sharded:
    """The issue's stack (D 256, F 688, 8 heads, 2 KV heads, f32) on ``layout``'s mesh;
    ``abstract`` gives ``ShapeDtypeStruct`` arguments with shardings."""
    mesh = mesh_of(layout)
    _, (params, x) = llama(layers=layers, seq=seq, batch=batch, d=d, ffn=ffn,
                           abstract=abstract)
    layer = llama_layer(8, 2)
    activations = NamedSharding(mesh, P("data"))

    def loss(params: Any, x: jax.Array) -> jax.Array:
        def body(h, p):
            out = layer(h, p)
            if constrained:
                out = lax.with_sharding_constraint(out, activations)
            return out, None
        h, _ = lax.scan(body, x, params)
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    placed = {n: _place(w, NamedSharding(mesh, param_spec(layout, n, w.ndim)), abstract)
              for n, w in params.items()}
    name = f"llama_{layout}{'_constrained' if constrained else ''}"
    return Sharded(name, loss, (placed, _place(x, activations, abstract)), mesh)


def gathered_fsdp(layers: int = 4, batch: int = 64, d: int = 128, ffn: int = 256) -> Sharded:
    """An MLP stack sharded FSDP-style that gathers each layer's weights itself, as FSDP
    implementations write it (``with_sharding_constraint(w, P())`` before the matmul):
    the gathered weights are values of the jaxpr, so a plan chooses between saving them
    (device memory) and gathering them again in the backward pass (the link)."""
    mesh = mesh_of("fsdp")
    rng = np.random.default_rng(5)
    split, whole = NamedSharding(mesh, P(None, "data")), NamedSharding(mesh, P())

    def weights(*shape: int) -> jax.Array:
        return jax.device_put(jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.float32),
                              split)

    params = {"w_in": weights(layers, d, ffn), "w_out": weights(layers, ffn, d)}
    x = jax.device_put(jnp.asarray(rng.standard_normal((batch, d)), jnp.float32),
                       NamedSharding(mesh, P("data")))

    def loss(params: Any, x: jax.Array) -> jax.Array:
        def body(h: jax.Array, p: Any) -> tuple[jax.Array, None]:
            w_in = lax.with_sharding_constraint(p["w_in"], whole)
            w_out = lax.with_sharding_constraint(p["w_out"], whole)
            return h + jnp.tanh(h @ w_in) @ w_out, None
        h, _ = lax.scan(body, x, params)
        return jnp.mean(jnp.square(h))

    return Sharded("mlp_fsdp_gathered", loss, (params, x), mesh)


def sharded_lm(layout: str, constrained: bool, *, layers: int = 2, seq: int = 32,
               batch: int = 8, d: int = 64, ffn: int = 176, vocab: int = 512,
               named: bool = True, abstract: bool = False) -> Sharded:
    """The corpus LM (8 heads, 2 KV heads, untied head, f32) on ``layout``'s mesh; the
    arguments are ``(params, tokens)``, ``tokens`` of ``(batch, seq + 1)``. ``named``:
    the layers' ``checkpoint_name``s, as the corpus has them."""
    mesh = mesh_of(layout)
    _, (params, tokens) = lm(layers=layers, d=d, ffn=ffn, vocab=vocab, batch=batch,
                             seq=seq, abstract=abstract)
    activations = NamedSharding(mesh, P("data"))
    loss = lm_loss(8, 2, tied=False, named=named, layer_output=(
        (lambda h: lax.with_sharding_constraint(h, activations)) if constrained else None))
    placed = {n: _place(w, NamedSharding(mesh, lm_param_spec(layout, n)), abstract)
              for n, w in params.items() if n != "layers"}
    placed["layers"] = {
        n: _place(w, NamedSharding(mesh, param_spec(layout, n, w.ndim)), abstract)
        for n, w in params["layers"].items()}
    name = f"lm_{layout}{'_constrained' if constrained else ''}"
    return Sharded(name, loss, (placed, _place(tokens, activations, abstract)), mesh)
