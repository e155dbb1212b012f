"""The client's subcommands of ``optiremat``: extract, solve, frontier, explain, export,
plan-maxtext.

(Over 400 lines on purpose: six subcommands and the options they share, each read
where its argparse declaration is.)

Nothing heavy is imported at module level (``optiremat.cli`` imports this for
``--help``); each command imports JAX, the solver or matplotlib when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optiremat.solver.units import format_bytes
from optiremat.solver.wire import DEFAULT_FRONTIER_POINTS

if TYPE_CHECKING:
    from optiremat.solver.graph import CostGraph
    from optiremat.solver.solution import Solution

EPILOG = """\
a typical session:
  optiremat extract model.py:loss            # writes loss.graph.json
  optiremat solve loss.graph.json --budget 8GiB --out plan.json
  optiremat explain plan.json                # what is saved, where, and what it costs
  optiremat frontier loss.graph.json --plot frontier.png

solve and frontier run in-process, or on a server with --server URL
(or OPTIREMAT_SERVER; the API key from OPTIREMAT_API_KEY). Run
'optiremat COMMAND --help' for each command's options."""

Run = Callable[[argparse.Namespace], int]


def add_commands(parser: argparse.ArgumentParser,
                 commands: argparse._SubParsersAction) -> None:
    """Register the client's subcommands on ``optiremat``'s parser.

    (Long on purpose: argparse declarations, in the order ``--help`` lists them.)"""
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    raw = argparse.RawDescriptionHelpFormatter

    extract = commands.add_parser(
        "extract", help="trace a JAX function and write its cost graph", formatter_class=raw,
        description="Trace MODULE:FUNCTION and write its cost graph as JSON (the body the "
                    "service's /v1/solve takes). By default the graph of the training step "
                    "jax.jit(jax.grad(FUNCTION)) with a remat region in every lax.scan body, "
                    "which plans peak budgets (one compile measures a layer's working set); "
                    "with --memory residuals, the graph of one jax.checkpoint around FUNCTION."
                    "\n\n"
                    "MODULE is a dotted module importable from the current directory, or a "
                    "path to a .py file. It defines FUNCTION and the arguments to trace it "
                    "with: 'example_args', a tuple or a function with no parameters that "
                    "returns one (another name with --args).",
        epilog="example:\n  optiremat extract examples/scan_jax.py:loss --out loss.graph.json")
    extract.add_argument("target", metavar="MODULE:FUNCTION")
    extract.add_argument("--args", default="example_args", metavar="NAME",
                         help="attribute of MODULE holding the example arguments "
                              "(default: example_args)")
    extract.add_argument("-o", "--out", metavar="GRAPH.json",
                         help="where to write the graph (default: FUNCTION.graph.json)")
    extract.add_argument("--memory", choices=("peak", "residuals"), default="peak",
                         help="what budgets will mean: the step's peak (default) or the "
                              "residual bytes of one checkpoint")
    extract.add_argument("--argnums", type=int, nargs="+", default=[0], metavar="N",
                         help="the arguments the step differentiates (default: 0)")
    extract.add_argument("--offload-inputs", action="store_true",
                         help="name each layer's input in the step's graph, so that plans "
                              "solved with --offload may keep the stacked inputs in host "
                              "memory")
    extract.add_argument("--regions", nargs="+", metavar="SCOPE",
                         help="the blocks to checkpoint: the equations under these name "
                              "scopes (a Flax module path, a jax.named_scope), instead of "
                              "the repeated blocks found in straight-line code")
    extract.set_defaults(run=_reporting_errors(_extract))

    solve = commands.add_parser(
        "solve", help="solve a cost graph for a memory budget", formatter_class=raw,
        description="Find the plan with the fewest recompute FLOPs that fits BUDGET (the "
                    "peak of the training step for a step's graph, else residual bytes), and "
                    "write it (graph and solution together) as PLAN.json.",
        epilog="example:\n  optiremat solve loss.graph.json --budget 8GiB --out plan.json")
    solve.add_argument("graph", metavar="GRAPH.json")
    solve.add_argument("--budget", required=True, type=_budget, metavar="SIZE",
                       help="bytes, or with a unit (512MiB, 8GiB, 1.5GB)")
    solve.add_argument("-o", "--out", metavar="PLAN.json",
                       help="where to write the plan (default: GRAPH with .plan.json)")
    _solver_options(solve)
    _price_option(solve, "answer the plan of least recompute FLOPs + PRICE x saved bytes "
                         "within the budget (a graph of the training step, extract --memory "
                         "peak, the default; no offload)")
    solve.set_defaults(run=_reporting_errors(_solve))

    frontier = commands.add_parser(
        "frontier", help="sweep budgets: recompute FLOPs against residual memory",
        formatter_class=raw,
        description="Solve at evenly spaced budgets from the smallest feasible to the "
                    "largest useful one, print the table and optionally plot it. Given "
                    "MODULE:FUNCTION instead of a graph, JAX's built-in policies are "
                    "measured and marked on the plot; a graph alone shows the two it "
                    "determines (everything_saveable, nothing_saveable).",
        epilog="example:\n  optiremat frontier loss.graph.json --plot frontier.png --points 16")
    frontier.add_argument("source", metavar="GRAPH.json|MODULE:FUNCTION")
    frontier.add_argument("--plot", metavar="OUT.png|OUT.svg", help="write the plot here")
    frontier.add_argument("--points", type=int, default=DEFAULT_FRONTIER_POINTS, metavar="N",
                          help="number of budgets in the sweep (default: 12)")
    frontier.add_argument("--args", default="example_args", metavar="NAME",
                          help="with MODULE:FUNCTION: the example-arguments attribute")
    _solver_options(frontier)
    _price_option(frontier, "name the point of least recompute FLOPs + PRICE x saved bytes, "
                            "and star it on the plot")
    frontier.set_defaults(run=_reporting_errors(_frontier))

    explain = commands.add_parser(
        "explain", help="show what a plan saves, where, and what it costs",
        formatter_class=raw,
        description="Print a plan's totals and a table of the values it keeps for the "
                    "backward pass: bytes, the FLOPs of the equation that made each (what "
                    "saving it spares recomputing) and its source location.",
        epilog="example:\n  optiremat explain plan.json --top 20")
    explain.add_argument("plan", metavar="PLAN.json")
    explain.add_argument("--top", type=int, metavar="N",
                         help="show only the N largest saved values")
    explain.set_defaults(run=_reporting_errors(_explain))

    export = commands.add_parser(
        "export", help="write a plan as a framework's config overrides", formatter_class=raw,
        description="Print the config overrides that make FRAMEWORK build the plan's policy "
                    "from its own config: for maxtext, 'remat_policy: custom' and each named "
                    "tensor's remat, device or offload; for levanter, the fields of "
                    "model.gradient_checkpointing. The plan is one optimize() made with "
                    "saveable='maxtext' (or 'levanter'), written with "
                    "PlanFile.of(plan).write(path); a plan the framework cannot express is "
                    "refused with the reason.",
        epilog="example:\n  optiremat export maxtext plan.json >> my_model.yml\n"
               "  python3 -m maxtext.trainers.pre_train.train base.yml "
               "$(optiremat export maxtext plan.json "
               "--format args)")
    export.add_argument("framework", choices=["maxtext", "levanter"], metavar="FRAMEWORK",
                        help="maxtext (its top-level overrides) or levanter "
                             "(model.gradient_checkpointing: Haliax's ScanCheckpointPolicy)")
    export.add_argument("plan", metavar="PLAN.json")
    _format_option(export)
    export.set_defaults(run=_reporting_errors(_export))

    plan_maxtext = commands.add_parser(
        "plan-maxtext", help="plan a MaxText model from its config and print the overrides",
        formatter_class=raw,
        description="Build the model MaxText's trainer builds from CONFIG.yml and the "
                    "KEY=VALUE overrides (as its launcher takes them; MaxText 0.2.5 "
                    "installed beside optiremat), plan its training step at --budget with "
                    "only the tensors MaxText's 'remat_policy: custom' can set, and print the "
                    "config overrides that make MaxText build that plan.",
        epilog="example:\n  optiremat plan-maxtext base.yml model_name=llama2-7b "
               "per_device_batch_size=4 --budget 60GiB >> my_run.yml")
    plan_maxtext.add_argument("config", metavar="CONFIG.yml")
    plan_maxtext.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    plan_maxtext.add_argument("--budget", required=True, type=_budget, metavar="SIZE",
                              help="the peak of the training step: bytes, or with a unit")
    _format_option(plan_maxtext)
    plan_maxtext.add_argument("-o", "--out", metavar="PLAN.json",
                              help="also write the plan (for optiremat explain)")
    plan_maxtext.set_defaults(run=_reporting_errors(_plan_maxtext))


