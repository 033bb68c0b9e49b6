"""Single-LoRA save: adapter shards, optimizer parameter state and scheduler as one generation.

Collective; reads as phases::

    plan -> agree -> [PEFT export: plan, bind, each agreed]
    -> local optimizer shards -> agree -> gather to DP roots -> agree
    -> protocol.save_generation (prepare -> [produce: PEFT export, self-check, each agreed]
                                 -> write -> commit -> publish, each agreed)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from miles_lora_ckpt.core.consensus import Consensus, attempt
from miles_lora_ckpt.core.jsoncodec import to_json
from miles_lora_ckpt.core.layout import Topology
from miles_lora_ckpt.core.protocol import StagingWriter, save_generation
from miles_lora_ckpt.megatron import adapter_shards as shards
from miles_lora_ckpt.megatron import optimizer_state as ostate
from miles_lora_ckpt.megatron.scheduler import scheduler_state
from miles_lora_ckpt.megatron.topology import Coordinates, current_coordinates
from miles_lora_ckpt.savers.peft_export import GENERATION_SUBDIR, PeftExport, plan_export
from miles_lora_ckpt.savers.single_lora.common import (
    SAVER,
    TRAINING_STATE,
    TRAINING_STATE_BINDING,
    adapter_binding,
    describe_rank,
    optimizer_binding,
    optimizer_file,
)


def save_lora_checkpoint(
    model,
    args,
    save_dir: str | os.PathLike,
    *,
    optimizer=None,
    opt_param_scheduler=None,
    iteration: int | None = None,
    consensus: Consensus | None = None,
    keep: int | None = None,
    peft: PeftExport | None = None,
) -> str:
    """Collective. Save adapter, optimizer parameter state and scheduler as one new generation.

    `save_dir` is the save root (see `layout`); returns the committed generation directory.
    With `args.no_save_optim` (or no optimizer) only the adapter and the iteration are saved.
    With `peft`, the generation also holds `peft/` (an HF PEFT adapter directory exported through
    Megatron-Bridge, loadable as is), committed with the rest; if the export fails, the save fails.
    Raises the same CheckpointError on every rank if anything fails anywhere.
    """
    consensus = consensus or Consensus.default()
    iteration = int(iteration if iteration is not None else getattr(args, "iteration", 0) or 0)
    save_optim = optimizer is not None and not getattr(args, "no_save_optim", False)

    # plan: every rank says what it holds; everybody sees every rank's answer (and derives the
    # same layout from the same answers, so nothing below can fail on one rank only)
    plans = consensus.agree("plan", attempt(describe_rank, model, optimizer))
    layout = SaveLayout.from_plans(plans, save_optim)

    # PEFT export (optional): plan and bind now; the collective export runs as the save's produce step
    peft_step = None
    if peft is not None:
        peft_step = plan_export(model, peft.source, peft.lora, consensus, prefix=GENERATION_SUBDIR)

    # optimizer, local: this rank's shard of every saved child, and DP roots' non-tensor state
    prepared = attempt(_prepare_optimizer_state, optimizer, layout)
    child_states = consensus.agree("optimizer-shards", prepared.map(lambda p: p.child_states))

    # optimizer, gather: each child's DP root receives the world tensors (collectives only)
    gathered = attempt(_gather_children, optimizer, prepared.value.shards if prepared.ok else {})
    consensus.agree("optimizer-gather", gathered.map(lambda _: None))

    # write, commit, publish: through the protocol; every rank writes its own files
    def write_files(writer: StagingWriter) -> None:
        _write_rank_files(writer, model, layout, consensus.rank, gathered.value)
        if consensus.rank == 0:
            training_state = {
                "iteration": iteration,
                "generation": writer.generation,
                "scheduler": scheduler_state(opt_param_scheduler) if save_optim else None,
                "optimizer_children": {k: v for states in child_states for k, v in states.items()},
            }
            writer.write_json(TRAINING_STATE, training_state, binding=TRAINING_STATE_BINDING)
        if peft_step is not None:
            peft_step.write(writer)

    generation = save_generation(
        consensus,
        save_dir,
        iteration=iteration,
        saver=SAVER,
        topology=Topology.from_dict(plans[0]["topology"]),
        write_files=write_files,
        metadata=layout.metadata(save_optim, opt_param_scheduler, args),
        keep=keep,
        produce=peft_step.produce if peft_step is not None else None,
    )
    return str(generation)


@dataclass
class SaveLayout:
    """Decisions every rank derives identically from all ranks' plans."""

    plans: list[dict]
    dense_writers: dict[str, int] = field(default_factory=dict)  # dense key -> lowest rank holding it
    expert_writers: dict[str, int] = field(default_factory=dict)
    stepped: dict[int, bool] = field(default_factory=dict)  # child index -> has optimizer state
    keys: dict[int, list[str]] = field(default_factory=dict)

    @classmethod
    def from_plans(cls, plans: list[dict], save_optim: bool) -> SaveLayout:
        layout = cls(plans)
        for rank, plan in enumerate(plans):
            coords = Coordinates(**plan["coords"])
            if plan["dense"]:
                layout.dense_writers.setdefault(coords.dense_key, rank)
            if plan["expert"]:
                layout.expert_writers.setdefault(coords.expert_key, rank)
            for child in plan["children"]:
                index = child["index"]
                if child["has_state"] and save_optim:
                    layout.stepped[index] = True
                layout.stepped.setdefault(index, False)
                layout.keys.setdefault(index, child["keys"])
        return layout

    def saves_child(self, index: int) -> bool:
        return self.stepped.get(index, False)

    def metadata(self, save_optim: bool, scheduler, args) -> dict:
        active = {}
        for plan in self.plans:
            key = Coordinates(**plan["coords"]).model_parallel_key
            active[key] = [c["index"] for c in plan["children"]]  # recorded even without optimizer state
        numels = {}
        for plan in self.plans:
            for child in plan["children"]:
                numels.setdefault(str(child["index"]), {})[Coordinates(**plan["coords"]).model_parallel_key] = child[
                    "numel_unpadded"
                ]
        return {
            "optimizer_saved": save_optim,
            "scheduler_saved": save_optim and scheduler is not None,
            "active_children": active,
            "state_keys": {str(i): keys for i, keys in self.keys.items()},
            "stepped_children": sorted(i for i, s in self.stepped.items() if s),
            "numel_unpadded": numels,
            "adapter_files": {
                "dense": sorted(self.dense_writers),
                "expert": sorted(self.expert_writers),
            },
            "lora": _lora_args(args),
        }


