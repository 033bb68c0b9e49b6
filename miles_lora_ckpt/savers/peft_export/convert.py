"""From exported weights to a checked PEFT adapter: sources, conversion, coverage, the self-check.

`AdapterSource` is where HF-named adapter weights come from: `BridgeSource` is the live one
(`megatron/bridge_export.py`), `StaticSource` holds weights already in hand. `convert_and_check`
turns them into PEFT keys and an `adapter_config.json`, with Bridge's helpers where it has them.
It refuses empty, partial and fused-expert adapters. It proves with PEFT's own matching rules
that PEFT loads exactly what will be written. `PeftFiles` is the result, identical on every rank;
only the coordinator writes it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from miles_lora_ckpt.core.protocol import StagingWriter
from miles_lora_ckpt.megatron.bridge_export import ExportedWeight, PeftHelpers
from miles_lora_ckpt.savers.peft_export import format as fmt

__all__ = ["AdapterSource", "Coverage", "PeftFiles", "StaticSource", "convert_and_check"]


class AdapterSource(Protocol):
    """Where adapter weights come from: `BridgeSource` (live) or `StaticSource` (tensors in hand).

    Multi-LoRA exports one slot with `BridgeSource(bridge, model_context=<select the slot>,
    transform=<format.slice_to_rank to the slot's rank>)` and `LoraSpec(r=<slot rank>, ...)`.
    """

    kind: str

    def prepare(self) -> None:
        """Rank-local set-up, no collectives. It may raise: callers agree on it before exporting."""

    def export(self, model, on_item: Callable[[int, ExportedWeight], None] | None = None) -> list[ExportedWeight]:
        """Collective: every rank calls it and iterates fully, in the same order.

        Returns every weight; `on_item(index, weight)` is called for each.
        """

    def conversion_helpers(self) -> PeftHelpers:
        """Bridge's PEFT conversion helpers where the installed Bridge has them."""


@dataclass
class StaticSource:
    """Weights already in HF names (offline export from a committed generation); no collectives."""

    weights: list[ExportedWeight]
    kind: str = "offline"

    def prepare(self) -> None:
        """Nothing to set up."""
        return None

    def export(self, model, on_item=None) -> list[ExportedWeight]:
        """The weights held, each passed to `on_item(index, weight)`; `model` is not used."""
        for index, weight in enumerate(self.weights):
            if on_item is not None:
                on_item(index, weight)
        return list(self.weights)

    def conversion_helpers(self) -> PeftHelpers:
        """No Bridge helpers: the exporter's own are used."""
        return PeftHelpers()


@dataclass
class PeftFiles:
    """A converted, self-checked adapter, the same on every rank; only the coordinator writes it."""

    state: dict[str, Any]
    config: dict[str, Any]
    provenance: dict[str, Any] = field(default_factory=dict)

    def write(self, writer: StagingWriter, prefix: str = "") -> None:
        """Write both files into the staging directory of `writer`, under `prefix`.

        The weights go first, so a config never goes alone. Each file is bound to its role
        (`fmt.WEIGHTS_BINDING`, `fmt.CONFIG_BINDING`). The weights also carry the protocol's stamp
        next to `format: pt`. The config's bytes are Megatron-Bridge's own (`fmt.config_bytes`).
        Their mode follows the umask like any file's, not safetensors' fixed 0600.
        """
        writer.write_tensors(
            prefix + fmt.WEIGHTS_NAME,
            self.state,
            metadata=fmt.SAFETENSORS_METADATA,
            binding=fmt.WEIGHTS_BINDING,
            finite=True,
        )
        writer.write_bytes(prefix + fmt.CONFIG_NAME, fmt.config_bytes(self.config), binding=fmt.CONFIG_BINDING)

    def summary(self) -> dict[str, Any]:
        """What the manifest's metadata records about the export."""
        return {
            "r": self.config["r"],
            "lora_alpha": self.config["lora_alpha"],
            "target_modules": self.config["target_modules"],
            "rank_pattern": self.config.get("rank_pattern") or {},
            "tensors": len(self.state),
            **self.provenance,
        }


@dataclass(frozen=True)
class Coverage:
    """The Megatron-side adapter every rank agreed on: what a complete export must account for."""

    modules: int  # distinct adapter modules over all pipeline stages and chunks
    layers: int  # distinct transformer layers holding adapters
    uniform: bool  # every such layer holds the same module kinds
    num_layers: int | None  # the model's transformer layers (config.num_layers), when known

    @classmethod
    def from_plans(cls, plans: list[dict]) -> Coverage:
        """The coverage of every rank's export plan (`pp`, `modules`, `num_layers` of each)."""
        modules: set[tuple] = set()
        for plan in plans:
            modules |= {(plan["pp"], name) for name in plan["modules"]}
        kinds_by_layer: dict[tuple, set[str]] = defaultdict(set)
        for pp, name in modules:
            chunk, _, rest = name.partition(".")
            index = fmt.layer_index(rest)
            if index is not None:
                kinds_by_layer[(pp, chunk, index)].add(fmt.module_kind(rest))
        kinds = list(kinds_by_layer.values())
        num_layers = {plan["num_layers"] for plan in plans} - {None}
        return cls(
            modules=len(modules),
            layers=len(kinds_by_layer),
            uniform=all(k == kinds[0] for k in kinds),
            num_layers=num_layers.pop() if len(num_layers) == 1 else None,
        )