def _format_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=["yaml", "args", "json"], default="yaml",
                        help="a YAML block (default), key=value arguments for a launcher, "
                             "or JSON")


def _solver_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("solver")
    group.add_argument("--time-limit", type=float, metavar="SECONDS",
                       help="wall-clock limit per solve (default: 60)")
    group.add_argument("--gap", type=float, metavar="FRACTION",
                       help="stop within this relative gap of optimal (default: 0)")
    group.add_argument("--untied", action="store_true",
                       help="decide equations one by one (names form only; see docs/api.md)")
    group.add_argument("--interconnect-bandwidth", type=_rate, metavar="BYTES/S",
                       help="on a graph of a step on a device mesh, what one device moves "
                            "in a collective: it prices the collectives a recomputed "
                            "equation repeats (default: 1e11)")
    offload = parser.add_argument_group(
        "offload", "keep residuals in host memory; on a step's graph the plan (and each "
        "frontier point) is the best of recomputation per layer, nested groups and offload "
        "in estimated seconds")
    offload.add_argument("--offload", action="store_true",
                         help="offload with the defaults below unless set")
    offload.add_argument("--host-budget", type=_host_budget, metavar="SIZE",
                         help="host memory for offloaded residuals (default: 64GiB)")
    offload.add_argument("--host-bandwidth", type=_rate, metavar="BYTES/S",
                         help="the link to host memory (default: 25e9)")
    offload.add_argument("--flop-rate", type=_rate, metavar="FLOP/S",
                         help="the device's compute rate (default: 4e14)")
    group.add_argument("--server", default=os.environ.get("OPTIREMAT_SERVER"), metavar="URL",
                       help="solve on this optiremat server (default: OPTIREMAT_SERVER, "
                            "else in-process)")


