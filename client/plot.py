"""The frontier plot: what each byte of residual memory buys in recompute FLOPs.

Plans from a budget sweep form a staircase (fewer bytes, more FLOPs); JAX's
built-in policies are marked as points on the same axes, so a policy above the
staircase is beaten by a plan at the same memory. Drawn with matplotlib's Agg
canvas (no display, no pyplot state), as PNG or SVG by the file's suffix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from optiremat.client.frontier import (
    DEFAULT_POINTS,
    Frontier,
    PolicyPoint,
    builtin_points,
    graph_builtin_points,
    sweep,
)
from optiremat.solver.baselines import BUILTIN_POLICIES

FORMATS = (".png", ".svg")
_MARKERS = dict(zip(BUILTIN_POLICIES, "sD^v", strict=True))


def plot_frontier(frontier: Frontier, path: str | Path, *,
                  builtins: Mapping[str, PolicyPoint] | None = None, title: str = "") -> Path:
    """Draw ``frontier`` (and ``builtins``) into ``path``; returns the path written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"write the plot as .png or .svg, not {path.name!r}")
    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()

    plans = frontier.plans
    builtins = dict(builtins or {})
    largest = max([p.memory_bytes or 0 for p in plans]
                  + [p.memory_bytes for p in builtins.values()] + [1])
    peak = any(p.peak_bytes is not None for p in plans)
    unit, scale = _byte_unit(largest)
    if plans:
        xs = [(p.memory_bytes or 0) / scale for p in plans]
        ys = [p.recompute_flops or 0 for p in plans]
        # A plan's FLOPs hold from its bytes up to the next plan's: a staircase.
        ax.step(xs, ys, where="post", color="tab:blue", linewidth=1.5, label="optiremat plans")
        pareto = [p for p in plans if p.pareto]
        ax.plot([(p.memory_bytes or 0) / scale for p in pareto],
                [p.recompute_flops or 0 for p in pareto],
                "o", color="tab:blue", markersize=5)
    if frontier.min_feasible_budget is not None:
        ax.axvspan(0, frontier.min_feasible_budget / scale, color="0.92", zorder=0,
                   label="below the smallest feasible budget")
    for name, point in builtins.items():
        ax.plot(point.memory_bytes / scale, point.recompute_flops, _MARKERS.get(name, "x"),
                color="tab:red", markersize=7, linestyle="none", label=f"jax: {name}")

    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: _si(y)))
    ax.set_xlabel(f"peak of the training step ({unit})" if peak
                  else f"residual memory ({unit})")
    ax.set_ylabel("recompute FLOPs (beyond saving everything)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="upper right")
    ax.set_title(title or f"frontier of graph {frontier.graph_hash[:12]}", fontsize="medium")
    fig.savefig(path, format=path.suffix[1:].lower(), dpi=120)
    return path


def _byte_unit(n: int) -> tuple[str, int]:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= 2 * size:
            return unit, size
    return "bytes", 1


def _si(x: float) -> str:
    for suffix, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= size:
            return f"{x / size:g}{suffix}"
    return f"{x:g}"


def plot_function(fun: Callable, *args: Any, path: str | Path, points: int = DEFAULT_POINTS,
                  memory: str = "peak", **options: Any) -> Path:
    """Extract ``fun``, sweep ``points`` budgets locally, price the built-ins, and plot:
    peaks of the training step by default (the built-ins applied per layer, as the
    model predicts them), or with ``memory="residuals"`` the residuals of one
    checkpoint around ``fun`` (the built-ins measured by ``saved_residuals``)."""
    from optiremat.client.extract import extract_graph
    from optiremat.client.step_graph import extract_step

    if memory == "peak":
        graph = extract_step(fun, *args)
        builtins = graph_builtin_points(graph)
    else:
        graph = extract_graph(fun, *args)
        builtins = builtin_points(fun, *args)
    # Solve at each built-in's bytes too: the plan there is the fair comparison.
    swept = sweep(graph, count=points, also=[p.memory_bytes for p in builtins.values()],
                  **options)
    title = getattr(fun, "__qualname__", "") or graph.name
    return plot_frontier(swept, path, builtins=builtins, title=title)
