"""The one module that touches private JAX internals.

Extraction must see exactly the jaxpr that ``jax.checkpoint`` partially
evaluates, and the policy must answer with JAX's own ``Saveable``/``Recompute``
objects; both live under ``jax._src``. Everything private is imported here, and
the JAX versions this was written and tested against are checked at import.

What differs between the supported versions is decided here once, by what the
installed JAX offers (not by its version number), and offered as accessors:

* a scan's consts and carry counts: ``num_consts``/``num_carry`` params up to
  0.10, one ``ft_in`` flat tree of (consts, carry, xs) from 0.11
  (``scan_counts``);
* the closed-jaxpr type: ``core.ClosedJaxpr`` wrapping a ``Jaxpr`` up to 0.11,
  merged into ``core.Jaxpr`` from 0.12 (which keeps ``ClosedJaxpr(jaxpr,
  consts)``, ``.jaxpr`` and ``.consts`` as legacy forms); ``ClosedJaxpr`` below
  is the public ``jax.extend.core`` alias, whichever type that is;
* primitives that exist only on some versions (``OPTIONAL_PRIMITIVES``), e.g.
  ``one_minus_square`` (0.12), which tanh's derivative emits;
* the ``jax_remat3`` flag (``REMAT3``): JAX's newer remat path offers a policy
  only dots, convolutions and named values, never the other equations of a
  plan nor the values its derivatives add (``one_minus_square``), so every
  checkpoint optiremat builds runs on JAX's partial-eval path whatever the
  flag says (``remat2``, ``checkpoint``).

docs/design.md ("Adding a JAX version") says what to check for a new release.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core

SUPPORTED_JAX = ((0, 10, 0), (0, 13, 0))  # [lower, upper)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


_installed = _version_tuple(jax.__version__)
if not (SUPPORTED_JAX[0] <= _installed < SUPPORTED_JAX[1]):
    raise ImportError(
        f"optiremat supports jax >= {'.'.join(map(str, SUPPORTED_JAX[0]))} and < "
        f"{'.'.join(map(str, SUPPORTED_JAX[1]))}; found jax {jax.__version__}. Its extraction "
        "mirrors JAX's private remat rules, which change between releases."
    )

# ruff: noqa: E402
# The modules that define the primitives client.primitives names (re-exported).
from jax._src import (  # noqa: F401
    ad_util,
    config,
    core,
    custom_derivatives,
    dispatch,
    pjit,
    source_info_util,
)
from jax._src.ad_checkpoint import name_p, remat_p, saved_residuals  # noqa: F401
from jax._src.interpreters import ad
from jax._src.interpreters import partial_eval as pe
from jax._src.interpreters.partial_eval import Offloadable, Recompute, Saveable  # noqa: F401
from jax._src.lax import convolution, slicing, special, windowed_reductions  # noqa: F401
from jax._src.lax import lax as lax_ops  # noqa: F401
from jax._src.lax.control_flow import conditionals, loops  # noqa: F401
from jax._src.random import prng  # noqa: F401

Jaxpr = core.Jaxpr
# The public alias names whichever type the installed JAX closes jaxprs with.
ClosedJaxpr = jax.extend.core.ClosedJaxpr
Literal = core.Literal
Var = core.Var


# From 0.11 a scan's params carry one flat tree of its inputs, (consts, carry, xs).
SCAN_COUNTS_IN_FLAT_TREE = "ft_in" in inspect.signature(loops._scan_impl).parameters


def scan_counts(params: dict) -> tuple[int, int]:
    """A scan equation's (number of consts, number of carry values) among its inputs."""
    if SCAN_COUNTS_IN_FLAT_TREE:
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    return params["num_consts"], params["num_carry"]


# Primitives only some supported versions define, by name: each maps to its Primitive,
# or is absent where the installed JAX lacks it (client.primitives gives each a FLOP rule).
OPTIONAL_PRIMITIVES: dict[str, core.Primitive] = {
    name: getattr(lax_ops, f"{name}_p")
    for name in ("one_minus_square",)
    if hasattr(lax_ops, f"{name}_p")
}


