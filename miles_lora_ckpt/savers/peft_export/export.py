"""The phases of a PEFT export: Bridge converts, this module owns every barrier.

A standalone export root (`export_peft`, for serving) is one collective call, read top to bottom::

    plan     every rank describes its Megatron-side adapters; an empty adapter is
             refused here, before anything exists on disk                           -> agree
    bind     every rank prepares the source (binds Bridge), so no rank enters
             Bridge's collectives alone                                             -> agree
    then `core.protocol.save_generation`, whose phases are the export's:
    prepare  the coordinator takes the root's writer lease, numbers the export and
             makes a fresh `.staging-<id>` (never reused)                           -> agree
    produce  export: every rank iterates the collective Bridge export fully, in the
             same order; the content must match on every rank                       -> agree
             check: every rank converts to PEFT keys and config and self-checks it;
             partial adapters are refused                                           -> agree
    write    the coordinator writes adapter_model.safetensors, then
             adapter_config.json, into the staging directory (stamped, bound)       -> agree
    commit   the coordinator writes manifest.json (signed when a key is set)         -> agree
    publish  the coordinator renames staging to gen-<iter>-<id> (one atomic rename),
             then points the tracker and the `latest` symlink at it                 -> agree
    retain   with `keep`, the root is pruned to its newest N content-verified exports

Inside a checkpoint generation (`save_lora_checkpoint(..., peft=PeftExport(...))`), the save runs
the same `plan_export` (plan, bind) and the same `ExportStep` as its produce step. The coordinator
writes `peft/` in the generation's write phase; it is listed in the manifest and commits with it.

What is converted and checked lives in `convert`. A failed attempt raises the same
`CheckpointError` on every rank and removes its staging directory. The previous export, the
tracker and `latest` stay untouched. A killed attempt is never read nor published, and the next
export into the root removes it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_lora_ckpt.core import faults
from miles_lora_ckpt.core.consensus import Consensus, attempt
from miles_lora_ckpt.core.digest import StreamingDigest
from miles_lora_ckpt.core.errors import CheckpointError, RankFailure
from miles_lora_ckpt.core.layout import Topology
from miles_lora_ckpt.core.protocol import StagingWriter, save_generation
from miles_lora_ckpt.megatron.bridge_export import BridgeSource, ExportedWeight
from miles_lora_ckpt.savers.peft_export import format as fmt
from miles_lora_ckpt.savers.peft_export.convert import AdapterSource, Coverage, PeftFiles, convert_and_check

EXPORT_SAVER = "peft-export"
GENERATION_SUBDIR = "peft/"  # where a checkpoint generation holds its export
# The fault phases an export passes, in order (`MILES_LORA_CKPT_FAULT`, see core.faults)
FAULT_PHASES = ("peft-setup", *faults.PREPARE_PHASES, "peft-export", *faults.SAVE_PHASES)

__all__ = [
    "EXPORT_SAVER",
    "FAULT_PHASES",
    "GENERATION_SUBDIR",
    "ExportStep",
    "PeftExport",
    "export_peft",
    "plan_export",
]


@dataclass(frozen=True)
class PeftExport:
    """What `save_lora_checkpoint(..., peft=...)` exports into the generation's `peft/`."""

    source: Any  # an AdapterSource
    lora: fmt.LoraSpec

    @classmethod
    def from_miles_args(cls, args, *, model_context=None) -> PeftExport:
        """The export Miles' arguments `args` describe.

        Bridge is built from `args.hf_checkpoint` on every rank; ranks and alpha come from Miles'
        LoRA flags. `model_context` is passed to `BridgeSource`.
        """
        source = BridgeSource(hf_checkpoint=args.hf_checkpoint, model_context=model_context)
        return cls(source=source, lora=fmt.LoraSpec.from_miles_args(args))

    def publish(self, model, out_root, *, iteration: int, consensus: Consensus | None = None, keep=None) -> Path:
        """Collective. `export_peft` of this source and spec into the export root `out_root`.

        Returns the published adapter directory; raises the same CheckpointError on every rank.
        """
        return export_peft(
            model, out_root, source=self.source, lora=self.lora, iteration=iteration, consensus=consensus, keep=keep
        )