def _lora_args(args) -> dict:
    names = ("lora_rank", "lora_alpha", "lora_dropout", "target_modules", "lora_type", "global_batch_size")
    return {n: getattr(args, n) for n in names if isinstance(getattr(args, n, None), int | float | str | list)}


@dataclass
class PreparedOptimizerState:
    shards: dict[int, list]  # child index -> this rank's bucket shards (stays local)
    child_states: dict[str, Any]  # "index:coordinate" -> non-tensor state (DP roots only)


def _prepare_optimizer_state(optimizer, layout: SaveLayout) -> PreparedOptimizerState:
    prepared = PreparedOptimizerState({}, {})
    if optimizer is None:
        return prepared
    coords = current_coordinates()
    for index, child in enumerate(ostate.optimizer_children(optimizer)):
        if ostate.is_stub(child) or not layout.saves_child(index):
            continue
        if child.data_parallel_group_gloo is None:
            raise ValueError(f"optimizer child {index} has no gloo DP group: drop --disable-gloo-process-groups")
        if ostate.local_param_count(child) > 0 and not ostate.has_state(child):
            raise ValueError(f"optimizer child {index} has stepped on other ranks but has no state here")
        prepared.shards[index] = ostate.local_shards(child, tuple(layout.keys[index]))
        if child.data_parallel_group_gloo.rank() == 0:
            state = to_json(child.state_dict(), f"optimizer child {index}")
            prepared.child_states[f"{index}:{coords.model_parallel_key}"] = state
    return prepared


def _gather_children(optimizer, shards_by_child: dict[int, list]) -> dict[int, dict]:
    """Collectives only (over each child's gloo DP group); DP roots get `{index: world tensors}`."""
    payloads = {}
    for index, local in sorted(shards_by_child.items()):
        world = ostate.gather_to_dp_root(ostate.optimizer_children(optimizer)[index], local)
        if world is not None:
            payloads[index] = world
    return payloads


def _write_rank_files(writer: StagingWriter, model, layout: SaveLayout, rank: int, payloads: dict) -> None:
    coords = Coordinates(**layout.plans[rank]["coords"])
    dense, expert = shards.split_by_kind(shards.adapter_params(model))
    if dense and layout.dense_writers[coords.dense_key] == rank:
        tensors = {n: p.detach() for n, p in dense.items()}
        writer.write_tensors(shards.dense_file(coords), tensors, binding=adapter_binding("dense", coords.dense_key))
    if expert and layout.expert_writers[coords.expert_key] == rank:
        tensors = {n: p.detach() for n, p in expert.items()}
        writer.write_tensors(shards.expert_file(coords), tensors, binding=adapter_binding("expert", coords.expert_key))
    for index, world in sorted(payloads.items()):
        binding = optimizer_binding(index, coords.model_parallel_key)
        writer.write_tensors(optimizer_file(index, coords.model_parallel_key), world, binding=binding)
