"""This device's rates, as the price of a saved byte in FLOPs (``client.peak.priced``).

A saved residual is written once in the forward pass and read once in the backward,
two bytes of memory traffic for each byte saved; recomputation runs at the device's
matrix rate at best. So a saved byte costs about ``2 * flop_rate / bandwidth`` FLOPs:
measured 920 and 954 on a TPU v5e (bf16 products against an elementwise pass over
256 MiB), 40 to 65 on the 2-core CPU of ``bench/priced_saves.py``'s figures (float32,
about 220 GFLOP/s against 7 GB/s). A first-order price: elementwise recomputation runs
below the matrix rate, and fused producers (a TPU's recomputed ``exp``) cost nothing
apart.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# A saved byte crosses memory twice: written in the forward pass, read in the backward.
TRAFFIC_PER_SAVED_BYTE = 2


def measured_save_price(device: Any = None, dtype: Any = None, rounds: int = 7) -> float:
    """FLOPs one saved byte costs on ``device`` (the default backend's first):
    ``TRAFFIC_PER_SAVED_BYTE`` bytes at its measured copy bandwidth, in FLOPs at its
    measured matrix rate in ``dtype`` (bfloat16 on an accelerator, float32 on a CPU by
    default). Medians of ``rounds`` runs each; pass it as ``optimize(...,
    save_price=)``."""
    device = jax.devices()[0] if device is None else device
    cpu = device.platform == "cpu"
    dtype = (jnp.float32 if cpu else jnp.bfloat16) if dtype is None else dtype
    size = 1024 if cpu else 8192
    a = jax.device_put(jnp.ones((size, size), dtype), device)
    x = jax.device_put(jnp.ones(((64 if cpu else 256) * 2**20 // 4,), jnp.float32), device)
    flop_rate = 2 * size**3 / _median_seconds(jax.jit(lambda a: a @ a), a, rounds)
    # An elementwise op reads each byte and writes one: two bytes moved per byte.
    bandwidth = 2 * x.nbytes / _median_seconds(jax.jit(lambda x: x * 2), x, rounds)
    return TRAFFIC_PER_SAVED_BYTE * flop_rate / bandwidth


def _median_seconds(fun: Callable, arg: Any, rounds: int) -> float:
    jax.block_until_ready(fun(arg))  # compiled and warm
    seconds = []
    for _ in range(max(1, rounds)):
        start = time.perf_counter()
        jax.block_until_ready(fun(arg))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)
