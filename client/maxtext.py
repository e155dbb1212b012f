"""A MaxText model planned from its own config (MaxText 0.2.5, installed beside optiremat).

``maxtext_step`` builds what MaxText's trainer builds from a config: the config
(``pyconfig.initialize``, the same ``key=value`` overrides its launcher takes), the
NNX ``Transformer`` (``model_creation_utils``), and the training loss as a pure
function of the parameters and a batch, split and merged as ``pre_train/train.py``'s
``train_step`` differentiates it. ``plan_maxtext`` plans that loss names-only
(``saveable="maxtext"``, ``client.frameworks``) and answers with the config overrides
that make MaxText build the plan's policy: ``optiremat plan-maxtext CONFIG.yml
key=value ... --budget SIZE``. MaxText is imported here only: it is not a dependency.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import Any

import jax
import numpy as np

from optiremat.client.plan import PeakPlan, PlanError


@dataclass(frozen=True)
class MaxTextStep:
    """A MaxText model's training loss, its parameters and a batch of its shapes."""

    loss: Callable[[Any, dict], jax.Array]  # loss(params, batch), as train_step's
    params: Any  # the model's nnx.Param state (a pytree)
    batch: dict[str, jax.Array]  # synthetic tokens of the config's batch shapes
    config: Any  # MaxText's config
    mesh: Any  # the mesh MaxText builds from it


def _maxtext(module: str) -> Any:
    try:
        return import_module(f"maxtext.{module}")
    except ImportError as exc:
        raise PlanError(f"planning from a MaxText config needs MaxText installed beside "
                        f"optiremat (maxtext 0.2.5, Python 3.12): importing maxtext.{module} "
                        f"failed: {exc}") from None


def config_args(config: str | None, overrides: Sequence[str] | dict[str, Any]) -> list[str]:
    """``pyconfig.initialize``'s argv: the config file (MaxText's ``base.yml`` where none is
    given) and the overrides, each ``key=value``."""
    if config is None:
        config = os.path.join(os.path.dirname(_maxtext("configs.pyconfig").__file__),
                              "base.yml")
    items = overrides.items() if isinstance(overrides, dict) else None
    pairs = [f"{k}={_value(v)}" for k, v in items] if items is not None else list(overrides)
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise PlanError(f"a MaxText override is key=value, not {bad[0]!r}")
    return [config, *pairs]


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def maxtext_step(argv: Sequence[str]) -> MaxTextStep:
    """The training loss MaxText builds from ``argv`` (``config_args``)."""
    pyconfig = _maxtext("configs.pyconfig")
    utils = _maxtext("utils.maxtext_utils")
    creation = _maxtext("utils.model_creation_utils")
    train = _maxtext("trainers.pre_train.train")
    nnx = import_module("flax.nnx")
    rules = import_module("flax.core.spmd").logical_axis_rules

    config = pyconfig.initialize([None, *argv])
    mesh = utils.get_mesh_from_config(config)
    with jax.set_mesh(mesh), rules(config.logical_axis_rules):
        model = creation.get_nnx_create_model_fn(config, mesh)()
    # As train_step splits it: the parameters are what it differentiates.
    overwritten = nnx.variablelib.variable_type_from_name("_overwrite_with_gradient",
                                                          allow_register=True)
    nnx.pop(model, nnx.Intermediate)
    graphdef, params, custom, rest = nnx.split(model, nnx.Param, nnx.Any(overwritten), ...)

    def loss(params: Any, batch: dict) -> jax.Array:
        with rules(config.logical_axis_rules):
            model = nnx.merge(graphdef, params, custom, rest, copy=True)
            value, _ = train.loss_fn(model, config, dict(batch), None, None, is_train=True)
        return value

    return MaxTextStep(loss, params, _synthetic_batch(utils.get_shaped_batch(config),
                                                      config.vocab_size), config, mesh)


def _synthetic_batch(shaped: dict[str, Any], vocab: int) -> dict[str, jax.Array]:
    """Tokens of the config's batch shapes: positions counted, one segment per row."""
    rng = np.random.default_rng(0)
    batch = {}
    for key, spec in shaped.items():
        if key.endswith("_position"):
            value = np.broadcast_to(np.arange(spec.shape[-1]), spec.shape)
        elif key.endswith("_segmentation"):
            value = np.ones(spec.shape)
        else:
            value = rng.integers(1, vocab, spec.shape)
        batch[key] = jax.numpy.asarray(value, spec.dtype)
    return batch


def plan_maxtext(argv: Sequence[str], budget: int | str,
                 progress: Callable[[str], None] | None = None,
                 **options: Any) -> tuple[PeakPlan, dict[str, Any]]:
    """The names-only plan of the model MaxText builds from ``argv`` at ``budget`` (the
    peak of its training step's gradient), and the config overrides that build it.
    ``progress`` hears each stage as it starts (on a large model each takes minutes)."""
    from optiremat.client.planning import optimize

    say = progress or (lambda line: None)
    say(f"building the model MaxText builds from {argv[0]}")
    step = maxtext_step(argv)
    say(f"planning its training step ({len(jax.tree.leaves(step.params))} parameter "
        f"arrays, batch {dict((k, v.shape) for k, v in step.batch.items())}): each "
        "candidate plan is compiled")
    with jax.set_mesh(step.mesh):
        plan = optimize(step.loss, step.params, step.batch, budget=budget,
                        saveable="maxtext", **options)
    assert isinstance(plan, PeakPlan)
    return plan, plan.to_maxtext()
