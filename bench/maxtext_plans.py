"""MaxText, built from its own config with the overrides a names-only plan exports.

    make bench-maxtext MAXTEXT_PYTHON=python3.12     # builds .venv-maxtext, then runs this
    .venv-maxtext/bin/python bench/maxtext_plans.py [--layers 4]

A small Llama2 decoder through MaxText 0.2.5's own config path (``client.maxtext``:
``pyconfig`` over ``base.yml``, the NNX ``Transformer``, ``train.loss_fn``): 4 scanned
layers, D 256, MLP 688, 8 query / 2 KV heads of 32, V 1024, T 256, B 4, f32, CPU. It
prints:

* every MaxText preset (``remat_policy``): the measured peak of its training step (XLA's
  ``memory_analysis()`` of ``jax.jit(jax.grad(loss))``: argument + output + temp - alias),
  its dot FLOPs counted on the step's jaxpr (a scan's body times its length: one rule for
  a plan and a preset alike) and XLA's own ``cost_analysis()`` count beside (on CPU it
  counts a loop's body once);
* at budgets midway between consecutive distinct preset peaks, and at each preset's peak:
  the plan (``plan_maxtext``: ``optimize(..., saveable="maxtext")``), its exported
  overrides, and MaxText rebuilt from its config with them: its measured peak against the
  plan's prediction, within the budget or not, its dot FLOPs against the best preset
  that fits the budget, and the time to plan against one compile of the step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from optiremat.client.frameworks import MAXTEXT_PRESETS  # noqa: E402
from optiremat.client.maxtext import config_args, maxtext_step, plan_maxtext  # noqa: E402
from optiremat.client.step import memory_analysis  # noqa: E402
from optiremat.solver.units import format_bytes  # noqa: E402
from tests.lm_models import dot_flops  # noqa: E402

MiB = 2**20


def config(layers: int) -> dict[str, Any]:
    """The small Llama2 decoder, on one CPU device."""
    return {"run_name": "optiremat_bench", "base_output_directory": "/tmp/optiremat-maxtext",
            "hardware": "cpu", "skip_jax_distributed_system": True,
            "decoder_block": "llama2", "base_num_decoder_layers": layers,
            "base_emb_dim": 256, "base_mlp_dim": 688, "base_num_query_heads": 8,
            "base_num_kv_heads": 2, "head_dim": 32, "vocab_size": 1024,
            "max_target_length": 256, "per_device_batch_size": 4, "scan_layers": True,
            "dtype": "float32", "weight_dtype": "float32", "attention": "dot_product",
            "enable_checkpointing": False, "dataset_type": "synthetic",
            "enable_dropout": False, "remat_policy": "full"}


def measured(base: dict[str, Any], overrides: dict[str, Any]) -> tuple[int, int, float, float]:
    """MaxText built from its config with ``overrides``: its step's peak, dot FLOPs, XLA's
    FLOPs and the seconds its compile took."""
    step = maxtext_step(config_args(None, {**base, **overrides}))
    start = time.perf_counter()
    compiled = jax.jit(jax.grad(step.loss)).lower(step.params, step.batch).compile()
    seconds = time.perf_counter() - start
    m = memory_analysis(compiled)
    peak = (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
            - m.alias_size_in_bytes)
    cost = compiled.cost_analysis()
    xla = float((cost[0] if isinstance(cost, list) else cost).get("flops", 0.0))
    return peak, dot_flops(step.loss, step.params, step.batch), xla, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    base = config(args.layers)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; MaxText llama2, "
          f"{args.layers} layers, D 256, T 256, B 4, f32")

    presets = {name: measured(base, {"remat_policy": name}) for name in MAXTEXT_PRESETS}
    compile_seconds = presets["full"][3]
    print(f"\n{'preset':34}{'peak':>12}{'dot FLOPs':>12}{'XLA FLOPs':>12}")
    for name, (peak, dots, xla, _) in sorted(presets.items(), key=lambda kv: kv[1][0]):
        print(f"{name:34}{format_bytes(peak):>12}{dots:12.4g}{xla:12.4g}")

    peaks = sorted({p for p, *_ in presets.values()})
    budgets = [(a + b) // 2 for a, b in zip(peaks, peaks[1:], strict=False)] + peaks
    print(f"\none compile of the step: {compile_seconds:.1f} s\n")
    print(f"{'budget':>12}{'predicted':>12}{'MaxText':>12}{'error':>8}  fits  "
          f"{'dots/best':>9}  {'plan s':>6}  overrides (device)")
    rows = []
    for budget in budgets:
        start = time.perf_counter()
        plan, overrides = plan_maxtext(config_args(None, base), budget)
        seconds = time.perf_counter() - start
        peak, dots, _, _ = measured(base, overrides)
        assert plan.peak_bytes is not None
        error = (plan.peak_bytes - peak) / peak
        best = min(d for p, d, *_ in presets.values() if p <= budget)
        device = [k for k, v in overrides.items() if v == "device"]
        rows.append((abs(error) <= 0.01, peak <= budget, dots <= best, seconds))
        print(f"{format_bytes(budget):>12}{format_bytes(plan.peak_bytes):>12}"
              f"{format_bytes(peak):>12}{error:+8.2%}  {'yes' if peak <= budget else 'NO':4}"
              f"{dots / best:10.3f}  {seconds:6.1f}  {', '.join(device)}")
    print(f"\nwithin 1% of MaxText's measured peak {sum(r[0] for r in rows)}/{len(rows)}; "
          f"within budget {sum(r[1] for r in rows)}/{len(rows)}; dot FLOPs at most the best "
          f"preset that fits {sum(r[2] for r in rows)}/{len(rows)}; plan time "
          f"{min(r[3] for r in rows) / compile_seconds:.1f}x to "
          f"{max(r[3] for r in rows) / compile_seconds:.1f}x one compile")
    return 0 if all(all(r[:3]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
