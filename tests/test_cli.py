"""Every ``optiremat`` client command on a real graph: extract, solve (in-process and on a
server), explain, frontier with a plot, and the help texts."""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from optiremat.cli import main
from optiremat.client.measure import residual_bytes
from optiremat.client.planfile import load_plan
from optiremat.client.target import load_target
from optiremat.solver.graph import CostGraph
from optiremat.solver.offload import OffloadOptions
from optiremat.solver.solve import max_useful_budget, min_feasible_budget, solve
from tests.service_harness import REPO, Server

MODEL = textwrap.dedent("""
    import jax
    import jax.numpy as jnp

    def loss(x, w1, w2):
        h = jnp.tanh(x @ w1)
        return jnp.sum(jnp.sin(h @ w2) * h)

    def example_args():
        return jnp.ones((8, 16)) * 0.1, jnp.ones((16, 16)) * 0.2, jnp.ones((16, 16)) * 0.3

    small_args = (jnp.ones((2, 4)), jnp.ones((4, 4)), jnp.ones((4, 4)))

    def scoped(ws, x):
        for i, w in enumerate(ws):
            with jax.named_scope(f"block_{i}"):
                x = jnp.tanh(x @ w)
        return jnp.sum(x)

    def scoped_args():
        return [jnp.ones((16, 16)) * 0.1] * 2, jnp.ones((8, 16))
""")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli")
    (path / "cli_model.py").write_text(MODEL)
    return path


@pytest.fixture(scope="module")
def graph_file(workdir: Path) -> Path:
    # A model without lax.scan, planned by residuals: one jax.checkpoint around it.
    out = workdir / "loss.graph.json"
    assert main(["extract", f"{workdir / 'cli_model.py'}:loss", "--out", str(out),
                 "--memory", "residuals"]) == 0
    return out


def budget_between(graph: CostGraph) -> int:
    return (min_feasible_budget(graph) + max_useful_budget(graph)) // 2


