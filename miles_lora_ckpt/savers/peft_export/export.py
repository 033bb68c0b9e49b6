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

What is converted and checked, and how, lives in `convert`; this module holds only the phases.
A failed attempt raises the same `CheckpointError` on every rank, removes its own staging directory
when it can (a killed one is left for `gc`; it is never read nor published: attempt ids are unique),
and leaves the previous export, the tracker and `latest` untouched.
"""

from __future__ import annotations

import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from miles_lora_ckpt.megatron.bridge_export import BridgeSource, ExportedWeight
from miles_lora_ckpt.savers.peft_export import format as fmt
from miles_lora_ckpt.savers.peft_export.convert import AdapterSource, Coverage, PeftFiles, convert_and_check

EXPORT_SAVER = "peft-export"
LATEST = "latest"  # symlink in an export root to the newest published adapter directory
GENERATION_SUBDIR = "peft/"  # where a checkpoint generation holds its export


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


def _plan_topology(plans: list[dict], world: int) -> Topology:
    if plans[0]["topology"] is None:
        return Topology(world=world, dp=world)
    return Topology.from_dict(plans[0]["topology"])


def _uint8():
    import torch

    return torch.uint8