# ========================================================================= standalone export root


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

    Returns the published adapter directory, `out_root/gen-<iter>-<id>` (also `out_root/latest`).
    `PeftModel.from_pretrained(base, path)` loads it as is. Raises the same CheckpointError on
    every rank if anything fails anywhere; the previous export is then untouched.

    - `model` is Miles' list of chunks, or None for a `StaticSource`.
    - `keep` prunes the root to its newest `keep` exports afterwards.
    - `config` republishes a committed export's own `adapter_config.json` instead of building one;
      it is still self-checked.

    The export root is a save root like any other: one writer at a time (its lease), exports
    ordered by sequence, signed when a key is configured.
    """
    consensus = consensus or Consensus.default()

    # plan, bind: agreed before anything exists on disk
    step = plan_export(model, source, lora, consensus, config=config)

    # prepare -> produce (export, check) -> write -> commit -> publish (and `latest`), each agreed
    return save_generation(
        consensus,
        out_root,
        iteration=iteration,
        saver=EXPORT_SAVER,
        topology=topology or step.topology,
        produce=step.produce,
        write_files=step.write,
        keep=keep,
        link_latest=True,
    )


# ================================================================== the export as steps of a save


def plan_export(
    model,
    source: AdapterSource,
    lora: fmt.LoraSpec,
    consensus: Consensus,
    *,
    prefix: str = "",
    config: dict | None = None,
) -> ExportStep:
    """Collective. Plan the export of `model` and bind `source`, each agreed.

    Returns the `ExportStep` a save runs as
    `save_generation(..., produce=step.produce, write_files=step.write)`. A saver that writes its
    own files too calls `step.write(writer)` from its `write_files`. `prefix` is where the two
    files go inside the generation (`GENERATION_SUBDIR` in a checkpoint). Raises the same
    CheckpointError on every rank for an empty adapter or a source that cannot be bound.
    """
    rank = consensus.rank

    # plan: every rank says what adapter it holds; an empty one is refused before anything exists
    plans = consensus.agree("peft-plan", attempt(_describe_adapters, model))
    coverage = _refuse_empty(plans, consensus.world_size) if model is not None else None

    # bind: every rank prepares the source, so no rank enters Bridge's collectives alone
    consensus.agree("peft-setup", attempt(_bind_source, source, rank))
    return ExportStep(model, source, lora, coverage, _plan_topology(plans, consensus.world_size), prefix, config)


@dataclass
class ExportStep:
    """The PEFT export inside one generation's save.

    `produce` is collective and runs between the save's prepare and write phases. `write` writes
    the coordinator's two files.
    """

    model: Any
    source: AdapterSource
    lora: fmt.LoraSpec
    coverage: Coverage | None
    topology: Topology
    prefix: str = ""
    config: dict | None = None
    files: PeftFiles | None = None  # after `produce`: identical on every rank

    def produce(self, consensus: Consensus) -> dict:
        """Collective. Export and check, each agreed; returns the manifest's `peft` metadata.

        Raises the same CheckpointError on every rank when ranks export different adapters or the
        check fails.
        """
        rank = consensus.rank

        # export: every rank iterates Bridge's collective export fully; all must hold one adapter
        exported = attempt(_export, self.source, self.model, rank)
        _refuse_inconsistent(consensus.agree("peft-export", exported.map(lambda e: e[1])))

        # check: convert to PEFT keys and config, and prove PEFT loads exactly that
        files = attempt(convert_and_check, exported.value[0], self.lora, self.coverage, self.source, self.config)
        consensus.agree("peft-check", files.map(lambda f: len(f.state)))
        self.files = files.value
        return {"peft": self.files.summary()}

    def write(self, writer: StagingWriter) -> None:
        """The coordinator writes both files (weights first); the other ranks write nothing."""
        if writer.rank == 0:
            self.files.write(writer, self.prefix)


# ========================================================================== steps every rank runs


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


def _bind_source(source: AdapterSource, rank: int) -> None:
    faults.point("peft-setup", rank)
    source.prepare()


def _module_of(param_name: str) -> str:
    for marker in (".adapter.", ".lora_A.", ".lora_B."):
        if marker in param_name:
            return param_name.split(marker)[0]
    return param_name.rsplit(".", 1)[0]


def _refuse_empty(plans: list[dict], world: int) -> Coverage:
    """The agreed `Coverage`; raises CheckpointError for an adapter no rank holds.

    Every rank has every plan, so every rank raises the same error here without a collective.
    """
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
    """Count and a digest over every name, dtype, shape and byte: equal on every rank or refused."""
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
