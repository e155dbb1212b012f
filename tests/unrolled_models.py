"""The unrolled corpus: models whose blocks run as straight-line code, as libraries write them.

Each ``Model`` builds ``(loss, args)`` with ``loss(params, batch)`` a scalar,
differentiated with respect to ``params``. ``build(None)`` is the model without
remat; ``build(policy)`` wraps each block in the library's own checkpoint with
that JAX policy (``jax.checkpoint``, ``nn.remat``, ``nnx.remat``,
``eqx.filter_checkpoint``), the way a user of that library writes per-block
remat. No block runs under a ``lax.scan``: the layers of a Python loop, a list
of modules, or blocks of different shapes (the U-Net). Two models have a twin
in ``SCAN_TWINS``, the same layers and weights under one ``lax.scan`` over
stacked parameters, ``build(policy)`` checkpointing the scan's body.

Sizes are small (D 128-256, B*T about 512, f32): one compile of a step takes
well under 3 s on this machine and peaks are tens of MiB. Building a model
compiles nothing: weights come from numpy, over the shapes ``jax.eval_shape``
(or the library's own abstract init) gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common
from penzai.toolshed.gradient_checkpointing import Checkpointed

from tests.lm_models import decoder_layer
from tests.peak_models import _layernorm, _rmsnorm, _weights, llama_layer

Policy = Callable[..., Any]
Built = tuple[Callable[..., jax.Array], tuple[Any, ...]]

BUILTINS: dict[str, Policy] = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclass(frozen=True)
class Model:
    name: str
    build: Callable[[Policy | None], Built]
    blocks: int
    scan: str | None  # the name of its twin under one lax.scan, in SCAN_TWINS
    written: str  # how the library writes the model and its per-block remat
    # The policy the user already wrote around each block, which a plan replaces
    # (``build(user_policy)`` is the model as written); None where they wrote none.
    user_policy: Policy | None = None


def _filled(shapes: Any, seed: int) -> Any:
    """Weights for a tree of abstract arrays: normalisation scales 1, biases 0, the rest
    N(0, 0.02), from numpy (nothing compiled). Named by the last key of each path."""
    rng = np.random.default_rng(seed)

    def fill(path: tuple[Any, ...], leaf: Any) -> Any:
        name = str(getattr(path[-1], "key", getattr(path[-1], "name", path[-1])))
        if name == "bias":
            return jnp.zeros(leaf.shape, leaf.dtype)
        if name in ("scale", "weight") and len(leaf.shape) == 1:
            return jnp.ones(leaf.shape, leaf.dtype)
        return jnp.asarray(rng.standard_normal(leaf.shape) * 0.02, leaf.dtype)
    return jax.tree_util.tree_map_with_path(fill, shapes)


def _checkpointed(fun: Callable, remat: Policy | None) -> Callable:
    return fun if remat is None else jax.checkpoint(fun, policy=remat)


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - label_logits)


def _causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``(b, t, heads, hd)`` each; softmax attention under a causal mask."""
    t, hd = q.shape[1], q.shape[-1]
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(hd)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), scores, -1e9)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)


# ---- plain JAX: a Python loop over per-layer parameter dicts (Llama layers) ----------

_LLAMA = {"layers": 6, "d": 256, "ffn": 512, "heads": 4, "kv_heads": 2, "batch": 4, "seq": 128}


def _llama_weights() -> tuple[dict[str, jax.Array], jax.Array]:
    c = _LLAMA
    hd = c["d"] // c["heads"]
    stacked = _weights(20, c["layers"], {
        "wq": (c["d"], c["d"]), "wk": (c["d"], c["kv_heads"] * hd),
        "wv": (c["d"], c["kv_heads"] * hd), "wo": (c["d"], c["d"]),
        "w_gate": (c["d"], c["ffn"]), "w_up": (c["d"], c["ffn"]), "w_down": (c["ffn"], c["d"]),
        "attn_norm": (c["d"],), "mlp_norm": (c["d"],)}, jnp.float32)
    x = jnp.asarray(np.random.default_rng(21).standard_normal((c["batch"], c["seq"], c["d"])),
                    jnp.float32)
    return stacked, x


