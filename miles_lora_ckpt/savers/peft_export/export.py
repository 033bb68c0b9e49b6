"""PEFT export: an HF PEFT adapter published through the protocol. Bridge converts; we own every barrier.

Standalone export root (`export_peft`, for serving), one collective call, read top to bottom::

    plan     every rank describes its Megatron-side adapters; an empty adapter is
             refused here, before anything exists on disk                           -> agree
    setup    the coordinator makes a fresh `.staging-<id>` (never reused); every rank
             prepares the source (binds Bridge) so no rank enters Bridge's collectives
             alone                                                                  -> agree
    export   every rank iterates the collective Bridge export fully, in the same order
                                                                                    -> agree (content must match)
    check    every rank converts to PEFT keys and config and self-checks it;
             partial adapters are refused                                           -> agree
    write    the coordinator writes adapter_model.safetensors, adapter_config.json,
             then manifest.json into the staging directory                          -> agree
    publish  the coordinator renames staging to gen-<iter>-<id> (one atomic rename),
             then points the tracker and the `latest` symlink at it                 -> agree

Inside a checkpoint generation (`prepare_peft_files`, then `PeftFiles.write` in the generation's
write phase): plan, setup (the source only), export and check run before the generation's own
phases; `peft/` is listed in the generation's manifest and commits and publishes with it.

A failed attempt raises the same `CheckpointError` on every rank, removes its own staging directory
when it can (a killed one is left for `gc`; it is never read nor published: attempt ids are unique),
and leaves the previous export, the tracker and `latest` untouched.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from miles_lora_ckpt.core import faults, retention, storage
from miles_lora_ckpt.core.consensus import Consensus, attempt
from miles_lora_ckpt.core.digest import StreamingDigest
from miles_lora_ckpt.core.errors import CheckpointError, RankFailure
from miles_lora_ckpt.core.layout import (
    MANIFEST,
    TRACKER,
    Manifest,
    Topology,
    generation_dir_name,
    new_attempt_id,
    staging_dir_name,
)
from miles_lora_ckpt.core.protocol import StagingWriter
from miles_lora_ckpt.megatron.bridge_export import BridgeSource, ExportedWeight, PeftHelpers
from miles_lora_ckpt.savers.peft_export import format as fmt

EXPORT_SAVER = "peft-export"
LATEST = "latest"  # symlink in an export root to the newest published adapter directory
GENERATION_SUBDIR = "peft/"  # where a checkpoint generation holds its export


class AdapterSource(Protocol):
    """Where adapter weights come from. `BridgeSource` is the live one; `StaticSource` holds tensors.

    Multi-LoRA exports one slot by wrapping a source: its `export` runs the inner export under the
    slot's selection and slices each weight to the slot's rank (`ExportedWeight(name, sliced)`).
    """

    kind: str

    def prepare(self) -> None:
        """Rank-local set-up, no collectives; may raise (agreed before any rank exports)."""

    def export(self, model, on_item: Callable[[int, ExportedWeight], None] | None = None) -> list[ExportedWeight]:
        """Collective: every rank calls it and iterates fully, in the same order."""

    def conversion_helpers(self) -> PeftHelpers:
        """Bridge's PEFT conversion helpers where the installed Bridge has them."""


@dataclass
class StaticSource:
    """Weights already in HF names (offline export from a committed generation); no collectives."""

    weights: list[ExportedWeight]
    kind: str = "offline"

    def prepare(self) -> None:
        return None

    def export(self, model, on_item=None) -> list[ExportedWeight]:
        for index, weight in enumerate(self.weights):
            if on_item is not None:
                on_item(index, weight)
        return list(self.weights)

    def conversion_helpers(self) -> PeftHelpers:
        return PeftHelpers()


@dataclass(frozen=True)
class PeftExport:
    """What `save_lora_checkpoint(..., peft=...)` exports into the generation's `peft/`."""

    source: Any  # an AdapterSource
    lora: fmt.LoraSpec

    @classmethod
    def from_miles_args(cls, args, *, model_context=None) -> PeftExport:
        """Bridge built from `args.hf_checkpoint` on every rank; ranks and alpha from Miles' LoRA flags."""
        source = BridgeSource(hf_checkpoint=args.hf_checkpoint, model_context=model_context)
        return cls(source=source, lora=fmt.LoraSpec.from_miles_args(args))

    def publish(self, model, out_root, *, iteration: int, consensus: Consensus | None = None, keep=None) -> Path:
        """Collective. `export_peft` of this source and spec into the export root `out_root`."""
        return export_peft(
            model, out_root, source=self.source, lora=self.lora, iteration=iteration, consensus=consensus, keep=keep
        )


@dataclass
class PeftFiles:
    """A converted, self-checked adapter, identical on every rank; only the coordinator writes it."""

    state: dict[str, Any]
    config: dict[str, Any]
    provenance: dict[str, Any] = field(default_factory=dict)

    def write(self, writer: StagingWriter, prefix: str = "") -> None:
        """Write both files into a staging directory (weights first: a config never goes alone)."""
        writer.write_tensors(prefix + fmt.WEIGHTS_NAME, self.state, metadata=fmt.SAFETENSORS_METADATA, finite=True)
        faults.point("peft-mid-write", writer.rank)
        writer.write_json(prefix + fmt.CONFIG_NAME, self.config)

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