def _price_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--save-price", type=_price, metavar="PRICE",
                        help="FLOPs one saved byte costs (optiremat.measured_save_price() "
                             f"reads this device's): {what}")


# Options whose values may start with '-': argparse would read '--budget -5GiB' as two
# options (cli.main joins them) and the error must come from the value's check.
SIZE_OPTIONS = ("--budget", "--host-budget")

# The solver option each flag sets, for errors that name a field.
FLAG_OF = {"time_limit_s": "--time-limit", "relative_gap": "--gap",
           "host_budget_bytes": "--host-budget", "host_bandwidth": "--host-bandwidth",
           "device_flop_rate": "--flop-rate",
           "interconnect_bandwidth": "--interconnect-bandwidth"}


def _size(text: str, what: str, positive: bool) -> int:
    from optiremat.solver.units import parse_bytes

    if text.strip().startswith("-"):
        rule = "must be positive" if positive else "cannot be negative"
        raise argparse.ArgumentTypeError(f"{what} {rule}, got {text!r}")
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if positive and value == 0:
        raise argparse.ArgumentTypeError(f"{what} must be positive, got {text!r}")
    return value


def _budget(text: str) -> int:
    """A memory budget: positive bytes, plainly or with a unit."""
    return _size(text, "a budget", positive=True)


def _host_budget(text: str) -> int:
    """Host memory for offload: bytes, 0 offloads nothing."""
    return _size(text, "a host budget", positive=False)


