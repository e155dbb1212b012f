"""What a plan's peak is, measured: the measures refinement corrects its price with.

A ``PeakMeasure`` says how far a plan's peak is from the solver's price. With the
function at hand (``optimize``), ``StepMeasure`` compiles the whole step with the
plan applied: XLA's peak itself, every phase included. With a step's graph and its
regions alone (a sweep, a frontier), ``LayerMeasure`` compiles one layer per region
under the plan's policy and corrects the layers' phases. ``client.peak.refine``
chases a budget with either.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import jax

from optiremat.client.peak.calibration import working_bytes_in_step
from optiremat.client.peak.placement import Placement, Region, keeps_barriers
from optiremat.client.peak.step_graph import StepExtraction
from optiremat.client.policy import KeyPolicy
from optiremat.client.step import compile_ahead, lowered_peak
from optiremat.solver.graph import CostGraph
from optiremat.solver.peak import BudgetView, priced_extra_bytes


def working_set_delta(graph: CostGraph, regions: Sequence[Region], saves: Sequence[bool],
                      keys: frozenset[str], groups: Sequence[int] | None = None) -> int:
    """What the peak of the plan saving ``saves`` (the policy keys ``keys``) is beyond
    the solver's price: each region's backward phase with its own working set for the
    assumed one (the phases outside the regions are what they were), and, where the
    graph prices XLA's f32 copies of stacked half-float residuals (``value_extra_bytes``,
    fitted on CPU), the copies its working set measured instead."""
    assert graph.step is not None
    priced_extra = priced_extra_bytes(graph, saves, groups)
    # Each layer program's figure moved by what the step's calibration found its
    # nothing_saveable figure to be in the step (``calibrate_phases``).
    own = [working_bytes_in_step(r, memory, keys, priced_extra)
           for r, memory in zip(regions, graph.step.regions, strict=True)]
    return (BudgetView.of(graph, None, groups, own).held_bytes
            - BudgetView.of(graph, None, groups).held_bytes)


# A scan's layers planned apart: per group of consecutive layers, (layers, saved keys).
LayerSplit = tuple[tuple[int, frozenset[str]], ...]
# Blocks planned apart: the saved keys of every region but those named, and per block
# named (region index, its own saved keys).
BlockSplit = tuple[frozenset[str], tuple[tuple[int, frozenset[str]], ...]]
# A plan as its measurements are remembered: (saved keys, groups, offloaded keys).
_PlanKey = tuple[frozenset[str], tuple[int, ...] | None, frozenset[str]]


class PeakMeasure(Protocol):
    """What a plan's peak is, measured: how far it is from the solver's price, and the
    working set it reports."""

    def measure(self, saves: Sequence[bool], keys: frozenset[str],
                groups: Sequence[int] | None) -> tuple[int, int]:
        """(measured peak - the solver's price, working set) of the plan saving
        ``saves`` (the policy keys ``keys``) in ``groups``."""
        ...


@dataclass(frozen=True)
class LayerMeasure:
    """A plan's regions measured one layer at a time (one compile of one layer per
    policy): what is at hand with the step's graph and regions alone."""

    graph: CostGraph
    regions: Sequence[Region]

    def measure(self, saves: Sequence[bool], keys: frozenset[str],
                groups: Sequence[int] | None) -> tuple[int, int]:
        delta = working_set_delta(self.graph, self.regions, saves, keys, groups)
        return delta, _beyond_residuals(self.graph, saves, groups, delta)


@dataclass
class StepMeasure:
    """A plan's whole training step compiled (``lowered_of(keys, groups, offloaded)``
    lowers the jitted step with the plan applied; XLA's peak of it): exact in every
    phase, the head's included, and what ``optimize`` refines against. Each plan is
    lowered and compiled once."""

    graph: CostGraph
    # (saved keys, groups, offloaded keys) -> the step under that plan, lowered
    lowered_of: Callable[[frozenset[str], tuple[int, ...] | None, frozenset[str]],
                         jax.stages.Lowered]
    keep_barriers: bool  # compiled with checkpoints' barriers kept (``client.schedule``)
    # The peak of the step whose one scan region has its layers planned apart
    # (``client.peak.mixing``): per group in program order, (layers, saved keys).
    split_peak_of: Callable[[LayerSplit], int] | None = None
    # The peak of the step whose blocks take policies of their own
    # (``client.peak.block_mixing``).
    blocks_peak_of: Callable[[BlockSplit], int] | None = None
    _peaks: dict[_PlanKey, int] = field(default_factory=dict)
    _ahead: dict[_PlanKey, jax.stages.Lowered] = field(default_factory=dict)
    _split_peaks: dict[LayerSplit, int] = field(default_factory=dict)
    _block_peaks: dict[BlockSplit, int] = field(default_factory=dict)

    def measured_split(self, split: LayerSplit) -> int:
        """XLA's peak of the step with the scan's layers in the groups of ``split``."""
        assert self.split_peak_of is not None
        if split not in self._split_peaks:
            self._split_peaks[split] = self.split_peak_of(split)
        return self._split_peaks[split]

    def measured_blocks(self, split: BlockSplit) -> int:
        """XLA's peak of the step with its blocks' policies as ``split`` gives them."""
        assert self.blocks_peak_of is not None
        if split not in self._block_peaks:
            self._block_peaks[split] = self.blocks_peak_of(split)
        return self._block_peaks[split]

    def measured(self, keys: frozenset[str], groups: Sequence[int] | None,
                 offloaded: frozenset[str] = frozenset()) -> int:
        """XLA's peak of the step saving the policy keys ``keys`` in ``groups`` (and
        offloading ``offloaded`` to host memory: its device peak, where the backend's
        analysis keeps host buffers apart, ``client.step.host_buffers_apart``)."""
        key = (keys, _grouped(groups), offloaded)
        if key not in self._peaks:
            lowered = self._ahead.pop(key, None) or self.lowered_of(*key)
            self._peaks[key] = lowered_peak(lowered, self.keep_barriers)
        return self._peaks[key]

    def ahead(self, keys: frozenset[str], groups: Sequence[int] | None) -> None:
        """Start compiling the step saving ``keys`` in ``groups`` on a worker thread
        (``client.step.compile_ahead``), for ``measured`` to read soon."""
        key: _PlanKey = (keys, _grouped(groups), frozenset())
        if key not in self._peaks and key not in self._ahead:
            self._ahead[key] = self.lowered_of(*key)
            compile_ahead(self._ahead[key], self.keep_barriers)

    def measure(self, saves: Sequence[bool], keys: frozenset[str],
                groups: Sequence[int] | None) -> tuple[int, int]:
        assert self.graph.step is not None
        delta = (self.measured(keys, groups)
                 - BudgetView.of(self.graph, None, groups).predicted(list(saves)))
        return delta, _beyond_residuals(self.graph, saves, groups, delta)