# =========================================================================== standalone export root


def export_peft(
    model,
    out_root: str | os.PathLike,
    *,
    source: AdapterSource,
    lora: fmt.LoraSpec,
    iteration: int,
    consensus: Consensus | None = None,
    topology: Topology | None = None,
    keep: int | None = None,
    config: dict | None = None,
) -> Path:
    """Collective. Export the adapter of `model` as a new generation of the export root `out_root`.

    Returns the published adapter directory (`out_root/gen-<iter>-<id>`, also `out_root/latest`),
    loadable as is by `PeftModel.from_pretrained(base, path)`. `model` is Miles' list of chunks
    (None for a `StaticSource`). `keep` prunes the root to its newest N exports afterwards.
    `config` republishes a committed export's own `adapter_config.json` (still self-checked)
    instead of building one.
    Raises the same CheckpointError on every rank if anything fails anywhere; the previous export
    is then untouched.
    """
    consensus = consensus or Consensus.default()
    root, rank = Path(out_root), consensus.rank
    coordinator = rank == 0

    # plan: every rank says what adapter it holds; an empty adapter is refused before anything exists
    plans = consensus.agree("peft-plan", attempt(_describe_adapters, model))
    coverage = _refuse_empty(plans, consensus.world_size) if model is not None else None

    # setup: a fresh staging directory (coordinator) and a bound source (every rank), agreed together
    staged = attempt(_setup, root, source, rank, coordinator)
    staging = root / staging_dir_name(staged.value) if coordinator and staged.ok else None
    try:
        attempt_id = consensus.agree("peft-setup", staged)[0]
        staging = root / staging_dir_name(attempt_id)

        # export: every rank iterates Bridge's collective export fully; all must hold the same adapter
        exported = attempt(_export, source, model, rank)
        _refuse_inconsistent(consensus.agree("peft-export", exported.map(lambda e: e[1])))

        # check: convert to PEFT keys and config, and prove PEFT loads exactly that
        files = attempt(convert_and_check, exported.value[0], lora, coverage, source, config)
        consensus.agree("peft-check", files.map(lambda f: len(f.state)))

        # write: the coordinator writes both files, then the manifest, into staging
        manifest = Manifest(
            generation=attempt_id,
            iteration=iteration,
            saver=EXPORT_SAVER,
            topology=topology or _plan_topology(plans, consensus.world_size),
            files={},
            metadata={},
        )
        write = _write if coordinator else _bystander(("peft-write", "peft-mid-write"))
        consensus.agree("peft-write", attempt(write, staging, files.value, manifest, rank))

        # publish: one atomic rename, then the tracker and `latest` name it
        final = root / generation_dir_name(iteration, attempt_id)
        publish = _publish if coordinator else _bystander(("peft-publish",))
        consensus.agree("peft-publish", attempt(publish, staging, final, manifest, rank))
    except CheckpointError:
        if coordinator and staging is not None:
            shutil.rmtree(staging, ignore_errors=True)  # nothing was published from it
        raise

    # retain: after the last collective, so it must not raise
    if coordinator and keep is not None:
        retention.prune_quietly(root, keep=keep)
    return final


def _setup(root: Path, source: AdapterSource, rank: int, coordinator: bool) -> str | None:
    faults.point("peft-staging", rank)
    attempt_id = None
    if coordinator:
        attempt_id = new_attempt_id()
        root.mkdir(parents=True, exist_ok=True)
        (root / staging_dir_name(attempt_id)).mkdir()  # fails if it exists: never reused
    try:
        source.prepare()
    except BaseException:
        if attempt_id is not None:
            shutil.rmtree(root / staging_dir_name(attempt_id), ignore_errors=True)
        raise
    return attempt_id


def _write(staging: Path, files: PeftFiles, manifest: Manifest, rank: int) -> None:
    faults.point("peft-write", rank)
    writer = StagingWriter(staging, rank)
    files.write(writer)
    manifest.files = writer.records
    manifest.metadata = {"peft": files.summary()}
    storage.write_file_atomic(staging / MANIFEST, [manifest.to_json_bytes()])
    storage.fsync_dir(staging)


def _publish(staging: Path, final: Path, manifest: Manifest, rank: int) -> None:
    faults.point("peft-publish", rank)
    if final.exists():
        raise FileExistsError(f"{final} already exists")
    os.rename(staging, final)
    tracker = {"generation_dir": final.name, "generation": manifest.generation, "iteration": manifest.iteration}
    storage.write_json(final.parent / TRACKER, tracker)
    _point_latest(final.parent, final.name)
    storage.fsync_dir(final.parent)  # the rename, the tracker and `latest` become durable together


