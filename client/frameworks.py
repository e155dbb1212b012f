"""Plans a framework runs from its own config: names-only plans and their export.

MaxText and Levanter build a model's remat policy from their config, as choices over
the values the model names with ``checkpoint_name`` (MaxText's ``remat_policy:
custom`` takes ``remat``, ``device`` or ``offload`` per named tensor and lowers it to
``save_and_offload_only_these_names``; Haliax's ``ScanCheckpointPolicy`` saves or
offloads each layer's carry and inputs and the block internals it names).
``optimize(..., saveable="maxtext")`` plans over those names only
(``client.extract.NamesOnly``: every unnamed value recomputed, one decision per name
wherever the model binds it, one policy per stack), and ``plan.to_maxtext()`` (or
``to_levanter()``) writes what makes the framework build that policy. A plan the
framework cannot express is refused with the reason.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from optiremat.client.extract import NamesOnly
from optiremat.solver.baselines import builtin_named_saves
from optiremat.solver.errors import OptirematError
from optiremat.solver.graph import CostGraph, NodeMode
from optiremat.solver.solution import Decision, Solution
from optiremat.solver.step import REGION_NAMES, RegionFound

# The tensors MaxText 0.2.5's ``remat_policy: custom`` sets (``configs/types.py``: the
# list it splits into ``tensors_on_device`` and ``tensors_to_offload``).
MAXTEXT_TENSORS = (
    "decoder_layer_input", "indexer_cutoff_threshold", "context", "mlpwi", "moe_mlpwi_0",
    "moe_x_sorted", "moe_routing_maps", "moe_mlpwi_1", "moe_mlpwo", "mlpwi_0", "mlpwi_1",
    "mlpwo", "query_proj", "key_proj", "value_proj", "kv_proj", "query_wa_proj",
    "kv_wa_proj", "mla_kv", "mla_q", "qkv_proj", "attention_out", "out_proj",
)

# What each framework calls a plan's three decisions.
_WHERE = {Decision.SAVE: "device", Decision.OFFLOAD: "offload", Decision.RECOMPUTE: "remat"}


class ExportError(OptirematError, ValueError):
    """A plan a framework's config cannot express; the message says why in one line."""


@dataclass(frozen=True)
class Framework:
    """A framework that takes a remat policy as choices over checkpoint names."""

    key: str  # what ``optimize(saveable=...)`` and the CLI call it
    title: str
    names: frozenset[str] | None  # the names its config can set (None: any name)
    nests: bool  # whether its config can nest a stack's layers in rematerialised groups
    presets: Mapping[str, frozenset[str]]  # its named policies, as the names each saves

    @property
    def names_only(self) -> NamesOnly:
        return NamesOnly(self.names)


# MaxText 0.2.5's presets that keep values on the device (``remat_policy``; ``full``
# saves none), as ``layers/nnx_decoders.py`` names them.
_QKV = frozenset({"query_proj", "value_proj", "key_proj", "kv_proj", "qkv_proj"})
_MLP = frozenset({"mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo"})
MAXTEXT_PRESETS = {
    "full": frozenset(),
    "save_out_proj": frozenset({"out_proj"}),
    "save_qkv_proj": _QKV,
    "save_dot_except_mlp": _QKV | {"out_proj"},
    "save_dot_except_mlpwi": _QKV | {"out_proj", "mlpwo"},
    "save_dot_with_context_except_mlp": _QKV | {"out_proj", "context"},
    "minimal": _QKV | {"out_proj"} | _MLP,
    "minimal_with_context": _QKV | {"out_proj", "context"} | _MLP,
}
MAXTEXT = Framework("maxtext", "MaxText", frozenset(MAXTEXT_TENSORS), nests=False,
                    presets=MAXTEXT_PRESETS)

# Haliax's ``scan`` names each layer's carry and its slice of the scanned inputs (the
# stacked parameters, for ``Stacked``) inside the checkpointed block: ``scan(layers)__carry``
# and ``scan(layers)__input``; ``ScanCheckpointPolicy`` saves or offloads them
# (``save_carries``, ``save_inputs``) and the block's other names it lists
# (``save_block_internals``, ``offload_block_internals``). Its presets, as names
# (``fnmatch`` patterns): ``"full"``/``"recompute"``, the default (carries), and
# ``"offload"``'s pair saved on the device.
LEVANTER_CARRY, LEVANTER_INPUT = "scan(*)__carry", "scan(*)__input"
LEVANTER_PRESETS = {
    "full": frozenset(),
    "save_carries": frozenset({LEVANTER_CARRY}),
    "save_carries_and_inputs": frozenset({LEVANTER_CARRY, LEVANTER_INPUT}),
}
LEVANTER = Framework("levanter", "Levanter", None, nests=False, presets=LEVANTER_PRESETS)
FRAMEWORKS = {f.key: f for f in (MAXTEXT, LEVANTER)}
SAVEABLE = ("all", "names", *FRAMEWORKS)