def test_extract_writes_the_graph_of_the_function_and_its_example_args(
        graph_file: Path, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph = CostGraph.model_validate_json(graph_file.read_bytes())
    fun, args = load_target(f"{workdir / 'cli_model.py'}:loss")
    from optiremat.client import extract_graph
    assert graph.content_hash == extract_graph(fun, *args).content_hash
    assert {"tanh", "sin", "dot_general"} <= set(graph.node_primitive)

    # another arguments attribute, a tuple this time; the default output name
    small = workdir / "small.json"
    assert main(["extract", f"{workdir / 'cli_model.py'}:loss", "--args", "small_args",
                 "-o", str(small), "--memory", "residuals"]) == 0
    assert CostGraph.model_validate_json(small.read_bytes()).value_shape[0] == [2, 4]
    assert f"wrote {small}" in capsys.readouterr().out


def test_a_step_graph_plans_the_peak_from_extract_to_explain(
        workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph_path, plan_path = workdir / "step.graph.json", workdir / "step.plan.json"
    assert main(["extract", f"{REPO / 'examples' / 'scan_jax.py'}:loss", "-o",
                 str(graph_path)]) == 0
    graph = CostGraph.model_validate_json(graph_path.read_bytes())
    assert graph.step is not None and len(graph.step.regions) == 1
    budget = budget_between(graph)
    assert main(["solve", str(graph_path), "--budget", str(budget), "-o", str(plan_path)]) == 0
    assert "a peak of" in capsys.readouterr().out
    assert main(["explain", str(plan_path)]) == 0
    text = capsys.readouterr().out
    assert "peak of the training step" in text and "per layer x 16 layers" in text


def test_extract_takes_the_blocks_by_name_scope(workdir: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = workdir / "scoped.graph.json"
    target = f"{workdir / 'cli_model.py'}:scoped"
    assert main(["extract", target, "--args", "scoped_args", "--regions", "block_",
                 "-o", str(out)]) == 0
    graph = CostGraph.model_validate_json(out.read_bytes())
    assert graph.step is not None
    assert [(r.kind, r.found) for r in graph.step.regions] == [("block", "scope")] * 2
    assert main(["extract", target, "--args", "scoped_args", "--regions", "decoder"]) == 1
    assert "Scopes seen: block_0, block_1" in one_line_error(capsys, "extract")


def test_offload_on_the_command_line_weighs_every_lever(
        workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph_path, plan_path = workdir / "levers.graph.json", workdir / "levers.plan.json"
    assert main(["extract", f"{REPO / 'examples' / 'scan_jax.py'}:loss", "-o",
                 str(graph_path), "--offload-inputs"]) == 0
    graph = CostGraph.model_validate_json(graph_path.read_bytes())
    assert "name" in graph.node_primitive  # each layer's input, named for the policy
    link = ["--offload", "--host-bandwidth", "1e12"]
    capsys.readouterr()
    assert main(["frontier", str(graph_path), "--points", "4", *link]) == 0
    text = capsys.readouterr().out
    assert "added ms" in text and "the step itself" in text and "offload, optimal" in text

    floor = min_feasible_budget(graph, offload=OffloadOptions(host_bandwidth=10**12))
    assert floor < min_feasible_budget(graph)
    assert main(["solve", str(graph_path), "--budget", str(floor), "-o", str(plan_path),
                 *link]) == 0
    assert "offloaded to host memory" in capsys.readouterr().out
    solution = load_plan(plan_path).solution
    assert solution.offload is not None and solution.offload.host_bytes > 0
    assert solution.options.offload == OffloadOptions(host_bandwidth=10**12)

    with pytest.raises(SystemExit):
        main(["solve", str(graph_path), "--budget", "1MiB", "--host-bandwidth", "fast"])
    assert "not a positive whole number: 'fast'" in capsys.readouterr().err


def test_solve_writes_a_plan_whose_policy_jax_honours(
        graph_file: Path, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph = CostGraph.model_validate_json(graph_file.read_bytes())
    budget = budget_between(graph)
    out = workdir / "plan.json"
    assert main(["solve", str(graph_file), "--budget", str(budget), "--out", str(out),
                 "--time-limit", "20"]) == 0
    assert "optimal" in capsys.readouterr().out

    plan = load_plan(out)
    assert plan.graph == graph
    assert plan.solution.fingerprint() == solve(graph, budget, time_limit_s=20).fingerprint()
    fun, args = load_target(f"{workdir / 'cli_model.py'}:loss")
    measured = residual_bytes(jax.checkpoint(fun, policy=plan.policy()), *args)
    assert measured == plan.solution.residual_bytes <= budget


def test_solve_on_a_server_gives_the_same_plan(
        graph_file: Path, workdir: Path, server: Server) -> None:
    graph = CostGraph.model_validate_json(graph_file.read_bytes())
    budget = budget_between(graph)
    here, there = workdir / "here.plan.json", workdir / "there.plan.json"
    assert main(["solve", str(graph_file), "--budget", str(budget), "-o", str(here),
                 "--time-limit", "20"]) == 0
    assert main(["solve", str(graph_file), "--budget", str(budget), "-o", str(there),
                 "--time-limit", "20", "--server", server.url]) == 0
    assert load_plan(here).solution.fingerprint() == load_plan(there).solution.fingerprint()


def test_save_price_plans_and_marks_the_cheapest_priced_plan(
        graph_file: Path, workdir: Path, server: Server,
        capsys: pytest.CaptureFixture[str]) -> None:
    from fractions import Fraction

    from optiremat.client.peak.priced import priced_budget, priced_cost
    from optiremat.solver.units import format_bytes

    graph_path = workdir / "priced.graph.json"
    assert main(["extract", f"{REPO / 'examples' / 'scan_jax.py'}:loss", "-o",
                 str(graph_path)]) == 0
    graph = CostGraph.model_validate_json(graph_path.read_bytes())
    budget = max_useful_budget(graph)
    unpriced = solve(graph, budget, time_limit_s=20)
    # A price at which the largest plan is not the cheapest: its saves above the smallest
    # plan's, at twice the FLOPs per byte they spare.
    least = solve(graph, min_feasible_budget(graph), time_limit_s=20)
    price = 2 * Fraction(least.recompute_flops - unpriced.recompute_flops,
                         unpriced.residual_bytes - least.residual_bytes)
    at = priced_budget(budget, lambda b: solve(graph, b, time_limit_s=20), price)
    assert at < budget
    capsys.readouterr()

    here, there = workdir / "priced.plan.json", workdir / "priced-there.plan.json"
    for out, where in ((here, []), (there, ["--server", server.url])):
        assert main(["solve", str(graph_path), "--budget", str(budget), "--save-price",
                     str(float(price)), "-o", str(out), "--time-limit", "20", *where]) == 0
        assert "Saves priced at" in capsys.readouterr().out
    plan = load_plan(here).solution
    assert plan.budget_bytes == budget and plan.peak_bytes is not None and plan.peak_bytes <= at
    assert priced_cost(plan, price) < priced_cost(unpriced, price)
    assert plan.fingerprint() == load_plan(there).solution.fingerprint()

    plot = workdir / "priced.png"
    assert main(["frontier", str(graph_path), "--points", "6", "--save-price",
                 str(float(price)), "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    named = [line for line in text.splitlines() if "costs least" in line]
    assert len(named) == 1 and png_size(plot)[0] > 400
    # A row of the sweep, and not its largest budget's: at this price that plan costs more.
    budget_named = named[0].split(" the plan at ")[1].split(" costs")[0]
    rows = [line.split()[:2] for line in text.splitlines() if " optimal" in line]
    assert budget_named.split() in rows
    assert budget_named != format_bytes(budget)

    # Where it cannot price: a graph of residuals, offload, a price that is no number.
    assert main(["solve", str(graph_file), "--budget", "1MiB", "--save-price", "10"]) == 1
    assert "extract the graph with --memory peak" in one_line_error(capsys, "solve")
    assert main(["solve", str(graph_path), "--budget", str(budget), "--save-price", "10",
                 "--offload"]) == 1
    assert "cannot be combined" in one_line_error(capsys, "solve")
    for bad in ("-1", "inf", "ten"):
        with pytest.raises(SystemExit):
            main(["solve", str(graph_path), "--budget", str(budget), "--save-price", bad])
        assert "--save-price takes the FLOPs one saved byte costs" in capsys.readouterr().err


def test_an_infeasible_budget_is_one_clear_line_and_exit_1(
        graph_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph = CostGraph.model_validate_json(graph_file.read_bytes())
    floor = min_feasible_budget(graph)
    assert main(["solve", str(graph_file), "--budget", str(floor - 1)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("optiremat solve: ") and f"is {floor} bytes" in err
    assert err.count("\n") == 1


def test_a_negative_budget_is_read_as_its_value_and_refused_in_two_lines(
        graph_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--budget", "-5GiB"], ["--budget=-5GiB"], ["--budget", "0"]):
        with pytest.raises(SystemExit) as info:
            main(["solve", str(graph_file), *argv])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("optiremat solve: error: argument --budget: a budget must be "
                              "positive, got ") and err.count("\n") == 2
    with pytest.raises(SystemExit):
        main(["solve", str(graph_file), "--budget", "1MiB", "--host-budget", "-1GiB"])
    assert "argument --host-budget: a host budget cannot be negative" in capsys.readouterr().err


def one_line_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    captured = capsys.readouterr()
    assert captured.err.startswith(f"optiremat {command}: ") and captured.err.count("\n") == 1
    assert "pydantic.dev" not in captured.err and "Traceback" not in captured.err
    return captured.err


def test_invalid_options_and_files_are_one_line_naming_the_flag_or_field(
        graph_file: Path, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    solve_it = ["solve", str(graph_file), "--budget", "1MiB"]
    assert main([*solve_it, "--time-limit", "-1"]) == 1
    assert "--time-limit: Input should be greater than 0 (got -1.0)" in one_line_error(
        capsys, "solve")
    assert main([*solve_it, "--gap", "7"]) == 1
    assert "--gap: Input should be less than or equal to 1" in one_line_error(capsys, "solve")

    broken = workdir / "broken.graph.json"
    broken.write_text('{"schema_version": 2, "name": "x"}')
    assert main(["solve", str(broken), "--budget", "1MiB"]) == 1
    assert f"{broken} is not a valid cost graph: " in one_line_error(capsys, "solve")
    assert main(["explain", str(graph_file)]) == 1
    assert "is a cost graph, not a plan" in one_line_error(capsys, "explain")

    plan = workdir / "a.plan.json"
    assert main([*solve_it[:3], str(max_useful_budget(CostGraph.model_validate_json(
        graph_file.read_bytes()))), "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["frontier", str(plan)]) == 1
    assert "is a plan, not a cost graph" in one_line_error(capsys, "frontier")


def test_invalid_service_settings_are_one_line_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OPTIREMAT_PORT", "eighty")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("optiremat serve: invalid setting OPTIREMAT_PORT (--port): ")
    assert "(got 'eighty')" in err and err.count("\n") == 1


def test_a_budget_past_what_the_solver_holds_is_one_clear_line_and_exit_1(
        graph_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["solve", str(graph_file), "--budget", "100000000000000000000000000000"]) == 1
    err = capsys.readouterr().err
    assert err == ("optiremat solve: budget_bytes is 10000000...(30 digits); it must be below "
                   "2**62 bytes (4 EiB), what the solver's 64-bit integers hold\n")


def test_explain_lists_saved_values_with_sources_bytes_and_flops(
        graph_file: Path, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph = CostGraph.model_validate_json(graph_file.read_bytes())
    out = workdir / "explained.plan.json"
    main(["solve", str(graph_file), "--budget", str(max_useful_budget(graph)), "-o", str(out)])
    capsys.readouterr()
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.lstrip().startswith("bytes"))
    assert header.split() == ["bytes", "share", "FLOPs", "op", "value", "source"]
    plan = load_plan(out)
    rows = text.split(header)[1].strip().splitlines()
    assert len(rows) == len(plan.evaluation().residuals)
    assert any("cli_model.py:" in row and "tanh" in row for row in rows)
    assert any("argument" in row for row in rows)

    assert main(["explain", str(out), "--top", "2"]) == 0
    assert "smaller values" in capsys.readouterr().out


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_frontier_prints_the_sweep_and_plots_it(
        graph_file: Path, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = workdir / "frontier.png"
    assert main(["frontier", str(graph_file), "--plot", str(plot), "--points", "4"]) == 0
    text = capsys.readouterr().out
    assert "everything_saveable" in text and "nothing_saveable" in text
    assert sum(" optimal" in line for line in text.splitlines()) >= 4
    width, height = png_size(plot)
    assert width > 400 and height > 300


def test_frontier_says_why_it_has_more_rows_than_points(
        workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph_path = workdir / "rows.graph.json"
    assert main(["extract", f"{REPO / 'examples' / 'scan_jax.py'}:loss", "-o",
                 str(graph_path)]) == 0
    capsys.readouterr()
    assert main(["frontier", str(graph_path), "--points", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if " optimal" in line]
    extra = len(rows) - 4
    assert extra > 0 and lines[0] == (
        f"4 evenly spaced budgets and {extra} more at the budgets marked 'at': a built-in "
        "policy's bytes, or where a lever starts to fit")
    assert sum("(at " in row for row in rows) >= extra
    assert any("(at nothing_saveable" in row for row in rows)


def test_frontier_of_a_function_marks_every_builtin(
        workdir: Path, server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    plot = workdir / "frontier.svg"
    assert main(["frontier", f"{workdir / 'cli_model.py'}:loss", "--plot", str(plot),
                 "--points", "3", "--server", server.url]) == 0
    text = capsys.readouterr().out
    assert "dots_saveable" in text and "dots_with_no_batch_dims_saveable" in text
    svg = plot.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg


def test_a_missing_example_args_is_explained(
        workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["extract", f"{workdir / 'cli_model.py'}:loss", "--args", "nope"]) == 1
    assert "defines no 'nope'" in capsys.readouterr().err


def test_help_reads_well_without_importing_jax() -> None:
    script = ("import sys; from optiremat.cli import main\n"
              "try: main(sys.argv[1:])\n"
              "except SystemExit: pass\n"
              "assert 'jax' not in sys.modules, 'the CLI imported JAX for --help'\n")
    top = subprocess.run([sys.executable, "-c", script, "--help"], cwd=REPO, text=True,
                         capture_output=True, check=True).stdout
    for command in ("serve", "extract", "solve", "frontier", "explain", "a typical session"):
        assert command in top
    for command in ("extract", "solve", "frontier", "explain"):
        text = subprocess.run([sys.executable, "-c", script, command, "--help"], cwd=REPO,
                              text=True, capture_output=True, check=True).stdout
        assert f"usage: optiremat {command}" in text and "example:" in text