def _point_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp-{secrets.token_hex(4)}"
    os.symlink(name, tmp)  # relative: the root can be moved or mounted elsewhere
    try:
        os.replace(tmp, root / LATEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _bystander(phases: tuple[str, ...]):
    """Non-coordinators write nothing, but every fault phase can fire on every rank."""

    def run(*args) -> None:
        for phase in phases:
            faults.point(phase, args[-1])

    return run


# =========================================================================== inside a checkpoint generation


def prepare_peft_files(model, export: PeftExport, consensus: Consensus) -> PeftFiles:
    """Collective. Plan, prepare the source, export and check, each agreed; returns what the
    coordinator writes with `PeftFiles.write(writer, GENERATION_SUBDIR)` in the generation's write phase."""
    rank = consensus.rank
    plans = consensus.agree("peft-plan", attempt(_describe_adapters, model))
    coverage = _refuse_empty(plans, consensus.world_size)
    consensus.agree("peft-setup", attempt(_setup_source, export.source, rank))
    exported = attempt(_export, export.source, model, rank)
    _refuse_inconsistent(consensus.agree("peft-export", exported.map(lambda e: e[1])))
    files = attempt(convert_and_check, exported.value[0], export.lora, coverage, export.source)
    consensus.agree("peft-check", files.map(lambda f: len(f.state)))
    return files.value


def _setup_source(source: AdapterSource, rank: int) -> None:
    faults.point("peft-staging", rank)
    source.prepare()


# =========================================================================== steps every rank runs


def _describe_adapters(model) -> dict:
    """This rank's Megatron-side adapter modules (chunk-qualified, stage-local names) and stage."""
    if model is None:
        return {"pp": 0, "modules": [], "num_layers": None, "topology": None}
    from miles_lora_ckpt.megatron.adapter_shards import adapter_params
    from miles_lora_ckpt.megatron.topology import current_coordinates, current_topology

    modules = sorted({_module_of(name) for name in adapter_params(model)})
    chunks = model if isinstance(model, list | tuple) else [model]
    num_layers = getattr(getattr(chunks[0], "config", None), "num_layers", None) if chunks else None
    topology = current_topology(len(chunks)).to_dict()
    return {"pp": current_coordinates().pp, "modules": modules, "num_layers": num_layers, "topology": topology}


def _module_of(param_name: str) -> str:
    for marker in (".adapter.", ".lora_A.", ".lora_B."):
        if marker in param_name:
            return param_name.split(marker)[0]
    return param_name.rsplit(".", 1)[0]


def _refuse_empty(plans: list[dict], world: int) -> Coverage:
    """Every rank has every plan, so every rank raises the same error here (no collective needed)."""
    coverage = Coverage.from_plans(plans)
    if coverage.modules == 0:
        reason = "the model holds no adapter parameters on any rank; refusing to export an empty adapter"
        raise CheckpointError("peft-plan", [RankFailure(r, reason) for r in range(world)])
    return coverage


def _export(source: AdapterSource, model, rank: int) -> tuple[list[ExportedWeight], dict]:
    """This rank's export and the summary all ranks compare (computed here, inside the guard)."""

    def on_item(index: int, weight: ExportedWeight) -> None:
        if index == 0:
            faults.point("peft-export", rank)

    weights = source.export(model, on_item)
    if not weights:
        faults.point("peft-export", rank)  # an empty export still passes the fault point
    return weights, _content_summary(weights)


def _content_summary(weights: list[ExportedWeight]) -> dict:
    """Count and one digest over every name, dtype, shape and byte: equal on every rank or refused."""
    digest = StreamingDigest()
    for weight in weights:
        tensor = weight.weight.detach().cpu().contiguous()
        digest.update(f"{weight.param_name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        if tensor.numel():
            digest.update(memoryview(tensor.reshape(-1).view(_uint8()).numpy()))
    return {"tensors": len(weights), "digest": digest.hexdigest()}


def _refuse_inconsistent(summaries: list[dict]) -> None:
    reference = summaries[0]
    differing = [r for r, s in enumerate(summaries) if s != reference]
    if differing:
        failures = [
            RankFailure(
                r,
                f"exported {s['tensors']} tensors ({s['digest']}); rank 0 exported {reference['tensors']} "
                f"({reference['digest']}): partial or inconsistent Bridge export",
            )
            for r, s in enumerate(summaries)
            if r in differing
        ]
        raise CheckpointError("peft-export (ranks disagree)", failures)


def convert_and_check(
    weights: list[ExportedWeight],
    lora: fmt.LoraSpec,
    coverage: Coverage | None,
    source: AdapterSource,
    config: dict | None = None,
) -> PeftFiles:
    """HF-named weights -> PEFT state dict and config (`config` when given), with Bridge's helpers
    where it has them; then the self-check. Raises ValueError for empty, partial or fused-expert
    adapters."""
    if lora.use_dora:
        raise ValueError("DoRA adapters cannot be exported: Bridge does not export DoRA magnitudes")
    weights = [ExportedWeight(fmt.unprefixed(w.param_name), w.weight, w.megatron_name) for w in weights]
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


def _plan_topology(plans: list[dict], world: int) -> Topology:
    if plans[0]["topology"] is None:
        return Topology(world=world, dp=world)
    return Topology.from_dict(plans[0]["topology"])


def _uint8():
    import torch

    return torch.uint8
