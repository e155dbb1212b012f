"""The training step a plan is for, and the one definition of its peak.

A budget is the peak bytes of ``jax.jit(jax.grad(fun, argnums),
donate_argnums=...)`` on one device, as XLA's ``memory_analysis()`` reports
it: argument + output + temp - alias bytes (``measured_peak``). For a ``fun``
that is not a scalar, the step is its VJP with a ones cotangent (the gradient
of the sum of its outputs). ``held_memory`` is the part no plan changes:
the arguments, the gradients, less the outputs that reuse donated arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optiremat.client.cost_model import aval_bytes
from optiremat.client.hlo_collectives import collectives
from optiremat.client.memory_cache import entry_name, keep_figures, kept_figures, program_hash
from optiremat.client.schedule import memory_compile_options
from optiremat.solver.errors import OptirematError


class StepError(OptirematError, ValueError):
    """A function or arguments the training step cannot be built from."""


# XLA assigns a program's buffers before it generates code, so its memory analysis does not
# depend on how hard the code generator optimises. On CPU, compiling without that
# optimisation takes half the time, with every figure the same to the byte (measured on the
# scan corpus and the 8B step with its head, jax 0.10 and 0.12; tests/test_peak_plans.py
# checks it). Elsewhere the defaults stand: on a TPU v5e (jax 0.10.2, the bf16 Llama stack
# of bench/layer_groups.py --accelerator under five policies) the backend optimisation level
# 0 and LLVM's cheap passes kept every figure but saved no time (4.3-5.0 s and 3.5-4.8 s a
# compile against 3.2-5.4), and optimization_level O0 or exec_time_optimization_effort -1
# compiled 3-4x faster but moved the temporaries by 158-269 MiB, differently per policy.
MEMORY_ONLY_OPTIONS: dict[str, str | bool] = {"xla_backend_optimization_level": "0"}


def compiled_for_memory(lowered: jax.stages.Lowered,
                        keep_barriers: bool = False) -> jax.stages.Compiled:
    """``lowered`` compiled to read its memory analysis: an executable never to be run.
    With ``keep_barriers`` (a plan with checkpoints in straight-line code), under the
    schedule that keeps them apart from the forward pass (``client.schedule``)."""
    return lowered.compile(_memory_options(keep_barriers))


def _memory_options(keep_barriers: bool) -> dict[str, str | bool] | None:
    if jax.default_backend() == "cpu":
        extra = memory_compile_options() if keep_barriers else {}
        return {**MEMORY_ONLY_OPTIONS, **extra}
    return None


def memory_analysis(compiled: jax.stages.Compiled) -> Any:
    """XLA's memory analysis of ``compiled``; a platform without one is an error."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise StepError(f"the {jax.default_backend()} backend reports no memory analysis, so "
                        "peaks cannot be calibrated or measured here")
    return analysis


@dataclass(frozen=True)
class StepMemoryAnalysis:
    """XLA's figures for a compiled step, in bytes (one device's, on a mesh)."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    # On a mesh, what one device moves in the program's collectives (``hlo_collectives``):
    # read from the same compile, so that a plan's step is compiled once for both.
    collective_bytes: int = 0

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> StepMemoryAnalysis:
        m = memory_analysis(compiled)
        devices = max((len(s.device_set) for s in jax.tree.leaves(compiled.input_shardings)),
                      default=1)
        moved = collectives(compiled, devices).bytes if devices > 1 else 0
        return cls(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes,
                   m.alias_size_in_bytes, moved)

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


def measured_peak(compiled: jax.stages.Compiled) -> int:
    """Peak bytes of a compiled step: argument + output + temp - alias."""
    return StepMemoryAnalysis.of(compiled).peak_bytes


def host_buffers_apart() -> bool:
    """Whether the default backend's memory analysis keeps ``pinned_host`` buffers apart
    from device ones, so that a plan offloading residuals has a device peak to measure:
    not CPU's, which counts them as device buffers (a GPU's and a TPU's do)."""
    return jax.default_backend() != "cpu"