# The jax_remat3 flag, where the installed JAX has it (a thread-local config state).
REMAT3: Any = getattr(config, "remat3", None)


def remat3_on() -> bool:
    """Whether ``jax.checkpoint`` and ``checkpoint_name`` take JAX's remat3 path now."""
    return bool(REMAT3 is not None and REMAT3.value)


def remat2() -> contextlib.AbstractContextManager:
    """JAX's partial-eval remat path (``remat_p``) in force within, whatever the user set:
    the path whose policy is offered every known equation of the JVP'd jaxpr, which is
    what a plan's graph models. ``jax.checkpoint`` reads the flag when the checkpointed
    function is called (0.12) or built (0.10, 0.11), ``checkpoint_name`` when it is bound."""
    return REMAT3(False) if REMAT3 is not None else contextlib.nullcontext()


def checkpoint(fun: Callable, *, policy: Any, prevent_cse: bool = True) -> Callable:
    """``jax.checkpoint(fun, policy=policy)`` on JAX's partial-eval path under either flag
    (0.10 and 0.11 read the flag when ``jax.checkpoint`` is called, 0.12 when the
    checkpointed function is)."""
    with remat2():
        checkpointed = jax.checkpoint(fun, policy=policy, prevent_cse=prevent_cse)

    @functools.wraps(fun)
    def on_remat2(*args, **kwargs):
        with remat2():
            return checkpointed(*args, **kwargs)

    return on_remat2


def jvp_jaxpr(closed: ClosedJaxpr, nonzeros: list[bool]) -> tuple[core.Jaxpr, list]:
    """The JVP'd jaxpr exactly as ``remat_jvp`` builds it, consts as leading invars."""
    jvp_closed, _ = ad.jvp_jaxpr(closed, nonzeros, False)
    return pe.convert_constvars_jaxpr(jvp_closed.jaxpr), list(jvp_closed.consts)


def close_with_consts_as_inputs(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``jax.checkpoint`` turns the traced function's consts into leading inputs."""
    return pe.close_jaxpr(pe.convert_constvars_jaxpr(closed.jaxpr))


def has_effects(eqn: core.JaxprEqn) -> bool:
    """Mirror of partial_eval's test: such equations always stay in the forward pass."""
    not_really = (core.NamedAxisEffect, core.InternalMutableArrayEffect)
    return any(not isinstance(e, not_really) for e in eqn.effects)


def source_of(eqn: core.JaxprEqn) -> str:
    return source_info_util.summarize(eqn.source_info)


def frames_of(eqn: core.JaxprEqn) -> list[tuple[str, int, str]]:
    """Where ``eqn`` was traced outside JAX, innermost first: (file, line, function) per
    frame of its traceback (JAX's own frames and the standard library's left out)."""
    return [(f.file_name, f.start_line, f.function_name)
            for f in source_info_util.user_frames(eqn.source_info.traceback)]


def new_name_eqn(src: core.Var, name: str, like: core.JaxprEqn) -> tuple[core.Var, core.JaxprEqn]:
    """``dst = name[name](src)``: what ``checkpoint_name`` binds."""
    dst = core.Var(src.aval)
    eqn = core.new_jaxpr_eqn([src], [dst], name_p, {"name": name}, set(), like.source_info,
                             like.ctx)
    return dst, eqn


def eval_jaxpr(jaxpr: core.Jaxpr, consts: list, *args):
    return core.eval_jaxpr(jaxpr, consts, *args)


def user_context_of(eqn: core.JaxprEqn):
    """Equations traced inside take ``eqn``'s place in the user's code (its traceback and
    name stack), not the frame of the library that re-emits them."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    return source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)


def bind_equation(eqn: core.JaxprEqn, invals: list) -> list:
    """Re-emit one equation on ``invals``, as ``core.eval_jaxpr`` does."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with user_context_of(eqn), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]
