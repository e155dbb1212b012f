"""The project's one cost model: bytes per value, FLOPs per equation.

Extraction prices every node with it, and the tests count the FLOPs of JAX's
backward jaxpr with it, so plan predictions and measurements use one scale.
The FLOP rule of each primitive is in its entry of ``client.primitives``,
which tabulates them.
"""

from __future__ import annotations

import math

import numpy as np

from optiremat.client._jax_internals import core
from optiremat.client.primitives import info, jaxpr_flops

__all__ = ["aval_bytes", "eqn_flops", "jaxpr_flops"]


def eqn_flops(eqn: core.JaxprEqn) -> int:
    """FLOPs of one execution of ``eqn`` (nested jaxprs included)."""
    return info(eqn.primitive).flops(eqn)


def aval_bytes(aval) -> int:
    """Bytes of one array of this abstract value (sub-byte dtypes round up)."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys) know their own size
        itemsize = getattr(dtype, "itemsize", 0)
    return int(math.prod(getattr(aval, "shape", ()))) * int(itemsize)