def _grouped(groups: Sequence[int] | None) -> tuple[int, ...] | None:
    """``groups`` as a plan's measurements are remembered by: None for one per layer."""
    return None if groups is None or all(k == 1 for k in groups) else tuple(groups)


def measure_ahead(measure: PeakMeasure, keys: frozenset[str],
                  groups: Sequence[int] | None = None) -> None:
    """Where ``measure`` compiles the step (``StepMeasure``), start compiling the plan
    saving ``keys`` in ``groups``, which is measured next; elsewhere nothing."""
    if isinstance(measure, StepMeasure):
        measure.ahead(keys, groups)


def _beyond_residuals(graph: CostGraph, saves: Sequence[bool], groups: Sequence[int] | None,
                      delta: int) -> int:
    """What the plan's peak (its price + ``delta``) holds beyond the step's arguments and
    gradients and every residual: its peak phase's working set, nesting's buffers."""
    assert graph.step is not None
    view = BudgetView.of(graph, None, groups)
    peak = view.peak_phase()
    fixed = peak.fixed_residual_bytes if peak is not None else 0
    return view.held_bytes - graph.step.held_bytes - fixed + delta


def step_measure(fun: Callable, args: Sequence, extracted: StepExtraction,
                 placement: Placement, keep_barriers: bool | None = None) -> StepMeasure:
    """A plan's peak as XLA measures it: ``fun``'s step compiled with the plan applied to
    the jaxpr ``fun`` was traced to (``extracted.traced``; it is not traced again). The
    program is the one ``plan.apply(fun)`` lowers to, so verifying a plan compiles nothing.
    ``keep_barriers``: compiled with checkpoints' barriers kept (``client.schedule``), else
    as this process compiles by default; by default, kept where the step has blocks of
    straight-line code."""
    if keep_barriers is None:
        keep_barriers = keeps_barriers(placement.regions)
    aliases = extracted.extraction.key_aliases

    def expanded(keys: frozenset[str]) -> frozenset[str]:
        return frozenset(k for key in keys for k in aliases.get(key, {key}))

    def lowered(evaluate: Callable[[Sequence], object]) -> jax.stages.Lowered:
        @functools.wraps(fun)  # the module's name is the function's, as plan.apply's
        def applied(*args):
            return evaluate(jax.tree_util.tree_leaves(args))

        return placement.step.function(applied).lower(*args)

    def compiled_peak(evaluate: Callable[[Sequence], object]) -> int:
        return lowered_peak(lowered(evaluate), keep_barriers)

    def plan_lowered(keys: frozenset[str], groups: tuple[int, ...] | None,
                     offloaded: frozenset[str]) -> jax.stages.Lowered:
        policy = KeyPolicy(expanded(keys), expanded(offloaded))
        return lowered(lambda leaves: placement.evaluate(extracted.traced, leaves, policy,
                                                         groups))

    def split_peak_of(split: LayerSplit) -> int:
        (region,) = placement.regions
        policies = [(layers, KeyPolicy(expanded(keys))) for layers, keys in split]
        return compiled_peak(lambda leaves: placement.evaluate(
            extracted.traced, leaves, policies[0][1], None, {region.index: policies}))

    def blocks_peak_of(split: BlockSplit) -> int:
        keys, own = split
        policies = {index: [(1, KeyPolicy(expanded(saved)))] for index, saved in own}
        return compiled_peak(lambda leaves: placement.evaluate(
            extracted.traced, leaves, KeyPolicy(expanded(keys)), None, policies))

    return StepMeasure(extracted.graph, plan_lowered, keep_barriers,
                       split_peak_of if len(placement.regions) == 1 else None,
                       blocks_peak_of)
