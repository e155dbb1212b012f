"""The primitive registry against the pinned JAX and against what the corpora meet."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import pytest

import tests.models as residual_corpus
import tests.peak_models as scan_corpus
from optiremat.client import _jax_internals as jx
from optiremat.client.interpreter import CONTROL_FLOW
from optiremat.client.primitives import REGISTRY, Role, info
from optiremat.client.sharding_rules import COLLECTIVE_RULES, SPEC_RULES


def _jax_primitives() -> dict[str, set[jx.core.Primitive]]:
    """Every primitive object JAX's own modules define, by name."""
    found: dict[str, set[jx.core.Primitive]] = {}
    import jax._src as src

    for module in pkgutil.walk_packages(src.__path__, "jax._src."):
        if any(part in module.name for part in ("mosaic", "pallas", "triton", "tpu", "gpu",
                                                 "cuda", "rocm", "debugger", "profiler")):
            continue
        try:
            loaded = importlib.import_module(module.name)
        except Exception:  # optional backends and tools: not what the registry names
            continue
        for value in vars(loaded).values():
            if isinstance(value, jx.core.Primitive):
                found.setdefault(value.name, set()).add(value)
    return found


def test_every_entry_is_the_primitive_jax_defines_by_that_name() -> None:
    defined = _jax_primitives()
    names = [p.name for p in REGISTRY]
    assert len(names) == len(set(names)), "two entries for one name"
    for primitive in REGISTRY:
        assert primitive in defined.get(primitive.name, set()), primitive.name


def test_sharding_rules_and_control_flow_are_keyed_by_the_primitives_jax_defines() -> None:
    """As the registry is: a renamed or dropped primitive fails at import rather than
    silently match nothing, and every primitive that runs a jaxpr of its own (a role
    other than plain) has its control-flow object."""
    defined = _jax_primitives()
    for table in (SPEC_RULES, COLLECTIVE_RULES, CONTROL_FLOW):
        for primitive in table:
            assert primitive in defined.get(primitive.name, set()), primitive.name
    assert set(CONTROL_FLOW) == {p for p, entry in REGISTRY.items() if entry.role != Role.PLAIN}


def _subjaxprs(eqn) -> Iterator[jx.Jaxpr]:
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jx.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jx.Jaxpr):
                yield item


def _met(jaxpr: jx.Jaxpr, out: set[jx.core.Primitive]) -> set[jx.core.Primitive]:
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive)
        for sub in _subjaxprs(eqn):
            _met(sub, out)
    return out


def test_every_primitive_the_corpora_meet_has_an_entry() -> None:
    """Forward, and the backward pass under both ends of the policy range."""
    functions = [*residual_corpus.CORPUS.values(), *(m.build() for m in scan_corpus.CORPUS)]
    met: set[jx.core.Primitive] = set()
    for fun, args in functions:
        _met(jax.make_jaxpr(fun)(*args).jaxpr, met)
        for policy in (jax.checkpoint_policies.nothing_saveable,
                       jax.checkpoint_policies.everything_saveable):
            checkpointed = jax.checkpoint(fun, policy=policy)

            def backward(*a, checkpointed=checkpointed):
                out, vjp = jax.vjp(checkpointed, *a)
                return vjp(jnp.ones_like(out))

            _met(jax.make_jaxpr(backward)(*args).jaxpr, met)
    missing = sorted(p.name for p in met if p not in REGISTRY)
    assert not missing, f"no registry entry for {missing}"


@pytest.mark.parametrize("primitive,role", [
    (jx.pjit.jit_p, Role.CALL), (jx.remat_p, Role.CHECKPOINT), (jx.loops.scan_p, Role.SCAN),
    (jx.conditionals.cond_p, Role.COND), (jx.loops.while_p, Role.WHILE),
    (jx.custom_derivatives.custom_jvp_call_p, Role.PLAIN),
])
def test_roles_follow_what_partial_eval_does(primitive, role) -> None:
    assert info(primitive).role == role


def test_an_unknown_primitive_counts_as_elementwise() -> None:
    stranger = jx.core.Primitive("optiremat_test_stranger")
    assert info(stranger).role == Role.PLAIN and info(stranger).body is None