def _rate(text: str) -> int:
    """A positive whole rate, written plainly or as 25e9."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value.is_integer() or value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive whole number: {text!r}")
    return int(value)


def _price(text: str) -> Fraction:
    """A save price: FLOPs per saved byte, a finite number >= 0."""
    from optiremat.client.peak.priced import price_problem

    try:
        value: object = float(text)
    except ValueError:
        value = text
    if (problem := price_problem(value, "--save-price")) is not None:
        raise argparse.ArgumentTypeError(problem)
    return Fraction(text.strip())


def _priced_graph(graph: CostGraph, options: dict[str, Any]) -> None:
    """Refuse --save-price where it cannot price (``optimize``'s ``save_price=`` rules),
    given the solver options the flags set (``_options``)."""
    if graph.step is None:
        raise ValueError("--save-price prices the saves of the training step: extract the "
                         "graph with --memory peak (the default)")
    if options.get("offload") is not None:
        raise ValueError("--save-price and offload cannot be combined: an offload plan is "
                         "priced in estimated seconds already")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"tie": not args.untied}
    if args.time_limit is not None:
        options["time_limit_s"] = args.time_limit
    if args.gap is not None:
        options["relative_gap"] = args.gap
    if args.interconnect_bandwidth is not None:
        options["interconnect_bandwidth"] = args.interconnect_bandwidth
    offload: dict[str, int] = {}
    if args.host_budget is not None:
        offload["host_budget_bytes"] = args.host_budget
    if args.host_bandwidth is not None:
        offload["host_bandwidth"] = args.host_bandwidth
    if args.flop_rate is not None:
        offload["device_flop_rate"] = args.flop_rate
    from pydantic import ValidationError

    from optiremat.solver.offload import OffloadOptions
    from optiremat.solver.solution import SolveOptions
    from optiremat.solver.validation_message import validation_message

    try:
        if args.offload or offload:
            options["offload"] = OffloadOptions(**offload)
        SolveOptions(**options)  # refused here, naming the flag, not in the solver
    except ValidationError as exc:
        raise ValueError(validation_message(exc, FLAG_OF)) from None
    return options


def _remote(args: argparse.Namespace):
    from optiremat.client.remote import RematClient

    return RematClient(args.server, api_key=os.environ.get("OPTIREMAT_API_KEY"))


def _reporting_errors(run: Run) -> Run:
    """Expected failures print one line and exit 1, not a traceback."""

    def wrapped(args: argparse.Namespace) -> int:
        from pydantic import ValidationError

        from optiremat.solver.errors import OptirematError
        from optiremat.solver.validation_message import validation_message

        try:
            return run(args)
        except ValidationError as exc:
            print(f"optiremat {args.command}: {exc.title}: {validation_message(exc)}",
                  file=sys.stderr)
            return 1
        except (OptirematError, OSError, ValueError) as exc:
            print(f"optiremat {args.command}: {exc}", file=sys.stderr)
            return 1

    return wrapped


def _read_graph(path: str):
    from pydantic import ValidationError

    from optiremat.solver.graph import CostGraph
    from optiremat.solver.validation_message import validation_message

    data = Path(path).read_bytes()
    try:
        return CostGraph.model_validate_json(data)
    except ValidationError as exc:
        if "format" in _top_level_keys(data):
            raise ValueError(f"{path} is a plan, not a cost graph: 'optiremat explain "
                             f"{path}' reads it") from None
        raise ValueError(f"{path} is not a valid cost graph: {validation_message(exc)}"
                         ) from None


def _top_level_keys(data: bytes) -> set[str]:
    """The keys of a JSON object (none when it is not one): what kind of file it is."""
    import json

    try:
        top = json.loads(data)
    except ValueError:
        return set()
    return set(top) if isinstance(top, dict) else set()


# ---- commands -----------------------------------------------------------------


def _extract(args: argparse.Namespace) -> int:
    from optiremat.client.extract import extract_graph
    from optiremat.client.peak.step_graph import extract_step
    from optiremat.client.target import load_target

    fun, fun_args = load_target(args.target, args.args)
    if args.memory == "peak":
        graph = extract_step(fun, *fun_args, argnums=tuple(args.argnums),
                             name_inputs=args.offload_inputs, regions=args.regions or ())
    elif args.regions:
        raise ValueError("--regions names the blocks of a step's graph: leave out "
                         "--memory residuals")
    elif args.offload_inputs:
        raise ValueError("--offload-inputs names the layer inputs of a step's graph: "
                         "leave out --memory residuals")
    else:
        graph = extract_graph(fun, *fun_args)
    out = Path(args.out or f"{args.target.rpartition(':')[2]}.graph.json")
    out.write_text(graph.model_dump_json() + "\n")
    print(f"wrote {out}: {graph.num_nodes} nodes, {graph.num_values} values, "
          f"graph {graph.content_hash[:12]}")
    return 0


def _solve(args: argparse.Namespace) -> int:
    from optiremat.client.peak.priced import priced_budget, priced_note
    from optiremat.client.planfile import PlanFile
    from optiremat.solver.solve import solve

    graph = _read_graph(args.graph)
    budget, price, options = args.budget, args.save_price, _options(args)
    if price is not None:
        _priced_graph(graph, options)

    def planned(solve_at: Callable[[int], Solution]) -> Solution:
        if price is None:
            return solve_at(budget)
        # As optimize(..., save_price=) does, unmeasured: the solve at the budget of the
        # cheapest priced plan, answering the budget asked.
        at = priced_budget(budget, solve_at, price)
        solution = solve_at(at).model_copy(update={"budget_bytes": budget})
        print(priced_note(price, budget, at, solution))
        return solution

    if args.server:
        with _remote(args) as remote:
            solution = planned(lambda b: remote.solve(graph, b, **options))
    else:
        solution = planned(lambda b: solve(graph, b, **options))
    out = Path(args.out or Path(args.graph).name.removesuffix(".json").removesuffix(".graph")
               + ".plan.json")
    PlanFile(graph=graph, solution=solution).write(out)
    held = (f"a peak of {format_bytes(solution.peak_bytes)}" if solution.peak_bytes is not None
            else f"{format_bytes(solution.residual_bytes)} of residuals")
    levers = ""
    if solution.groups is not None:
        levers += f", layers in groups {solution.groups}"
    if solution.offload is not None:
        levers += (f", {format_bytes(solution.offload.host_bytes)} offloaded to host memory, "
                   f"{solution.offload.estimated_seconds * 1e3:.4f} ms added (estimated)")
    print(f"{solution.status}: {held} within {format_bytes(budget)}, "
          f"{solution.recompute_flops:,} recompute FLOPs (bound {solution.lower_bound_flops:,})"
          f"{levers}; wrote {out}")
    return 0


def _frontier(args: argparse.Namespace) -> int:
    """``optiremat frontier``. (Long on purpose: the command's steps in the order it
    runs them: the graph, the built-ins, the sweep, the table and the plot.)"""
    from optiremat.client.frontier import (
        builtin_points,
        graph_builtin_points,
        lever_floors,
        sweep,
    )

    if Path(args.source).is_file() or args.source.endswith(".json"):
        graph = _read_graph(args.source)
        builtins = graph_builtin_points(graph)
        title = graph.name
    else:
        from optiremat.client.extract import extract_graph
        from optiremat.client.target import load_target

        fun, fun_args = load_target(args.source, args.args)
        graph = extract_graph(fun, *fun_args)
        builtins = builtin_points(fun, *fun_args)
        title = args.source
    # Beyond the evenly spaced budgets the local sweep also solves at each built-in's
    # bytes and where each lever starts to fit: those rows say so.
    why: dict[int, list[str]] = {}
    if args.server:
        with _remote(args) as remote:
            result = remote.frontier(graph, count=args.points, **_options(args))
    else:
        for name, point in builtins.items():
            why.setdefault(point.memory_bytes, []).append(name)
        for floor in lever_floors(graph, **_options(args)):
            why.setdefault(floor, []).append("a lever's floor")
        result = sweep(graph, count=args.points, also=list(why), **_options(args))
    extra = len(result.points) - args.points
    if extra > 0:
        print(f"{args.points} evenly spaced budgets and {extra} more at the budgets marked "
              "'at': a built-in policy's bytes, or where a lever starts to fit")

    peak = any(p.peak_bytes is not None for p in result.points)
    timed = result.step_seconds is not None
    print(f"{'budget':>12} {'peak' if peak else 'residuals':>12} {'recompute FLOPs':>16}  "
          + (f"{'added ms':>9} {'host':>10}  lever, " if timed else "") + "status")
    for p in result.points:
        held = "-" if p.memory_bytes is None else format_bytes(p.memory_bytes)
        flops = "-" if p.recompute_flops is None else f"{p.recompute_flops:,}"
        mark = "" if p.pareto else "  (dominated)" if p.memory_bytes is not None else ""
        levers = ""
        if timed and p.estimated_seconds is not None:
            lever = p.lever + (f" {p.groups}" if p.lever == "nested groups" else "")
            levers = (f"{p.estimated_seconds * 1e3:9.4f} {format_bytes(p.host_bytes or 0):>10}"
                      f"  {lever}, ")
        elif timed:
            levers = f"{'-':>9} {'-':>10}  "
        at = f"  (at {', '.join(why[p.budget_bytes])})" if p.budget_bytes in why else ""
        print(f"{format_bytes(p.budget_bytes):>12} {held:>12} {flops:>16}  {levers}"
              f"{p.status}{mark}{at}")
    if timed:
        print(f"the step itself: {(result.step_seconds or 0) * 1e3:.4f} ms (estimated)")
    print("JAX built-in policies:")
    for name, point in builtins.items():
        print(f"{name:>34} {format_bytes(point.memory_bytes):>12} "
              f"{point.recompute_flops:>16,}")
    if args.save_price is not None:
        from optiremat.client.peak.priced import cheapest_priced, priced_cost

        cheapest = cheapest_priced(result.points, args.save_price)
        if cheapest is not None:
            print(f"saves priced at {float(args.save_price):.4g} FLOPs a byte: the plan at "
                  f"{format_bytes(cheapest.budget_bytes)} costs least (recompute FLOPs + "
                  f"price x saved bytes: {float(priced_cost(cheapest, args.save_price)):.4g})")
    if args.plot:
        from optiremat.client.plot import plot_frontier

        written = plot_frontier(result, args.plot, builtins=builtins, title=title,
                                save_price=args.save_price)
        print(f"wrote {written}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from optiremat.client.frameworks import exported
    from optiremat.client.planfile import load_plan

    decided = load_plan(args.plan).names_decided(args.framework)
    _print_config(exported(args.framework, decided), args.format)
    return 0


def _plan_maxtext(args: argparse.Namespace) -> int:
    from optiremat.client.maxtext import config_args, plan_maxtext
    from optiremat.client.planfile import PlanFile

    plan, overrides = plan_maxtext(config_args(args.config, args.overrides), args.budget,
                                   progress=lambda line: print(f"# optiremat: {line}",
                                                               file=sys.stderr, flush=True))
    if args.out:
        PlanFile.of(plan).write(args.out)
    assert plan.peak_bytes is not None
    print(f"# optiremat: peak {format_bytes(plan.peak_bytes)} of a "
          f"{format_bytes(plan.budget_bytes)} budget, {plan.recompute_flops:,} recompute FLOPs",
          file=sys.stderr)
    _print_config(overrides, args.format)
    return 0


def _print_config(overrides: dict[str, Any], form: str) -> None:
    import json

    from optiremat.client.frameworks import config_text

    if form == "json":
        print(json.dumps(overrides, indent=2))
    else:
        print(config_text(overrides, form), end="" if form == "yaml" else "\n")


def _explain(args: argparse.Namespace) -> int:
    from optiremat.client.explain import explain_plan
    from optiremat.client.frameworks import names_of_keys
    from optiremat.client.planfile import load_plan

    plan = load_plan(args.plan)
    names = names_of_keys(plan.graph, plan.key_aliases, plan.checkpoint_names)
    print(explain_plan(plan.graph, plan.solution, top=args.top, names=names))
    return 0 if plan.solution.planned else 1