# Memory of programs compiled in this process, by program text: planning compiles the step
# under the plan it answers, and ``verify(peak=True)``, a second ``optimize`` of the same
# function or a frontier's neighbouring budgets compile the same program again. Processes
# to come read them from disk where a cache folder is set (``client.memory_cache``).
_PEAKS: OrderedDict[tuple[str, str, bool], StepMemoryAnalysis] = OrderedDict()
MAX_REMEMBERED_PEAKS = 1024


def lowered_memory(lowered: jax.stages.Lowered,
                   keep_barriers: bool = False) -> StepMemoryAnalysis:
    """XLA's memory analysis of ``lowered`` compiled (``compiled_for_memory``); a program
    this process compiled already (the same StableHLO text on the same platform), or one
    kept in the cache folder (``client.memory_cache``), is not compiled again, and one
    compiling ahead (``compile_ahead``) is waited for."""
    key = _program_key(lowered, keep_barriers)
    if key in _PEAKS:
        _PEAKS.move_to_end(key)
        return _PEAKS[key]
    ahead = _AHEAD.pop(key, None)
    if ahead is not None:
        analysis = ahead.result()
    else:
        entry = _entry(key, keep_barriers)
        analysis = _kept(entry) or _compiled(lowered, keep_barriers, entry)
    _remember(key, analysis)
    return analysis


def _remember(key: tuple[str, str, bool], analysis: StepMemoryAnalysis) -> None:
    _PEAKS[key] = analysis
    if len(_PEAKS) > MAX_REMEMBERED_PEAKS:
        _PEAKS.popitem(last=False)


def _entry(key: tuple[str, str, bool], keep_barriers: bool) -> str:
    """The program's cache entry (``client.memory_cache``): its text, its options."""
    return entry_name(key[1], _memory_options(keep_barriers))


def _kept(entry: str) -> StepMemoryAnalysis | None:
    """The analysis a process kept on disk under ``entry``, if any."""
    fields = kept_figures(entry)
    try:
        return StepMemoryAnalysis(**fields) if fields is not None else None
    except TypeError:  # an entry of other fields: a miss
        return None


def _compiled(lowered: jax.stages.Lowered, keep_barriers: bool,
              entry: str) -> StepMemoryAnalysis:
    """``lowered`` compiled for its memory analysis, kept under ``entry`` where a cache
    folder is set."""
    analysis = StepMemoryAnalysis.of(compiled_for_memory(lowered, keep_barriers))
    keep_figures(entry, dataclasses.asdict(analysis))
    return analysis


# Programs compiling on worker threads, by the key of ``_PEAKS``. XLA compiles without
# Python's lock, so a program that will be measured next compiles while this thread traces
# and lowers the one after it (on two cores, two step compiles together took 0.71x the
# time of one after the other). Only this thread reads and writes these dictionaries.
_AHEAD: dict[tuple[str, str, bool], Future[StepMemoryAnalysis]] = {}
COMPILE_WORKERS = max(1, min(4, os.cpu_count() or 1))


@functools.cache
def _workers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="optiremat-compile")


def compile_ahead(lowered: jax.stages.Lowered, keep_barriers: bool = False) -> None:
    """Start compiling ``lowered`` for its memory analysis on a worker thread: the
    ``lowered_memory`` of the same program then waits for it instead of compiling."""
    key = _program_key(lowered, keep_barriers)
    if key in _PEAKS or key in _AHEAD:
        return
    entry = _entry(key, keep_barriers)  # its schedule probe compiles on this thread
    kept = _kept(entry)
    if kept is not None:
        _remember(key, kept)
        return
    _AHEAD[key] = _workers().submit(_compiled, lowered, keep_barriers, entry)


def _program_key(lowered: jax.stages.Lowered, keep_barriers: bool) -> tuple[str, str, bool]:
    return (jax.default_backend(), program_hash(lowered), keep_barriers)


def forget_compiled_memory() -> None:
    """Forget the memory of every program compiled so far (``lowered_memory``): for a
    benchmark timing planning as a fresh process would (one that reads what the cache
    folder keeps, where ``OPTIREMAT_CACHE_DIR`` is set: ``client.memory_cache``)."""
    for ahead in _AHEAD.values():
        ahead.cancel()
    _AHEAD.clear()
    _PEAKS.clear()