def framework_named(key: str) -> Framework:
    if key not in FRAMEWORKS:
        raise ExportError(f"no framework {key!r}: optiremat exports to "
                          f"{', '.join(map(repr, FRAMEWORKS))}")
    return FRAMEWORKS[key]


@dataclass(frozen=True)
class Saveable:
    """``optimize(saveable=...)`` read: what the plan may save, and for which framework."""

    names: NamesOnly | None = None  # None: every value JAX offers the policy
    framework: Framework | None = None

    @classmethod
    def of(cls, saveable: object) -> Saveable:
        if saveable == "all":
            return cls()
        if saveable == "names":
            return cls(NamesOnly())
        if isinstance(saveable, str) and saveable in FRAMEWORKS:
            framework = FRAMEWORKS[saveable]
            return cls(framework.names_only, framework)
        if (isinstance(saveable, list | tuple | set | frozenset) and saveable
                and all(isinstance(n, str) and n for n in saveable)):
            return cls(NamesOnly(frozenset(saveable)))
        raise ExportError(
            f"saveable= takes one of {', '.join(map(repr, SAVEABLE))} or a non-empty list "
            f"of checkpoint names, not {saveable!r}")


def names_of_keys(graph: CostGraph, key_aliases: Mapping[str, Collection[str]],
                  checkpoint_names: Mapping[str, str]) -> dict[str, str]:
    """Per graph node key that stands for a ``checkpoint_name``, that name."""
    named: dict[str, str] = {}
    for key in set(graph.node_key):
        for k in key_aliases.get(key, (key,)):
            if k in checkpoint_names:
                named[key] = checkpoint_names[k]
                break
    return named


def preset_saves(graph: CostGraph, key_aliases: Mapping[str, Collection[str]],
                 checkpoint_names: Mapping[str, str], saveable: Saveable) -> dict[str, list[bool]]:
    """The plans a names-only plan is never worse than, where they fit as measured
    (``client.peak.refine``), by name: the framework's presets, else JAX's built-ins as
    names (``solver.baselines.builtin_named_saves``); per node, whether each saves it."""
    if saveable.names is None:
        return {}
    if saveable.framework is None:
        return builtin_named_saves(graph)
    named = names_of_keys(graph, key_aliases, checkpoint_names)
    return {name: [k in named and _matches(named[k], preset) for k in graph.node_key]
            for name, preset in saveable.framework.presets.items()}