def convert_and_check(
    weights: list[ExportedWeight],
    lora: fmt.LoraSpec,
    coverage: Coverage | None,
    source: AdapterSource,
    config: dict | None = None,
) -> PeftFiles:
    """HF-named `weights` as a self-checked `PeftFiles`: a PEFT state dict and its config.

    The config is `config` when given, else built from `lora`. Bridge's helpers are used where
    `source` has them. `coverage` is what a complete export must account for (None: not checked).
    Raises ValueError for empty, partial, DoRA or fused-expert adapters, and when the self-check
    fails.
    """
    if lora.use_dora:
        raise ValueError("DoRA adapters cannot be exported: Bridge does not export DoRA magnitudes")
    weights = [
        ExportedWeight(fmt.unprefixed(w.param_name), w.weight, w.megatron_name, w.megatron_param_names) for w in weights
    ]
    names = [w.param_name for w in weights]
    if not weights:
        raise ValueError("the export yielded no adapter weights; refusing to write an empty adapter")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"the export yielded {duplicates[:3]} more than once")
    for weight in weights:
        fmt.split_lora_name(weight.param_name)
        if weight.weight.ndim == 3:
            raise ValueError(
                f"{weight.param_name}: fused 3-D expert stack {list(weight.weight.shape)}; PEFT's packed "
                "layout reads it in another order in known versions, so it is refused (export per-expert adapters)"
            )
    modules = sorted({fmt.split_lora_name(n)[0] for n in names})
    if coverage is not None:
        _check_coverage(modules, coverage)

    helpers = source.conversion_helpers()
    used = []
    convert = helpers.convert or fmt.to_peft_state
    used += ["convert"] if helpers.convert else []
    state, _, target_parameters = convert(weights)
    if target_parameters:
        raise ValueError(f"the conversion produced target_parameters {target_parameters[:3]}; they are refused")
    if config is None:
        if fmt.exact_target_modules_needed(modules, coverage.num_layers if coverage else None):
            targets = modules  # short names would adapt modules this export has no weights for
        else:
            targets = sorted((helpers.target_modules or fmt.infer_target_modules)(names))
            used += ["target_modules"] if helpers.target_modules else []
        rank_pattern = (helpers.rank_pattern or fmt.infer_rank_pattern)(weights, default_rank=lora.r)
        used += ["rank_pattern"] if helpers.rank_pattern else []
        config = _build_config(helpers, lora, targets, rank_pattern, used)
    fmt.check_state(state, config)
    provenance = {"source": source.kind, "bridge_helpers": used}
    return PeftFiles(state=dict(state), config=config, provenance=provenance)


def _build_config(helpers: PeftHelpers, lora, targets, rank_pattern, used: list) -> dict:
    if helpers.build_config is not None and (not rank_pattern or "rank_pattern" in helpers.build_config_options):
        options = {"base_model_name_or_path": lora.base_model_name_or_path, "rank_pattern": rank_pattern}
        kwargs = {k: v for k, v in options.items() if k in helpers.build_config_options}
        config = dict(helpers.build_config(lora.bridge_peft_config, targets, **kwargs))
        used.append("build_config")
        config.setdefault("task_type", lora.task_type)
        return config
    return fmt.build_config(lora, targets, rank_pattern=rank_pattern)


def _check_coverage(modules: list[str], coverage: Coverage) -> None:
    """Refuse an export that lost modules or layers the Megatron side holds (a partial adapter)."""
    layers: dict[int, set[str]] = defaultdict(set)
    for module in modules:
        index = fmt.layer_index(module)
        if index is not None:
            layers[index].add(fmt.module_kind(module))
    problems = []
    if len(modules) < coverage.modules:
        problems.append(f"{len(modules)} HF modules for {coverage.modules} Megatron-side adapter modules")
    if coverage.layers and len(layers) != coverage.layers:
        problems.append(f"adapters in {len(layers)} layers, the model holds them in {coverage.layers}")
    if coverage.uniform and layers:
        kinds = sorted(set().union(*layers.values()))
        short = {i: sorted(set(kinds) - k) for i, k in sorted(layers.items()) if k != set(kinds)}
        if short:
            index, missing = next(iter(short.items()))
            problems.append(f"layer {index} lacks {missing} (every model layer holds the same adapters)")
    if problems:
        raise ValueError("partial adapter export: " + "; ".join(problems))
