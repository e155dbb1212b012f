"""Names-only plans, and the config overrides a framework builds them from.

A framework that takes its remat policy from a config (MaxText's ``remat_policy:
custom``) builds ``save_and_offload_only_these_names`` over the tensors the config
marks ``device`` or ``offload``, around each scanned layer. So the step MaxText builds
from a plan's exported overrides is the LM of the corpus (``tests/lm_models.py``,
named as MaxText names its tensors) with that names policy in its scan's checkpoint:
its peak is measured here against the plan's prediction, its dot FLOPs against every
MaxText preset that fits the budget. MaxText itself, built from its own config, is
``bench/maxtext_plans.py``'s (it needs Python 3.12 and MaxText installed).
"""

from __future__ import annotations

import sys
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optiremat
from optiremat.cli import main
from optiremat.client.frameworks import (
    MAXTEXT_PRESETS,
    MAXTEXT_TENSORS,
    ExportError,
    levanter_policy,
)
from optiremat.client.peak.placement import Placement
from optiremat.client.peak.step_graph import StepExtraction, step_extraction
from optiremat.client.plan import PeakPlan, PlanError
from optiremat.client.planfile import PlanFile, load_plan
from optiremat.client.step import Step, lowered_peak
from optiremat.solver.solution import LayerGroup
from tests.lm_models import dot_flops, lm

STEP = Step.of(0)


@cache
def _model() -> tuple[object, tuple, StepExtraction]:
    fun, args = lm(layers=4, d=128, ffn=344, heads=4, kv_heads=2, vocab=1024, batch=2,
                   seq=128, tied=True)
    return fun, args, step_extraction(fun, args, STEP, name="lm")


def _as_maxtext_builds(overrides: dict[str, str]):
    """The LM as MaxText builds it from ``overrides``: each scanned layer checkpointed by
    ``save_and_offload_only_these_names`` over the tensors marked device and offload."""
    fun, _, extracted = _model()
    placement = Placement(extracted.regions, extracted.differentiated, STEP)
    device = [k for k in MAXTEXT_TENSORS if overrides.get(k) == "device"]
    offload = [k for k in MAXTEXT_TENSORS if overrides.get(k) == "offload"]
    return placement.apply(fun, jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=device, names_which_can_be_offloaded=offload,
        offload_src="device", offload_dst="pinned_host"))


@cache
def _measured(overrides: tuple[tuple[str, str], ...]) -> tuple[int, int]:
    """The peak and dot FLOPs of the step MaxText builds from ``overrides``."""
    _, args, _ = _model()
    built = _as_maxtext_builds(dict(overrides))
    return lowered_peak(STEP.function(built).lower(*args)), dot_flops(built, *args)


def _preset(name: str) -> tuple[int, int]:
    return _measured(tuple((k, "device") for k in sorted(MAXTEXT_PRESETS[name])))


@cache
def _plan(budget: int) -> PeakPlan:
    fun, args, _ = _model()
    plan = optiremat.optimize(fun, *args, budget=budget, saveable="maxtext")
    assert isinstance(plan, PeakPlan)
    return plan