def _matches(name: str, patterns: Collection[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def names_decided(graph: CostGraph, solution: Solution, key_aliases: Mapping[str, Collection[str]],
                  checkpoint_names: Mapping[str, str], framework: Framework) -> dict[str, str]:
    """Per name the model binds, where the plan keeps it: ``device``, ``offload`` or
    ``remat``, as ``framework`` writes it. Raises ``ExportError`` naming why the
    framework's config cannot express the plan."""
    title = framework.title
    again = f"plan with optimize(..., saveable={framework.key!r})"
    if not solution.planned:
        raise ExportError(f"no plan to export: the solver stopped before it found one "
                          f"({solution.status})")
    if solution.no_checkpoint:
        raise ExportError(f"the plan adds no checkpoint (the step as written fits), which "
                          f"optiremat does not write as {title}'s config yet: it writes the "
                          f"policy of checkpointed layers only")
    if solution.layer_groups:
        raise ExportError(f"the plan gives a stack's layers saves of their own, and {title} "
                          f"takes one policy per stack: {again}")
    if not framework.nests and any(g > 1 for g in solution.groups or []):
        raise ExportError(f"the plan nests a stack's layers in rematerialised groups, which "
                          f"{title} does not: {again}")
    step = graph.step
    for region in step.regions if step is not None else []:
        if region.found in (RegionFound.REPEATED, RegionFound.SCOPE):
            raise ExportError(
                f"the plan checkpoints a {REGION_NAMES[region.found]} at {region.source}, "
                f"which {title} does not: it places its policy on its own layers only")
    named = names_of_keys(graph, key_aliases, checkpoint_names)
    where: dict[str, set[Decision]] = {name: set() for name in named.values()}
    unnamed: list[str] = []
    for n, decision in enumerate(solution.node_decisions):
        key = graph.node_key[n]
        if not key or graph.node_mode[n] != NodeMode.FREE:
            continue  # decided by JAX's rules or a checkpoint the plan does not place
        if key in named:
            where[named[key]].add(decision)
        elif decision != Decision.RECOMPUTE:
            unnamed.append(f"{graph.node_primitive[n]} at {graph.node_source[n] or '?'}")
    if unnamed:
        raise ExportError(f"the plan keeps {len(unnamed)} values no checkpoint_name names "
                          f"(the first: {unnamed[0]}), which {title}'s config cannot: {again}")
    split = sorted(name for name, decided in where.items() if len(decided) > 1)
    if split:
        raise ExportError(f"the plan decides {split[0]!r} differently where the model binds "
                          f"it more than once, and {title} takes one choice per name: {again}")
    decided = {name: _WHERE[next(iter(d), Decision.RECOMPUTE)] for name, d in where.items()}
    foreign = sorted(name for name, w in decided.items()
                     if w != "remat" and framework.names is not None
                     and name not in framework.names)
    if foreign:
        raise ExportError(f"the plan keeps {foreign[0]!r}, a name {title}'s config does not "
                          f"set: {again}")
    return decided


def maxtext_overrides(decided: Mapping[str, str]) -> dict[str, Any]:
    """MaxText's config overrides for names decided so (``names_decided``): ``remat_policy:
    custom`` and every tensor it sets, those the model does not bind recomputed."""
    return {"remat_policy": "custom",
            **{name: decided.get(name, "remat") for name in MAXTEXT_TENSORS}}


def levanter_policy(decided: Mapping[str, str]) -> dict[str, Any]:
    """Haliax's ``ScanCheckpointPolicy`` fields for names decided so (``names_decided``):
    the carries and inputs saved (``True``), offloaded (``"offload"``) or recomputed
    (``False``), and the block's other names kept, on the device or offloaded."""
    def pair(pattern: str) -> bool | str:
        where = {w for name, w in decided.items() if fnmatch.fnmatchcase(name, pattern)}
        if len(where) > 1:
            raise ExportError(f"the plan decides the names {pattern!r} differently in "
                              f"different scans, and Levanter takes one policy per model")
        kept = next(iter(where), "remat")
        return "offload" if kept == "offload" else kept == "device"

    internal = {n: w for n, w in decided.items()
                if not _matches(n, (LEVANTER_CARRY, LEVANTER_INPUT))}
    return {"save_carries": pair(LEVANTER_CARRY), "save_inputs": pair(LEVANTER_INPUT),
            "save_block_internals": sorted(n for n, w in internal.items() if w == "device"),
            "offload_block_internals": sorted(n for n, w in internal.items()
                                              if w == "offload")}


def config_text(overrides: Mapping[str, Any], form: str = "yaml", indent: int = 0) -> str:
    """Overrides as a YAML block (``yaml``; nested mappings indented) or a launcher's
    ``key=value`` arguments (flat overrides only)."""
    if form == "args":
        if any(isinstance(v, Mapping) for v in overrides.values()):
            raise ExportError("these overrides nest: take the YAML (or JSON) form")
        return " ".join(f"{k}={v}" for k, v in overrides.items())
    pad = " " * indent
    return "".join(f"{pad}{k}:\n{config_text(v, form, indent + 2)}" if isinstance(v, Mapping)
                   else f"{pad}{k}: {_yaml_scalar(v)}\n" for k, v in overrides.items())


def exported(framework: str, decided: Mapping[str, str]) -> dict[str, Any]:
    """What ``optiremat export FRAMEWORK`` writes: MaxText's top-level overrides, or
    Levanter's ``model.gradient_checkpointing``."""
    if framework == "levanter":
        return {"model": {"gradient_checkpointing": levanter_policy(decided)}}
    return maxtext_overrides(decided)


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_yaml_scalar(v) for v in value) + "]"
    return f"'{value}'" if isinstance(value, str) else str(value)
