"""The policy key: one deterministic name for ``(primitive, input avals, params)``.

A ``jax.checkpoint`` policy is called with only that triple, so a stateless
policy can tell equations apart only by it. Extraction computes the key of every
node with this function and the policy recomputes it at call time; both must
agree on every host, so nothing here depends on ``id()``, memory addresses or
dict order.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from optiremat.client._jax_internals import ClosedJaxpr, Jaxpr, core

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")


def _aval_text(aval: Any) -> str:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return _ADDRESS.sub("", str(aval))
    weak = "~" if getattr(aval, "weak_type", False) else ""
    return f"{dtype}{list(shape)}{weak}"


def _canonical(x: Any) -> Any:
    """A JSON-able, address-free stand-in for a primitive parameter."""
    if x is None or isinstance(x, bool | int | str):
        return x
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, enum.Enum):
        return f"{type(x).__name__}.{x.name}"
    if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
        return str(np.dtype(x))
    if isinstance(x, np.ndarray | np.generic):
        return {"array": str(x.dtype), "shape": list(np.shape(x)),
                "sha": hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()[:16]}
    if isinstance(x, ClosedJaxpr | Jaxpr):
        return {"jaxpr": _ADDRESS.sub("", str(x))}
    if isinstance(x, core.AbstractValue):
        return _aval_text(x)
    if isinstance(x, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, Sequence):
        return [_canonical(v) for v in x]
    if isinstance(x, frozenset | set):
        return sorted((_canonical(v) for v in x), key=repr)
    target = getattr(x, "f", x)  # lu.WrappedFun keeps the user's function as .f
    if callable(target) and hasattr(target, "__qualname__"):
        return f"fn:{getattr(target, '__module__', '')}.{target.__qualname__}"
    return _ADDRESS.sub("", repr(x))


def policy_key(primitive: Any, avals: Sequence[Any], params: Mapping[str, Any]) -> str:
    """``"<primitive>:<16 hex>"``; the hex digest covers avals and params."""
    name = getattr(primitive, "name", str(primitive))
    payload = json.dumps(
        {"p": name, "in": [_aval_text(a) for a in avals], "params": _canonical(dict(params))},
        sort_keys=True, separators=(",", ":"),
    )
    return f"{name}:{hashlib.sha256(payload.encode()).hexdigest()[:16]}"