def _budgets() -> list[int]:
    """Midway between consecutive distinct preset peaks, and the highest preset's peak."""
    peaks = sorted({_preset(name)[0] for name in MAXTEXT_PRESETS})
    return [(a + b) // 2 for a, b in zip(peaks, peaks[1:], strict=False)] + peaks[-1:]


def test_maxtext_built_from_the_exported_overrides_peaks_as_planned() -> None:
    """At budgets between MaxText's presets: the step MaxText builds from the overrides
    peaks at the plan's prediction, within the budget, and does no more dot FLOPs than
    the best preset that fits."""
    budgets = _budgets()
    assert len(budgets) >= 3  # the presets are apart on this model
    for budget in budgets:
        plan = _plan(budget)
        overrides = plan.to_maxtext()
        assert overrides["remat_policy"] == "custom"
        assert set(overrides) == {"remat_policy", *MAXTEXT_TENSORS}
        peak, dots = _measured(tuple(sorted(overrides.items())))
        assert plan.peak_bytes == peak <= budget
        best = min(d for p, d in map(_preset, MAXTEXT_PRESETS) if p <= budget)
        assert dots <= best, (budget, overrides)


def test_a_names_only_plan_saves_named_values_only_and_keeps_the_gradients() -> None:
    fun, args, _ = _model()
    plan = _plan(_budgets()[-1])
    assert plan.saved_keys and all(k.startswith("name:") for k in plan.saved_keys)
    want = jax.jit(jax.grad(fun))(*args)
    got = jax.jit(jax.grad(plan.apply(fun)))(*args)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_plan_maxtext_cannot_express_is_refused_with_the_reason() -> None:
    fun, args, _ = _model()
    budget = _budgets()[-1]
    # A full plan with room saves unnamed values (every dot's output, say).
    full = optiremat.optimize(fun, *args, budget=2 * budget)
    with pytest.raises(ExportError, match="no checkpoint_name names.*saveable='maxtext'"):
        full.to_maxtext()
    named = _plan(budget)
    nested = named.solution.model_copy(update={"groups": [2]})
    with pytest.raises(ExportError, match="nests a stack's layers"):
        _with(named, nested).to_maxtext()
    apart = named.solution.model_copy(update={"layer_groups": [
        LayerGroup(region=0, layers=2, saved_keys=[]),
        LayerGroup(region=0, layers=2, saved_keys=sorted(named.saved_keys))]})
    with pytest.raises(ExportError, match="one policy per stack"):
        _with(named, apart).to_maxtext()


def _with(plan: PeakPlan, solution) -> PeakPlan:
    return PeakPlan(plan.graph, solution, plan.traced, plan.options,
                    key_aliases=plan.key_aliases, checkpoint_names=plan.checkpoint_names,
                    placement=plan.placement)


def _named_scan():
    """A scan whose layer names a value MaxText has no key for."""
    from jax.ad_checkpoint import checkpoint_name

    def loss(ws, x):
        def layer(h, w):
            a = checkpoint_name(jnp.sin(h @ w), "my_value")
            return jnp.tanh(checkpoint_name(a @ w, "out_proj")), None
        h, _ = jax.lax.scan(layer, x, ws)
        return jnp.sum(h)
    return loss, (jnp.full((4, 64, 64), 0.01), jnp.ones((32, 64)))


def test_names_maxtext_does_not_set_are_recomputed_or_refused() -> None:
    loss, args = _named_scan()
    roomy = 64 * 2**20
    # Planned for MaxText, the name it cannot set is recomputed.
    for_maxtext = optiremat.optimize(loss, *args, budget=roomy, saveable="maxtext")
    assert for_maxtext.names_decided("maxtext")["my_value"] == "remat"
    # Planned over every name, a roomy budget keeps it, and MaxText's export refuses it.
    every_name = optiremat.optimize(loss, *args, budget=roomy, saveable="names")
    with pytest.raises(ExportError, match="'my_value', a name MaxText's config does not set"):
        every_name.to_maxtext()
    # A list of names: only those are decided.
    listed = optiremat.optimize(loss, *args, budget=roomy, saveable=["my_value"])
    assert all(listed.checkpoint_names.get(k) == "my_value"
               for k in listed.saved_keys)


@pytest.mark.parametrize("saveable, match", [
    ("maxtxt", "saveable= takes one of 'all', 'names', 'maxtext'"),
    ([], "non-empty list of checkpoint names"),
    ([3], "non-empty list of checkpoint names"),
])
def test_a_bad_saveable_is_refused_before_tracing(saveable, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        optiremat.optimize(lambda x: x, 1.0, budget="1MiB", saveable=saveable)


def test_options_maxtext_cannot_take_are_refused() -> None:
    with pytest.raises(PlanError, match="layer_groups=True"):
        optiremat.optimize(lambda x: x, 1.0, budget="1MiB", saveable="maxtext",
                           layer_groups=True)
    with pytest.raises(PlanError, match="nest=True"):
        optiremat.optimize(lambda x: x, 1.0, budget="1MiB", saveable="maxtext", nest=True)
    with pytest.raises(PlanError, match="tie=False"):
        optiremat.optimize(lambda x: x, 1.0, budget="1MiB", memory="residuals",
                           saveable="names", tie=False)


def test_the_cli_exports_a_plan_file(tmp_path, capsys) -> None:
    plan = _plan(_budgets()[-1])
    path = PlanFile.of(plan).write(tmp_path / "plan.json")
    loaded = load_plan(path)
    assert loaded.version == 2 and loaded.checkpoint_names == plan.checkpoint_names
    assert main(["export", "maxtext", str(path)]) == 0
    yaml = capsys.readouterr().out
    assert yaml.splitlines()[0] == "remat_policy: 'custom'"
    assert {line.split(": ")[0] for line in yaml.splitlines()} == {"remat_policy",
                                                                  *MAXTEXT_TENSORS}
    assert main(["export", "maxtext", str(path), "--format", "args"]) == 0
    args = capsys.readouterr().out.split()
    assert args[0] == "remat_policy=custom"
    assert dict(a.split("=") for a in args) == plan.to_maxtext()
    # A plan file without names (optiremat solve writes none) says how to get one.
    bare = PlanFile(graph=plan.graph, solution=plan.solution).write(tmp_path / "bare.json")
    assert main(["export", "maxtext", str(bare)]) == 1
    assert "names no checkpoint_name" in capsys.readouterr().err


def test_plan_maxtext_without_maxtext_says_what_it_needs(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "maxtext", None)  # as where it is not installed
    assert main(["plan-maxtext", "base.yml", "--budget", "1GiB"]) == 1
    said = capsys.readouterr().err.splitlines()
    assert said[0] == "# optiremat: building the model MaxText builds from base.yml"
    assert "needs MaxText installed beside optiremat" in said[-1]


# ---- Levanter: Haliax's ScanCheckpointPolicy over a scan's carry, inputs and internals ----

CARRY, INPUT = "scan(layers)__carry", "scan(layers)__input"


@cache
def _haliax_scan():
    """A stack scanned as Haliax's ``Stacked`` scans it: each layer's carry and its slice
    of the stacked weights named inside the checkpointed block, one internal named."""
    from jax.ad_checkpoint import checkpoint_name

    def loss(ws, x):
        def layer(h, w):
            h, w = checkpoint_name(h, CARRY), checkpoint_name(w, INPUT)
            hidden = checkpoint_name(jnp.sin(h @ w), "mlp_hidden")
            return h + jnp.tanh(jnp.cos(hidden) @ w.T), None
        h, _ = jax.lax.scan(layer, x, ws)
        return jnp.sum(h * h)
    args = (jnp.full((6, 128, 256), 0.01), jnp.ones((512, 128)))
    return loss, args, step_extraction(loss, args, STEP, name="haliax_scan")


def _as_levanter_builds(policy: dict):
    """The stack as Haliax builds it from ``gradient_checkpointing``'s fields: each layer
    under ``save_and_offload_only_these_names`` over the carry and inputs it saves or
    offloads and the internals it lists."""
    loss, _, extracted = _haliax_scan()
    saved = [name for field, name in (("save_carries", CARRY), ("save_inputs", INPUT))
             if policy[field] is True] + policy["save_block_internals"]
    offloaded = [name for field, name in (("save_carries", CARRY), ("save_inputs", INPUT))
                 if policy[field] == "offload"] + policy["offload_block_internals"]
    placement = Placement(extracted.regions, extracted.differentiated, STEP)
    return placement.apply(loss, jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved, names_which_can_be_offloaded=offloaded,
        offload_src="device", offload_dst="pinned_host"))


def _levanter_peak(policy: dict) -> int:
    _, args, _ = _haliax_scan()
    return lowered_peak(STEP.function(_as_levanter_builds(policy)).lower(*args))


def test_levanter_built_from_the_exported_policy_peaks_as_planned(tmp_path, capsys) -> None:
    """Between Levanter's default (carries saved) and every name saved: the stack Haliax
    builds from ``to_levanter()`` peaks at the plan's prediction, within the budget, and
    ``optiremat export levanter`` writes that policy under ``model:``."""
    loss, args, _ = _haliax_scan()
    def fields(saved: list[str]) -> dict:
        return {"save_carries": True, "save_inputs": INPUT in saved,
                "save_block_internals": [n for n in saved if n not in (CARRY, INPUT)],
                "offload_block_internals": []}
    low = _levanter_peak(fields([CARRY]))
    high = _levanter_peak(fields([CARRY, INPUT, "mlp_hidden"]))
    assert low < high  # the internal is worth saving, and costs bytes
    for budget, internals in (((low + high) // 2, []), (high, ["mlp_hidden"])):
        plan = optiremat.optimize(loss, *args, budget=budget, saveable="levanter")
        policy = plan.to_levanter()
        assert plan.peak_bytes == _levanter_peak(policy) <= budget, policy
        assert policy["save_block_internals"] == internals
        # The carry is the checkpointed layer's own input, kept whatever the policy:
        # saving it would change nothing but add a reduce_precision op per layer.
        assert policy["save_carries"] is False
    # explain() and `optiremat explain` show a saved value by its name.
    assert "name 'mlp_hidden'" in plan.explain()
    path = PlanFile.of(plan).write(tmp_path / "plan.json")
    main(["explain", str(path)])
    assert "name 'mlp_hidden'" in capsys.readouterr().out
    assert main(["export", "levanter", str(path)]) == 0
    yaml = capsys.readouterr().out.splitlines()
    assert yaml[:2] == ["model:", "  gradient_checkpointing:"]
    assert "    save_block_internals: ['mlp_hidden']" in yaml
    assert main(["export", "levanter", str(path), "--format", "args"]) == 1
    assert "these overrides nest" in capsys.readouterr().err


def test_levanter_takes_one_choice_for_every_scans_carries() -> None:
    """Two stacks whose carries the plan keeps apart: Levanter's one policy cannot."""
    decided = {"scan(encoder)__carry": "device", "scan(decoder)__carry": "remat"}
    with pytest.raises(ExportError, match=r"'scan\(\*\)__carry' differently in different"):
        levanter_policy(decided)
    offloaded = levanter_policy({"scan(layers)__input": "offload", "mlp_hidden": "offload"})
    assert offloaded == {"save_carries": False, "save_inputs": "offload",
                         "save_block_internals": [], "offload_block_internals": ["mlp_hidden"]}


def test_a_names_only_frontier_is_the_plans_optimize_makes(tmp_path) -> None:
    """``sweep`` over a names-only graph, its framework's presets measured as candidates:
    each point is ``optimize(..., saveable="maxtext")``'s plan at that budget; and
    ``plot_function(..., saveable="maxtext")`` marks MaxText's presets, not JAX's."""
    from optiremat.client.frameworks import MAXTEXT, Saveable, preset_saves
    from optiremat.client.frontier import graph_builtin_points, sweep
    from optiremat.client.peak.measures import step_measure
    from optiremat.client.plot import plot_function

    fun, args, _ = _model()
    names = step_extraction(fun, args, STEP, name="lm", names=MAXTEXT.names_only)
    placement = Placement(names.regions, names.differentiated, STEP)
    presets = preset_saves(names.graph, names.extraction.key_aliases,
                           names.extraction.names_by_key, Saveable.of("maxtext"))
    assert set(presets) == set(MAXTEXT_PRESETS)
    budgets = _budgets()[:2]
    frontier = sweep(names.graph, budgets, regions=names.regions,
                     measure=step_measure(fun, args, names, placement),
                     presets=list(presets.values()), layer_groups=False, nest=False)
    for point in frontier.points:
        plan = _plan(point.budget_bytes)
        assert (point.peak_bytes, point.recompute_flops) == (plan.peak_bytes,
                                                             plan.recompute_flops)
    assert set(graph_builtin_points(names.graph, names.regions, presets)) == set(presets)
    assert plot_function(fun, *args, path=tmp_path / "names.png", points=2,
                         saveable="maxtext").stat().st_size > 0
