"""The frontier plot: what each byte of residual memory buys in recompute FLOPs.

Plans from a budget sweep form a staircase (fewer bytes, more FLOPs); JAX's
built-in policies are marked as points on the same axes, so a policy above the
staircase is beaten by a plan at the same memory. A sweep with offload options
is drawn as peak bytes against estimated step time, each plan marked by its
lever (recomputation per layer, nested groups, offload) and the nested plan at
the smallest peak named. Drawn with matplotlib's Agg canvas (no display, no
pyplot state), as PNG or SVG by the file's suffix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from optiremat.client.frontier import (
    DEFAULT_POINTS,
    Frontier,
    FrontierPoint,
    PolicyPoint,
    builtin_points,
    graph_builtin_points,
    lever_floors,
    sweep,
)
from optiremat.client.peak.priced import cheapest_priced, price_problem
from optiremat.solver.baselines import BUILTIN_POLICIES

FORMATS = (".png", ".svg")
_MARKERS = dict(zip(BUILTIN_POLICIES, "sD^v", strict=True))


def plot_frontier(frontier: Frontier, path: str | Path, *,
                  builtins: Mapping[str, PolicyPoint] | None = None, title: str = "",
                  save_price: float | Fraction | None = None) -> Path:
    """Draw ``frontier`` (and ``builtins``) into ``path``; returns the path written. With
    ``save_price`` (FLOPs per saved byte) the plan of least recompute FLOPs + price x
    saved bytes is marked (``client.peak.priced.cheapest_priced``): where a priced
    ``optimize`` plans at budgets from its bytes up, to within the frontier's spacing.

    (Long on purpose: one figure, drawn top to bottom as matplotlib builds it.)"""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"write the plot as .png or .svg, not {path.name!r}")
    if save_price is not None and (problem := price_problem(save_price)) is not None:
        raise ValueError(problem)
    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()

    plans = frontier.plans
    builtins = dict(builtins or {})
    largest = max([p.memory_bytes or 0 for p in plans]
                  + [p.memory_bytes for p in builtins.values()] + [1])
    peak = any(p.peak_bytes is not None for p in plans)
    unit, scale = _byte_unit(largest)
    timed = _StepTime.of(frontier)

    def cost(p: FrontierPoint) -> float:
        return timed.of_plan(p) if timed else p.recompute_flops or 0

    if save_price is not None and timed:
        raise ValueError("save_price= marks a plan by recompute FLOPs and saved bytes; an "
                         "offload frontier is priced in estimated seconds already")

    if plans:
        xs = [(p.memory_bytes or 0) / scale for p in plans]
        # A plan's cost holds from its bytes up to the next plan's: a staircase.
        ax.step(xs, [cost(p) for p in plans], where="post", color="tab:blue", linewidth=1.5,
                label="optiremat plans")
        pareto = [p for p in plans if p.pareto]
        if timed:
            for lever, (marker, color) in _LEVERS.items():
                these = [p for p in pareto if p.lever == lever]
                if these:
                    ax.plot([(p.memory_bytes or 0) / scale for p in these],
                            [cost(p) for p in these], marker, color=color, markersize=6,
                            linestyle="none", label=f"plans: {lever}")
            nested = [p for p in plans if p.lever == "nested groups"]
            if nested:
                best = min(nested, key=lambda p: (p.memory_bytes or 0, cost(p)))
                ax.annotate(f"best nested form: {_groups(best)}",
                            ((best.memory_bytes or 0) / scale, cost(best)),
                            textcoords="offset points", xytext=(8, 8), fontsize="small")
        else:
            ax.plot([(p.memory_bytes or 0) / scale for p in pareto], [cost(p) for p in pareto],
                    "o", color="tab:blue", markersize=5)
    priced = None if save_price is None else cheapest_priced(plans, Fraction(save_price))
    if priced is not None:
        ax.plot((priced.memory_bytes or 0) / scale, cost(priced), "*", color="tab:orange",
                markersize=13, linestyle="none",
                label=f"least FLOPs + {float(save_price or 0):.3g} x saved bytes")
    if frontier.min_feasible_budget is not None:
        ax.axvspan(0, frontier.min_feasible_budget / scale, color="0.92", zorder=0,
                   label="below the smallest feasible budget")
    for name, point in builtins.items():
        y = timed.of_flops(point.recompute_flops) if timed else point.recompute_flops
        ax.plot(point.memory_bytes / scale, y, _MARKERS.get(name, "x"), color="tab:red",
                markersize=7, linestyle="none",
                label=f"jax: {name}" + (" per layer" if peak else ""))

    if timed:
        time_unit, per_second = _time_unit(max([cost(p) for p in plans] + [1e-9]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y * per_second:g}"))
        ax.set_ylabel(f"estimated step time ({time_unit})")
    else:
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: _si(y)))
        ax.set_ylabel("recompute FLOPs (beyond saving everything)")
    ax.set_xlabel(f"peak of the training step ({unit})" if peak
                  else f"residual memory ({unit})")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="upper right")
    ax.set_title(title or f"frontier of graph {frontier.graph_hash[:12]}", fontsize="medium")
    fig.savefig(path, format=path.suffix[1:].lower(), dpi=120)
    return path


# How a plan lowers its peak (``FrontierPoint.lever``), by marker and colour.
_LEVERS = {"recompute per layer": ("o", "tab:blue"), "nested groups": ("s", "tab:green"),
           "offload": ("^", "tab:purple")}


def _groups(p: FrontierPoint) -> str:
    return ", ".join(f"{k} groups" for k in p.groups or () if k != 1)


@dataclass(frozen=True)
class _StepTime:
    """A frontier's time axis: the step's own seconds plus what each plan adds."""

    step_seconds: float
    flop_rate: int

    @classmethod
    def of(cls, frontier: Frontier) -> _StepTime | None:
        offload = frontier.options.offload
        if frontier.step_seconds is None or offload is None:
            return None
        return cls(frontier.step_seconds, offload.device_flop_rate)

    def of_plan(self, p: FrontierPoint) -> float:
        if p.estimated_seconds is None:
            return self.of_flops(p.recompute_flops or 0)
        return self.step_seconds + p.estimated_seconds

    def of_flops(self, recompute_flops: int) -> float:
        return self.step_seconds + recompute_flops / self.flop_rate


def _byte_unit(n: int) -> tuple[str, int]:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= 2 * size:
            return unit, size
    return "bytes", 1


def _time_unit(seconds: float) -> tuple[str, float]:
    for unit, per_second in (("s", 1.0), ("ms", 1e3), ("µs", 1e6)):
        if seconds * per_second >= 2:
            return unit, per_second
    return "ns", 1e9


def _si(x: float) -> str:
    for suffix, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= size:
            return f"{x / size:g}{suffix}"
    return f"{x:g}"


def plot_function(fun: Callable, *args: Any, path: str | Path, points: int = DEFAULT_POINTS,
                  memory: str = "peak", save_price: float | Fraction | None = None,
                  **options: Any) -> Path:
    """Extract ``fun``, sweep ``points`` budgets locally, price the built-ins, and plot:
    peaks of the training step by default (plans and the built-ins applied per layer
    with their own working sets measured, ``client.peak.refine``, and a scan's layers
    planned apart where one policy leaves room, ``client.peak.apart``), or with
    ``memory="residuals"`` the residuals of one checkpoint around ``fun`` (the
    built-ins measured by ``saved_residuals``). With
    ``offload=OffloadOptions(...)`` the plans use all three levers and the plot is
    peak bytes against estimated step time. With ``saveable=`` (peak budgets) the plans
    are ``optimize(..., saveable=)``'s, names only, and the markers are the framework's
    presets (or JAX's built-ins as names). ``save_price`` marks the plan a priced
    ``optimize`` takes (``plot_frontier``)."""
    if save_price is not None and (problem := price_problem(save_price)) is not None:
        raise ValueError(problem)  # before the sweep's compiles, not after them
    from optiremat.client.extract import extract_graph
    from optiremat.client.frameworks import Saveable, preset_saves
    from optiremat.client.peak.measures import step_measure
    from optiremat.client.peak.placement import Placement
    from optiremat.client.peak.step_graph import step_extraction
    from optiremat.client.step import Step

    regions, measure = None, None
    saveable = Saveable.of(options.pop("saveable", "all"))
    presets: dict[str, list[bool]] = {}
    if saveable.names is not None and memory != "peak":
        raise ValueError("saveable= plots peak budgets: leave memory='peak'")
    if saveable.framework is not None:  # one policy per stack, nothing nested
        options["nest"] = False
    if memory == "peak":
        # An offload plan may offload each layer's input: named for the policy.
        offload = options.get("offload") is not None
        extracted = step_extraction(fun, args, Step.of(0),
                                    name=getattr(fun, "__qualname__", ""), name_inputs=offload,
                                    names=saveable.names)
        graph, regions = extracted.graph, extracted.regions
        presets = preset_saves(graph, extracted.extraction.key_aliases,
                               extracted.extraction.names_by_key, saveable)
        builtins = graph_builtin_points(graph, regions, presets or None)
        if not offload:  # each plan measured as optimize measures it, its layers apart
            placement = Placement(extracted.regions, extracted.differentiated, Step.of(0),
                                  scopes=extracted.scopes)
            measure = step_measure(fun, args, extracted, placement)
    else:
        graph = extract_graph(fun, *args)
        builtins = builtin_points(fun, *args)
    # Solve at each built-in's bytes too: the plan there is the fair comparison; and
    # where each lever starts to fit. Peak plans are refined against their own
    # working sets, as optimize refines them.
    also = [p.memory_bytes for p in builtins.values()] + lever_floors(graph, **options)
    swept = sweep(graph, count=points, also=also, regions=regions, measure=measure,
                  presets=list(presets.values()), layer_groups=saveable.framework is None,
                  **options)
    title = getattr(fun, "__qualname__", "") or graph.name
    return plot_frontier(swept, path, builtins=builtins, title=title, save_price=save_price)