def lowered_peak(lowered: jax.stages.Lowered, keep_barriers: bool = False) -> int:
    """``measured_peak`` of ``lowered`` compiled, remembered as ``lowered_memory``."""
    return lowered_memory(lowered, keep_barriers).peak_bytes


def _as_tuple(argnums: int | Sequence[int]) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


@dataclass(frozen=True)
class Step:
    """``fun`` differentiated at ``argnums``, jitted with ``donate_argnums``."""

    argnums: tuple[int, ...] = (0,)
    donate_argnums: tuple[int, ...] = ()

    @classmethod
    def of(cls, argnums: int | Sequence[int] = 0,
           donate_argnums: int | Sequence[int] = ()) -> Step:
        return cls(_as_tuple(argnums), _as_tuple(donate_argnums))

    def check(self, args: Sequence) -> None:
        for i in (*self.argnums, *self.donate_argnums):
            if not -len(args) <= i < len(args):
                raise StepError(f"argnums/donate_argnums name argument {i}, but the function "
                                f"is given {len(args)}")
        leaves = [leaf for i in self.argnums for leaf in jax.tree_util.tree_leaves(args[i])]
        if not any(jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) for leaf in leaves):
            raise StepError(
                f"no floating-point input to differentiate among arguments {list(self.argnums)}:"
                " nothing has a gradient, so there is no backward pass to plan")

    def differentiated(self, args: Sequence) -> list[bool]:
        """Per flattened argument leaf, whether the step differentiates it."""
        flags: list[bool] = []
        chosen = {i % len(args) for i in self.argnums}
        for i, arg in enumerate(args):
            for leaf in jax.tree_util.tree_leaves(arg):
                flags.append(i in chosen
                             and bool(jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)))
        return flags

    def function(self, fun: Callable) -> jax.stages.Wrapped:
        """The step itself: the gradient (of the outputs' sum, for a non-scalar ``fun``)."""
        def total(*args, **kwargs):
            out = fun(*args, **kwargs)
            leaves = jax.tree_util.tree_leaves(out)
            if len(leaves) == 1 and jnp.ndim(leaves[0]) == 0:
                return leaves[0]
            return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in leaves
                       if jnp.issubdtype(leaf.dtype, jnp.inexact))
        argnums = self.argnums[0] if len(self.argnums) == 1 else self.argnums
        # allow_int: integer leaves of a differentiated pytree get empty float0 gradients.
        return jax.jit(jax.grad(total, argnums=argnums, allow_int=True),
                       donate_argnums=self.donate_argnums)

    def held_memory(self, args: Sequence) -> tuple[int, int, int]:
        """(argument, output, alias) bytes: what the step holds whatever the plan.
        Why ``budget="auto"`` counts donation differently: ``client/budget.py``."""
        def nbytes(leaf: Any) -> int:
            return aval_bytes(jax.core.ShapedArray(np.shape(leaf), jnp.result_type(leaf)))

        arguments = sum(nbytes(leaf) for leaf in jax.tree_util.tree_leaves(args))
        grads = [leaf for has_grad, leaf in self._leaf_owners(args) if has_grad]
        outputs = sum(nbytes(leaf) for leaf in grads)
        # XLA reuses a donated argument's buffer for one output of its shape and type.
        def kind(leaf: Any) -> tuple[tuple[int, ...], str]:
            return tuple(np.shape(leaf)), str(jnp.result_type(leaf))

        donated = Counter(
            kind(leaf)
            for i in {d % len(args) for d in self.donate_argnums}
            for leaf in jax.tree_util.tree_leaves(args[i]))
        alias = 0
        for leaf in grads:
            if donated[kind(leaf)] > 0:
                donated[kind(leaf)] -= 1
                alias += nbytes(leaf)
        return arguments, outputs, alias

    def _leaf_owners(self, args: Sequence) -> list[tuple[bool, Any]]:
        """Every leaf of the differentiated arguments, with whether it has a gradient."""
        chosen = {i % len(args) for i in self.argnums}
        return [(bool(jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)), leaf)
                for i in sorted(chosen) for leaf in jax.tree_util.tree_leaves(args[i])]
