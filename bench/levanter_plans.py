"""Levanter, built from its own config with the gradient_checkpointing a names-only plan exports.

    VENV/bin/python bench/levanter_plans.py [--layers 4]   # VENV: optiremat and Levanter, as below

Levanter's ``model.gradient_checkpointing`` (Haliax's ``ScanCheckpointPolicy``) is in their
source repositories only, not in their released packages, and their pins predate jax 0.12. So
beside optiremat (a Python 3.12 venv, ``pip install -e '.[client]'``), install Haliax and
Levanter from source checkouts with ``pip install --no-deps -e`` (checked at Haliax
f41e7d4 and Levanter 9263f81), then, pinning jax to the version optiremat brought, the
packages their imports ask for: equinox, jaxtyping, optax, draccus, jmp, aqtp,
safetensors, GitPython, tqdm-loggable, chex, pyarrow, tblib, async-lru, datasets,
braceexpand, transformers (below 5, as Levanter pins it), pytimeparse, ray,
humanfriendly, deepdiff, dataclasses-json. Two incompatibilities of those checkouts with
jax 0.12 are patched at run time here (``jax012_shims``), never in their code.

A small Llama through Levanter's own config path: ``LlamaConfig`` decoded by draccus from
the ``model:`` mapping a run's YAML gives (4 scanned layers, D 256, MLP 688, 8 query / 2
KV heads, V 1024, T 256, B 4, f32, CPU, Levanter's default attention for the platform),
``LlamaLMHeadModel.init``, and the loss as Levanter's trainer takes its gradient
(``compute_next_token_loss(...).mean()`` over ``eqx.partition(model,
eqx.is_inexact_array)``'s arrays, the differentiated first argument). It prints:

* every Levanter preset of ``gradient_checkpointing`` (``True``, Levanter's default:
  Equinox's checkpoint without a policy; ``"full"``/``"recompute"``; Haliax's
  ``ScanCheckpointPolicy()`` default, carries saved; carries and inputs saved;
  ``"offload"``; ``"nested"``; and ``False``, no checkpoint, for reference only): the
  measured peak of its training step (XLA's ``memory_analysis()`` of
  ``jax.jit(jax.grad(loss))``: argument + output + temp - alias), its dot FLOPs counted on
  the step's jaxpr (a scan's body times its length) and XLA's own ``cost_analysis()``
  count (on CPU it counts a loop's body once);
* at budgets midway between consecutive distinct preset peaks, and at each preset's peak:
  the plan (``optimize(..., saveable="levanter")``), its ``to_levanter()`` policy written
  as ``optiremat export levanter`` writes it and read back by draccus into
  ``LlamaConfig``, and Levanter rebuilt from that config: its measured peak against the
  plan's prediction, within the budget or not, its FLOPs (XLA's and dot) against the best
  preset that fits the budget, and the time to plan against one compile of the step;
* past the presets: the plan at the peak of ``gradient_checkpointing: false``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import optiremat  # noqa: E402
from optiremat.client.frameworks import config_text  # noqa: E402
from optiremat.solver.units import format_bytes  # noqa: E402
from tests.lm_models import dot_flops  # noqa: E402


def jax012_shims() -> list[str]:
    """Runtime patches (ours, not Levanter's code) for what Haliax f41e7d4 and Levanter
    9263f81 take from jax releases before 0.12; each applied only where needed. Returns
    what was patched."""
    import haliax.nn.loss

    applied = []
    # Haliax's einsum asks ``jax.core.is_constant_dim``, which jax 0.12 no longer exports.
    if not hasattr(jax.core, "is_constant_dim"):
        from jax._src import core as jax_core

        jax.core.is_constant_dim = jax_core.is_constant_dim  # type: ignore[attr-defined]
        applied.append("jax.core.is_constant_dim aliased to jax._src.core's")
    # Levanter's next-token loss hands ``hax.mean`` a float 0/1 loss mask as ``where``;
    # jax 0.12's reductions take boolean masks only. The mask as booleans is the same mask.
    try:
        jnp.mean(jnp.ones(2), where=jnp.ones(2))
    except ValueError:
        reduce = haliax.nn.loss.maybe_reduce_loss

        def maybe_reduce_loss(arr: Any, reduction: Any, reduction_axis: Any, where: Any) -> Any:
            return reduce(arr, reduction, reduction_axis, None if where is None else where != 0)

        haliax.nn.loss.maybe_reduce_loss = maybe_reduce_loss
        applied.append("haliax.nn.loss.maybe_reduce_loss takes its where mask as booleans")
    return applied


def model_config(layers: int) -> dict[str, Any]:
    """The small Llama, as a run's YAML writes ``model:``."""
    return {"type": "llama", "seq_len": 256, "hidden_dim": 256, "intermediate_dim": 688,
            "num_layers": layers, "num_heads": 8, "num_kv_heads": 2}


# Levanter's presets, as ``model.gradient_checkpointing`` takes them in a run's YAML.
PRESETS: dict[str, Any] = {
    "true (Levanter's default)": True,
    "full": "full",
    "recompute": "recompute",
    "{} (carries saved)": {},
    "{save_inputs: true}": {"save_inputs": True},
    "offload": "offload",
    "nested": "nested",
}
NO_CHECKPOINT = "false (no checkpoint)"


class Levanter:
    """Levanter's Llama and LM loss, built from its config."""

    def __init__(self, layers: int) -> None:
        import draccus
        import equinox as eqx
        import haliax as hax
        from levanter.models.lm_model import LmConfig, LmExample

        self.eqx, self.draccus, self.LmConfig = eqx, draccus, LmConfig
        self.base = model_config(layers)
        self.Vocab = hax.Axis("vocab", 1024)
        Batch, Pos = hax.Axis("batch", 4), hax.Axis("position", self.base["seq_len"])
        tokens = hax.random.randint(jax.random.PRNGKey(1), (Batch, Pos), 0, self.Vocab.size)
        self.batch = hax.vmap(LmExample.causal, Batch)(tokens)

    def config(self, gradient_checkpointing: Any) -> Any:
        return self.draccus.decode(
            self.LmConfig, {**self.base, "gradient_checkpointing": gradient_checkpointing})

    def step(self, gradient_checkpointing: Any) -> tuple[Any, Any, Any]:
        """``(loss, params, batch)``: the loss as Levanter's trainer differentiates it."""
        from levanter.models.llama import LlamaLMHeadModel
        from levanter.models.lm_model import compute_next_token_loss

        config = self.config(gradient_checkpointing)
        model = LlamaLMHeadModel.init(self.Vocab, config, key=jax.random.PRNGKey(0))
        params, static = self.eqx.partition(model, self.eqx.is_inexact_array)

        def loss(params: Any, batch: Any) -> Any:
            return compute_next_token_loss(self.eqx.combine(params, static), batch).mean().scalar()

        return loss, params, self.batch


def measured(levanter: Levanter, gradient_checkpointing: Any) -> tuple[int, int, float, float]:
    """Levanter built from its config: its step's peak, dot FLOPs, XLA's FLOPs and the
    seconds its compile took."""
    loss, params, batch = levanter.step(gradient_checkpointing)
    start = time.perf_counter()
    compiled = jax.jit(jax.grad(loss)).lower(params, batch).compile()
    seconds = time.perf_counter() - start
    cost = compiled.cost_analysis()
    xla = float((cost[0] if isinstance(cost, list) else cost).get("flops", 0.0))
    return optiremat.measured_peak(compiled), dot_flops(loss, params, batch), xla, seconds


def exported_policy(plan: Any) -> dict[str, Any]:
    """``plan.to_levanter()`` as ``optiremat export levanter`` writes it, read back."""
    import yaml

    text = config_text({"model": {"gradient_checkpointing": plan.to_levanter()}})
    return yaml.safe_load(text)["model"]["gradient_checkpointing"]


def short(policy: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in policy.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    shims = jax012_shims()
    from haliax.nn import ScanCheckpointPolicy

    levanter = Levanter(args.layers)
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}"
                         for p in ("haliax", "levanter", "equinox"))
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; {versions}; Levanter llama, "
          f"{args.layers} layers, D 256, T 256, B 4, V 1024, f32")
    for shim in shims:
        print(f"shim for jax 0.12: {shim}")

    presets = {name: measured(levanter, value) for name, value in PRESETS.items()}
    unchecked = measured(levanter, False)
    compile_seconds = presets["full"][3]
    print(f"\n{'gradient_checkpointing':28}{'peak':>12}{'dot FLOPs':>12}{'XLA FLOPs':>14}")
    for name, (peak, dots, xla, _) in sorted(
            [*presets.items(), (NO_CHECKPOINT, unchecked)], key=lambda kv: kv[1][0]):
        print(f"{name:28}{format_bytes(peak):>12}{dots:12.4g}{xla:14.6g}")

    loss, params, batch = levanter.step(True)
    least = optiremat.min_feasible_budget(loss, params, batch, saveable="levanter")
    peaks = sorted({p for p, *_ in presets.values()})
    budgets = [(a + b) // 2 for a, b in zip(peaks, peaks[1:], strict=False)] + peaks
    print(f"\n{len(peaks)} distinct preset peaks; smallest plan (min_feasible_budget) "
          f"{format_bytes(least)}; one compile of the step: {compile_seconds:.1f} s\n")
    print(f"{'budget':>12}{'predicted':>12}{'Levanter':>12}{'error':>8}  fits  "
          f"{'XLA FLOPs':>12}{'XLA/best':>10}{'dots/best':>10}  {'plan s':>6}  "
          f"gradient_checkpointing")
    rows = []
    for budget in budgets:
        start = time.perf_counter()
        try:
            plan = optiremat.optimize(loss, params, batch, budget=budget, saveable="levanter")
            policy = exported_policy(plan)
        except optiremat.OptirematError as err:  # refused: the message is the finding
            rows.append((False, False, False, False, time.perf_counter() - start))
            print(f"{format_bytes(budget):>12}  {type(err).__name__}: {err}")
            continue
        seconds = time.perf_counter() - start
        # What the config gives Haliax is the policy ``ScanCheckpointPolicy(**fields)`` builds.
        built = levanter.config(policy).gradient_checkpointing
        assert built == ScanCheckpointPolicy(**plan.to_levanter()), (built, policy)
        peak, dots, xla, _ = measured(levanter, policy)
        assert plan.peak_bytes is not None
        error = (plan.peak_bytes - peak) / peak
        fitting = [v for v in presets.values() if v[0] <= budget]
        best_xla, best_dots = min(v[2] for v in fitting), min(v[1] for v in fitting)
        rows.append((plan.peak_bytes == peak, peak <= budget, xla <= best_xla,
                     dots <= best_dots, seconds))
        print(f"{format_bytes(budget):>12}{format_bytes(plan.peak_bytes):>12}"
              f"{format_bytes(peak):>12}{error:+8.2%}  {'yes' if peak <= budget else 'NO':4}"
              f"{xla:12.6g}{xla / best_xla:10.5f}{dots / best_dots:10.3f}  {seconds:6.1f}  "
              f"{short(policy)}")
    n = len(rows)
    print(f"\npredicted == Levanter's measured peak {sum(r[0] for r in rows)}/{n}; within "
          f"budget {sum(r[1] for r in rows)}/{n}; XLA FLOPs at most the best preset that fits "
          f"{sum(r[2] for r in rows)}/{n}; dot FLOPs at most the best preset that fits "
          f"{sum(r[3] for r in rows)}/{n}; plan time "
          f"{min(r[4] for r in rows) / compile_seconds:.1f}x to "
          f"{max(r[4] for r in rows) / compile_seconds:.1f}x one compile")

    peak, dots, xla = unchecked[:3]
    try:
        plan = optiremat.optimize(loss, params, batch, budget=peak, saveable="levanter")
        policy = exported_policy(plan)
    except optiremat.OptirematError as err:
        print(f"\npast the presets, at {NO_CHECKPOINT}'s peak {format_bytes(peak)}: "
              f"{type(err).__name__}: {err}")
        return 0 if all(all(r[:4]) for r in rows) else 1
    ran = measured(levanter, policy)
    print(f"\npast the presets, at {NO_CHECKPOINT}'s peak {format_bytes(peak)}: the plan "
          f"measures {format_bytes(ran[0])} (predicted {format_bytes(plan.peak_bytes or 0)}), "
          f"dot FLOPs {ran[1] / dots:.3f}x and XLA FLOPs {ran[2] / xla:.3f}x no checkpoint's: "
          f"{short(policy)}")
    return 0 if all(all(r[:4]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