def jax_loop_llama(remat: Policy | None) -> Built:
    layer = _checkpointed(llama_layer(_LLAMA["heads"], _LLAMA["kv_heads"]), remat)

    def loss(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
        for p in params:
            x = layer(x, p)
        return jnp.mean(jnp.square(x))

    stacked, x = _llama_weights()
    per_layer = [{n: w[i] for n, w in stacked.items()} for i in range(_LLAMA["layers"])]
    return loss, (per_layer, x)


def jax_scan_llama(remat: Policy | None) -> Built:
    layer = _checkpointed(llama_layer(_LLAMA["heads"], _LLAMA["kv_heads"]), remat)

    def loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        x, _ = lax.scan(lambda h, p: (layer(h, p), None), x, params)
        return jnp.mean(jnp.square(x))

    return loss, _llama_weights()


# ---- Flax linen: GPT-2, its blocks in a Python loop (no nn.scan) ---------------------


class _LinenAttention(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(nn.Dense(3 * d, name="c_attn")(x), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        return nn.Dense(d, name="c_proj")(_causal_attention(q, k, v).reshape(b, t, d))


class _LinenBlock(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        x = x + _LinenAttention(self.heads, name="attn")(nn.LayerNorm(name="ln_1")(x))
        h = nn.gelu(nn.Dense(4 * d, name="c_fc")(nn.LayerNorm(name="ln_2")(x)))
        return x + nn.Dense(d, name="c_proj")(h)


class _LinenGPT2(nn.Module):
    vocab: int
    layers: int
    d: int
    heads: int
    seq: int
    remat: Policy | None = None

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        wte = nn.Embed(self.vocab, self.d, name="wte")
        wpe = nn.Embed(self.seq, self.d, name="wpe")
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[1]))
        block = _LinenBlock if self.remat is None else nn.remat(_LinenBlock, policy=self.remat)
        for i in range(self.layers):
            x = block(self.heads, name=f"h_{i}")(x)
        return wte.attend(nn.LayerNorm(name="ln_f")(x))


def linen_gpt2(remat: Policy | None) -> Built:
    batch, seq = 4, 128
    model = _LinenGPT2(vocab=2048, layers=6, d=256, heads=4, seq=seq, remat=remat)
    tokens = jnp.asarray(np.random.default_rng(30).integers(0, 2048, (batch, seq + 1)),
                         jnp.int32)
    params = _filled(jax.eval_shape(model.init, jax.random.key(0), tokens[:, :-1]), 31)

    def loss(params: Any, tokens: jax.Array) -> jax.Array:
        return _cross_entropy(model.apply(params, tokens[:, :-1]), tokens[:, 1:])

    return loss, (params, tokens)


# ---- Flax NNX: a ViT holding a list of encoder layers --------------------------------


class _NNXEncoderLayer(nnx.Module):
    def __init__(self, d: int, heads: int, mlp: int, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False,
                                           rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc1 = nnx.Linear(d, mlp, rngs=rngs)
        self.fc2 = nnx.Linear(mlp, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class _NNXViT(nnx.Module):
    def __init__(self, layers: int, d: int, heads: int, mlp: int, patch: int, patches: int,
                 classes: int, rngs: nnx.Rngs, remat: Policy | None = None) -> None:
        self.patch = nnx.Conv(3, d, kernel_size=(patch, patch), strides=(patch, patch),
                              rngs=rngs)
        self.cls = nnx.Param(jnp.zeros((1, 1, d)))
        self.pos = nnx.Param(jnp.zeros((1, patches + 1, d)))
        self.layers = nnx.List([_NNXEncoderLayer(d, heads, mlp, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, classes, rngs=rngs)
        self.remat = remat

    def __call__(self, images: jax.Array) -> jax.Array:
        x = self.patch(images)
        b, _, _, d = x.shape
        x = jnp.concatenate([jnp.broadcast_to(self.cls[...], (b, 1, d)),
                             x.reshape(b, -1, d)], axis=1) + self.pos[...]
        for layer in self.layers:
            if self.remat is None:
                x = layer(x)
            else:
                x = nnx.remat(lambda layer, x: layer(x), policy=self.remat)(layer, x)
        return self.head(self.norm(x[:, 0]))


def nnx_vit(remat: Policy | None) -> Built:
    batch, size, patch, classes = 8, 32, 4, 10
    abstract = nnx.eval_shape(lambda: _NNXViT(6, 256, 4, 512, patch, (size // patch) ** 2,
                                              classes, nnx.Rngs(0), remat))
    graphdef, shapes, rest = nnx.split(abstract, nnx.Param, ...)
    params = _filled(shapes, 40)
    rng = np.random.default_rng(41)
    images = jnp.asarray(rng.standard_normal((batch, size, size, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, classes, (batch,)), jnp.int32)

    def loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        images, labels = batch
        return _cross_entropy(nnx.merge(graphdef, params, rest)(images), labels)

    return loss, (params, (images, labels))


# ---- Equinox: a residual MLP holding a list of layers --------------------------------


class _EqxLayer(eqx.Module):
    norm: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, d: int, hidden: int, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(d)
        self.fc1 = eqx.nn.Linear(d, hidden, key=k1)
        self.fc2 = eqx.nn.Linear(hidden, d, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.fc2(jax.nn.gelu(self.fc1(self.norm(x))))


class _EqxMLP(eqx.Module):
    layers: list[_EqxLayer]
    head: eqx.nn.Linear

    def __init__(self, layers: int, d: int, hidden: int, out: int, key: jax.Array) -> None:
        keys = jax.random.split(key, layers + 1)
        self.layers = [_EqxLayer(d, hidden, k) for k in keys[:-1]]
        self.head = eqx.nn.Linear(d, out, key=keys[-1])

    def __call__(self, x: jax.Array, remat: Policy | None) -> jax.Array:
        for layer in self.layers:
            if remat is None:
                x = layer(x)
            else:
                x = eqx.filter_checkpoint(lambda layer, x: layer(x), policy=remat)(layer, x)
        return self.head(x)


def equinox_mlp(remat: Policy | None) -> Built:
    batch, d, out = 1024, 256, 16
    model = _filled(eqx.filter_eval_shape(_EqxMLP, 6, d, 1024, out, jax.random.key(0)), 50)
    rng = np.random.default_rng(51)
    x = jnp.asarray(rng.standard_normal((batch, d)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((batch, out)), jnp.float32)

    def loss(model: _EqxMLP, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        x, y = batch
        return jnp.mean(jnp.square(jax.vmap(lambda v: model(v, remat))(x) - y))

    return loss, (model, (x, y))


# ---- plain JAX GPT-2 whose user wrote jax.checkpoint(block, dots_saveable) ------------


def _gpt2_block(x: jax.Array, p: dict[str, jax.Array], heads: int = 4) -> jax.Array:
    b, t, d = x.shape
    h = _layernorm(x, p["ln1_scale"], p["ln1_bias"])
    q, k, v = jnp.split(h @ p["w_qkv"] + p["b_qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    x = x + _causal_attention(q, k, v).reshape(b, t, d) @ p["w_o"] + p["b_o"]
    h = _layernorm(x, p["ln2_scale"], p["ln2_bias"])
    return x + jax.nn.gelu(h @ p["w_fc"] + p["b_fc"]) @ p["w_proj"] + p["b_proj"]


def user_checkpoint_gpt2(remat: Policy | None) -> Built:
    """``build(dots_saveable)`` is the model as its user wrote it."""
    layers, d, vocab, batch, seq = 4, 256, 2048, 4, 128
    block = _checkpointed(_gpt2_block, remat)
    shapes = {"w_qkv": (d, 3 * d), "b_qkv": (3 * d,), "w_o": (d, d), "b_o": (d,),
              "w_fc": (d, 4 * d), "b_fc": (4 * d,), "w_proj": (4 * d, d), "b_proj": (d,),
              "ln1_scale": (d,), "ln1_bias": (d,), "ln2_scale": (d,), "ln2_bias": (d,)}
    stacked = _weights(60, layers, shapes, jnp.float32)
    rng = np.random.default_rng(61)
    params = {"blocks": [{n: w[i] for n, w in stacked.items()} for i in range(layers)],
              "wte": jnp.asarray(rng.standard_normal((vocab, d)) * 0.02, jnp.float32),
              "wpe": jnp.asarray(rng.standard_normal((seq, d)) * 0.02, jnp.float32),
              "lnf_scale": jnp.zeros(d), "lnf_bias": jnp.zeros(d)}
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)), jnp.int32)

    def loss(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
        x = params["wte"][tokens[:, :-1]] + params["wpe"]
        for p in params["blocks"]:
            x = block(x, p)
        x = _layernorm(x, params["lnf_scale"], params["lnf_bias"])
        return _cross_entropy(x @ params["wte"].T, tokens[:, 1:])

    return loss, (params, tokens)


# ---- plain JAX U-Net: down and up blocks of different shapes, concatenated skips -----

_DN = ("NHWC", "HWIO", "NHWC")


def _conv(x: jax.Array, k: jax.Array) -> jax.Array:
    return lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=_DN)


def _groupnorm(x: jax.Array, groups: int = 8) -> jax.Array:
    n, hh, ww, c = x.shape
    g = x.reshape(n, hh, ww, groups, c // groups)
    mu = jnp.mean(g, axis=(1, 2, 4), keepdims=True)
    var = jnp.mean(jnp.square(g - mu), axis=(1, 2, 4), keepdims=True)
    return ((g - mu) * lax.rsqrt(var + 1e-5)).reshape(x.shape)


def _unet_block(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    x = jax.nn.silu(_groupnorm(_conv(x, p["k1"])))
    return jax.nn.silu(_groupnorm(_conv(x, p["k2"])))


def _down(x: jax.Array) -> jax.Array:
    n, hh, ww, c = x.shape
    return jnp.mean(x.reshape(n, hh // 2, 2, ww // 2, 2, c), axis=(2, 4))


def _up(x: jax.Array) -> jax.Array:
    return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


def unet(remat: Policy | None) -> Built:
    """Three levels (64x64x32, 32x32x64, 16x16x128): two down blocks, a middle block and
    two up blocks, each up block reading its level's skip concatenated on channels."""
    batch, size = 4, 64
    c1, c2, c3 = 32, 64, 128
    ins = {"down1": (3, c1), "down2": (c1, c2), "mid": (c2, c3), "up2": (c3 + c2, c2),
           "up1": (c2 + c1, c1)}
    rng = np.random.default_rng(70)
    params: dict[str, Any] = {
        name: {"k1": jnp.asarray(rng.standard_normal((3, 3, cin, cout)) / np.sqrt(9 * cin),
                                 jnp.float32),
               "k2": jnp.asarray(rng.standard_normal((3, 3, cout, cout)) / np.sqrt(9 * cout),
                                 jnp.float32)}
        for name, (cin, cout) in ins.items()}
    params["out"] = jnp.asarray(rng.standard_normal((1, 1, c1, 3)) * 0.1, jnp.float32)
    images = jnp.asarray(rng.standard_normal((batch, size, size, 3)), jnp.float32)
    block = _checkpointed(_unet_block, remat)

    def loss(params: dict[str, Any], images: jax.Array) -> jax.Array:
        s1 = block(images, params["down1"])
        s2 = block(_down(s1), params["down2"])
        h = block(_down(s2), params["mid"])
        h = block(jnp.concatenate([_up(h), s2], axis=-1), params["up2"])
        h = block(jnp.concatenate([_up(h), s1], axis=-1), params["up1"])
        return jnp.mean(jnp.square(_conv(h, params["out"]) - images))

    return loss, (params, images)


# ---- penzai: a Llama-like decoder of named-axis layers (every operation vmap-ed) ------

_PENZAI = {"layers": 6, "d": 256, "ffn": 512, "kv_heads": 2, "q_per_kv": 2, "head_dim": 64,
           "vocab": 4096, "batch": 4, "seq": 128}


def penzai_llama(remat: Policy | None) -> Built:
    """penzai's Llama-like transformer, its blocks in a ``pz.nn.Sequential``; every
    operation runs through the named-axis wrappers (``nmap``, a vmap per named axis), and
    the first block reads the embedding through a transpose the others do not need.
    ``build(policy)`` wraps each block in ``penzai.toolshed``'s ``Checkpointed``."""
    c = _PENZAI
    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=c["kv_heads"], query_head_multiplier=c["q_per_kv"],
        embedding_dim=c["d"], projection_dim=c["head_dim"], mlp_hidden_dim=c["ffn"],
        num_decoder_blocks=c["layers"], vocab_size=c["vocab"], mlp_variant="swiglu",
        tie_embedder_and_logits=False)
    # Without an initialising key the model holds parameter slots: the values are bound
    # per call, from numpy over the shapes penzai's own initialisation gives.
    unbound = llamalike_common.build_llamalike_transformer(config, init_base_rng=None)
    if remat is not None:
        unbound = (pz.select(unbound).at_instances_of(model_parts.TransformerBlock)
                   .apply(lambda block: Checkpointed(block, policy=remat)))
    shapes = jax.eval_shape(lambda: pz.freeze_params(pz.unbind_params(
        llamalike_common.build_llamalike_transformer(config, jax.random.key(0)))[1]))
    rng = np.random.default_rng(90)

    def filled(label: str, leaf: jax.ShapeDtypeStruct) -> jax.Array:
        if "norm" in label:
            return jnp.ones(leaf.shape, leaf.dtype)
        return jnp.asarray(rng.standard_normal(leaf.shape) * 0.02, leaf.dtype)
    params = tuple(replace(v, value=jax.tree.map(lambda leaf, v=v: filled(v.label, leaf),
                                                 v.value))
                   for v in shapes)
    tokens = jnp.asarray(rng.integers(0, c["vocab"], (c["batch"], c["seq"] + 1)), jnp.int32)

    def loss(params: tuple[Any, ...], tokens: jax.Array) -> jax.Array:
        model = pz.bind_variables(unbound, params)
        logits = model(pz.nx.wrap(tokens[:, :-1]).tag("batch", "seq"))
        return _cross_entropy(logits.untag("batch", "seq", "vocabulary").unwrap(),
                              tokens[:, 1:])

    return loss, (params, tokens)


# ---- plain JAX: a decoder whose first and last blocks differ from the rest -----------


def first_last_llama(remat: Policy | None) -> Built:
    """Six Llama layers in a Python loop: the first and last attend globally, the first
    reading time-major embeddings; the four between attend within a window of 32."""
    layers, heads, kv_heads = _LLAMA["layers"], _LLAMA["heads"], _LLAMA["kv_heads"]
    unwindowed = llama_layer(heads, kv_heads)
    first = _checkpointed(lambda h, p: unwindowed(jnp.transpose(h, (1, 0, 2)), p), remat)
    middle = _checkpointed(llama_layer(heads, kv_heads, window=32), remat)
    last = _checkpointed(unwindowed, remat)

    def loss(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
        x = first(jnp.transpose(x, (1, 0, 2)), params[0])
        for p in params[1:-1]:
            x = middle(x, p)
        return jnp.mean(jnp.square(last(x, params[-1])))

    stacked, x = _llama_weights()
    return loss, ([{n: w[i] for n, w in stacked.items()} for i in range(layers)], x)


# ---- plain JAX LM: embedding, unrolled Llama layers, untied head at V 8k -------------

_LM = {"layers": 6, "d": 256, "ffn": 512, "heads": 4, "kv_heads": 2, "vocab": 8192,
       "batch": 4, "seq": 128}


def _lm_weights() -> tuple[dict[str, Any], jax.Array]:
    c = _LM
    hd = c["d"] // c["heads"]
    layers = _weights(80, c["layers"], {
        "wq": (c["d"], c["d"]), "wk": (c["d"], c["kv_heads"] * hd),
        "wv": (c["d"], c["kv_heads"] * hd), "wo": (c["d"], c["d"]),
        "w_gate": (c["d"], c["ffn"]), "w_up": (c["d"], c["ffn"]), "w_down": (c["ffn"], c["d"]),
        "attn_norm": (c["d"],), "mlp_norm": (c["d"],)}, jnp.float32)
    rng = np.random.default_rng(81)
    params = {"layers": layers, "final_norm": jnp.zeros(c["d"]),
              "embed": jnp.asarray(rng.standard_normal((c["vocab"], c["d"])) * 0.02, jnp.float32),
              "head": jnp.asarray(rng.standard_normal((c["d"], c["vocab"])) * 0.02, jnp.float32)}
    tokens = jnp.asarray(rng.integers(0, c["vocab"], (c["batch"], c["seq"] + 1)), jnp.int32)
    return params, tokens


def _lm_loss(layers: Callable[[jax.Array, Any], jax.Array]) -> Callable[..., jax.Array]:
    def loss(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
        h = layers(params["embed"][tokens[:, :-1]], params["layers"])
        return _cross_entropy(_rmsnorm(h, params["final_norm"]) @ params["head"],
                              tokens[:, 1:])
    return loss


def lm_unrolled(remat: Policy | None) -> Built:
    layer = _checkpointed(decoder_layer(_LM["heads"], _LM["kv_heads"], named=False), remat)

    def layers(h: jax.Array, per_layer: list[dict[str, jax.Array]]) -> jax.Array:
        for p in per_layer:
            h = layer(h, p)
        return h

    params, tokens = _lm_weights()
    params["layers"] = [{n: w[i] for n, w in params["layers"].items()}
                        for i in range(_LM["layers"])]
    return _lm_loss(layers), (params, tokens)


def lm_scan(remat: Policy | None) -> Built:
    layer = _checkpointed(decoder_layer(_LM["heads"], _LM["kv_heads"], named=False), remat)

    def layers(h: jax.Array, stacked: dict[str, jax.Array]) -> jax.Array:
        return lax.scan(lambda h, p: (layer(h, p), None), h, stacked)[0]

    return _lm_loss(layers), _lm_weights()


SCAN_TWINS: dict[str, Model] = {m.name: m for m in [
    Model("jax_scan_llama_L6", jax_scan_llama, 6, None,
          "jax_loop_llama_L6's layers and weights under one lax.scan over stacked parameters; "
          "jax.checkpoint around the scan's body"),
    Model("lm_scan_V8k_L6", lm_scan, 6, None,
          "lm_unrolled_V8k_L6's layers and weights under one lax.scan over stacked parameters; "
          "jax.checkpoint around the scan's body"),
]}

CORPUS: list[Model] = [
    Model("jax_loop_llama_L6", jax_loop_llama, 6, "jax_scan_llama_L6",
          "plain JAX: a Python loop over a list of per-layer parameter dicts (RMSNorm, RoPE "
          "attention, SwiGLU MLP); jax.checkpoint(layer, policy=...)"),
    Model("linen_gpt2_L6", linen_gpt2, 6, None,
          "Flax linen GPT-2, its blocks called in a Python loop (no nn.scan); "
          "nn.remat(Block, policy=...)"),
    Model("nnx_vit_L6", nnx_vit, 6, None,
          "Flax NNX ViT holding an nnx.List of encoder layers; "
          "nnx.remat(lambda layer, x: layer(x), policy=...)(layer, x)"),
    Model("equinox_mlp_L6", equinox_mlp, 6, None,
          "Equinox residual MLP holding a list of layers, vmapped over the batch; "
          "eqx.filter_checkpoint(lambda layer, x: layer(x), policy=...)(layer, x)"),
    Model("user_checkpoint_gpt2_L4", user_checkpoint_gpt2, 4, None,
          "plain JAX GPT-2 whose user wrote jax.checkpoint(block, policy=dots_saveable) per "
          "block: the policy a plan replaces", jax.checkpoint_policies.dots_saveable),
    Model("unet_3level", unet, 5, None,
          "plain JAX U-Net: down, middle and up blocks of different shapes, skips "
          "concatenated on channels; jax.checkpoint(block, policy=...) per block"),
    Model("lm_unrolled_V8k_L6", lm_unrolled, 6, "lm_scan_V8k_L6",
          "plain JAX LM: embedding, a Python loop of Llama layers, untied head at V 8k; "
          "jax.checkpoint(layer, policy=...)"),
    Model("penzai_llama_L6", penzai_llama, 6, None,
          "penzai's Llama-like decoder: named-axis layers (every operation vmap-ed) in a "
          "pz.nn.Sequential, the first block reading the embedding through a transpose; "
          "penzai.toolshed's Checkpointed(block, policy=...)"),
    Model("first_last_llama_L6", first_last_llama, 6, None,
          "plain JAX: Llama layers in a Python loop, the first and last attending globally "
          "(the first reading time-major input), the others within a window; "
          "jax.checkpoint(layer, policy=...)"),
]

MODELS: dict[str, Model] = {m.name: m for m in CORPUS} | SCAN_TWINS
# The cheapest to compile (about 0.6-2 s a step here), one of them with a scan twin.
QUICK: list[str] = ["equinox_mlp_L6", "linen_gpt2_L6", "unet_3level", "jax_loop_llama_L6"]
