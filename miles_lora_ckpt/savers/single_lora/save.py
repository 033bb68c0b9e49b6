"""Single-LoRA save: adapter shards, optimizer state of every child and scheduler as one generation.

Collective; reads as phases::

    plan_save:          plan -> agree -> layout -> agree -> [PEFT export: plan, bind, each agreed]
                        -> this rank's files, local (adapter shards; every DP rank its own optimizer
                           slice, nothing gathered; the scheduler's state; its RNG states) -> agree
    write_planned_save: protocol.save_generation (prepare -> [produce: PEFT export, self-check, each
                        agreed] -> write -> commit -> publish, each agreed)

The two halves are separate functions so that `async_save` can copy what `plan_save` returns into
host memory, the only time training is blocked, and run `write_planned_save` in the background.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from miles_lora_ckpt.core import layout_rules, rng_state
from miles_lora_ckpt.core.consensus import Consensus, attempt
from miles_lora_ckpt.core.data_state import DATA_STATE, ROLE_DATA_STATE
from miles_lora_ckpt.core.layout import Topology
from miles_lora_ckpt.core.protocol import StagingWriter, save_generation
from miles_lora_ckpt.megatron import adapter_shards as shards
from miles_lora_ckpt.megatron import rng_tracker
from miles_lora_ckpt.megatron.optimizer_children import chain
from miles_lora_ckpt.megatron.scheduler import scheduler_state
from miles_lora_ckpt.savers.options import SaveOptions
from miles_lora_ckpt.savers.peft_export import PeftExport, plan_export
from miles_lora_ckpt.savers.single_lora.common import (
    SAVER,
    SINGLE_LORA,
    TRAINING_STATE,
    TRAINING_STATE_BINDING,
    RankPlan,
    SaverSpec,
    adapter_binding,
    agree_plans,
    describe_rank,
    filtered_adapter_names,
    rank_view,
)

DATA_STATE_BINDING = {"role": ROLE_DATA_STATE}

__all__ = [
    "DATA_STATE_BINDING",
    "PlannedSave",
    "RankFile",
    "plan_save",
    "save_adapter_generation",
    "save_lora_checkpoint",
    "write_planned_save",
]


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
    optimizer_children: Iterable[int] | None = None,
    peft: PeftExport | None = None,
    data_state: dict | None = None,
) -> str:
    """Collective. Save adapter, optimizer state and scheduler as one new generation.

    Takes the model (chunks), Miles' `args` and the save root `save_dir`. The keywords are the live
    `optimizer` and `opt_param_scheduler`, the `consensus` group (default: the world's), and the
    options of `savers.options.SaveOptions`. Returns the committed generation directory. Raises
    the same CheckpointError on every rank if anything fails anywhere.

    - Every optimizer child megatron builds for LoRA is saved (see `megatron.optimizer_children`).
      With `args.no_save_optim`, or no optimizer, only the adapter and the iteration are saved.
    - `optimizer_children` saves only those children (leaf indices, e.g. Miles'
      `optimizer.miles_slot_child_indices[slot]`) and the adapter weights they step.
      `opt_param_scheduler` should then drive those children only.
    - With `peft`, the generation also holds `peft/`, an HF PEFT adapter directory exported
      through Megatron-Bridge and committed with the rest. If the export fails, the save fails.
    - Every rank's RNG states (`core.rng_state`) are saved as they are at the call, unless
      `args.no_save_rng`.
    - `data_state` is rank 0's rollout data state (`core.data_state.document`). It is committed
      as `rollout_data_state.json` in the same generation.
    - `keep`: afterwards keep the newest `keep` intact generations.
    """
    options = SaveOptions(
        iteration=iteration, keep=keep, optimizer_children=optimizer_children, peft=peft, data_state=data_state
    )
    return save_adapter_generation(
        model,
        args,
        save_dir,
        options,
        optimizer=optimizer,
        opt_param_scheduler=opt_param_scheduler,
        consensus=consensus,
    )


def save_adapter_generation(
    model,
    args,
    save_dir: str | os.PathLike,
    options: SaveOptions,
    *,
    optimizer=None,
    opt_param_scheduler=None,
    consensus: Consensus | None = None,
    spec: SaverSpec = SINGLE_LORA,
) -> str:
    """Collective. `save_lora_checkpoint` with its options as one value: the same phases and files.

    It serves the Miles integration and other savers, such as multi-LoRA slots (`spec`, see
    `SaverSpec`). With `spec.adapter_filter`, only the adapter weights it accepts are saved. The
    empty-shard guard: it must accept at least one on some rank, and exactly those the children
    step with `options.optimizer_children`. Returns the committed generation directory. Raises the
    same CheckpointError on every rank, before anything is written when the guard fails.
    """
    consensus = consensus or Consensus.default()
    planned = plan_save(
        model, args, consensus, options, optimizer=optimizer, opt_param_scheduler=opt_param_scheduler, spec=spec
    )
    return write_planned_save(planned, consensus, save_dir, keep=options.keep)


@dataclass
class RankFile:
    """One tensor file this rank writes: its binding, its tensors and whether it gets a block index.

    Tensors may be `safetensors_write.LazyTensor`s or live parameters until `async_save.snapshot`
    copies them.
    """

    binding: dict[str, str]
    tensors: dict
    blocks: bool = False


@dataclass
class PlannedSave:
    """What the write phase needs, agreed by every rank; `write_planned_save` writes it.

    Until it is written, `files` may still refer to the live model and optimizer. So a caller that
    trains in between snapshots it first (`async_save.snapshot`).
    """

    iteration: int
    saver: str
    topology: Topology
    metadata: dict
    files: dict[str, RankFile]  # relpath -> this rank's file, in write order
    training_state: dict | None  # rank 0: the training state (its "generation" is filled at write)
    peft_step: object = None  # the PEFT export's planned step (its produce runs in the protocol)
    rank_json: dict = field(default_factory=dict)  # relpath -> (JSON value, binding): this rank's JSON files
    export_after_write: bool = False  # the export's files go in a second, agreed write phase
    data_state: dict | None = None  # rank 0: the rollout side's data state (`core.data_state`)
    links: Sequence[str] = ()  # reader names the publish points at the generation (`SaverSpec.links`)


def plan_save(
    model,
    args,
    consensus: Consensus,
    options: SaveOptions,
    *,
    optimizer=None,
    opt_param_scheduler=None,
    spec: SaverSpec = SINGLE_LORA,
) -> PlannedSave:
    """Collective. The save's first half: plan -> agree -> layout -> agree -> [PEFT plan] -> files.

    The files are this rank's adapter shards, optimizer slices, scheduler and child states, then
    agreed. Nothing is written: returns the `PlannedSave` for `write_planned_save`. Raises the same
    CheckpointError on every rank.
    """
    iteration = options.iteration
    iteration = int(iteration if iteration is not None else getattr(args, "iteration", 0) or 0)
    save_optim = optimizer is not None and not getattr(args, "no_save_optim", False)
    # the RNG is the process's, not a slot's: multi-LoRA slot generations do not hold it
    save_rng = spec.saver == SAVER and not getattr(args, "no_save_rng", False)
    selection = options.selection

    # plan: every rank says what it holds; everybody sees every rank's answer
    plans = agree_plans(consensus, attempt(describe_rank, model, optimizer, selection, saving=save_optim))

    # layout: every rank derives the same decisions from the same answers (and refuses the same way)
    layout = attempt(SaveLayout.from_plans, plans, save_optim, selection, spec.adapter_filter)
    consensus.agree("layout", layout.map(lambda _: None))
    layout = layout.value
    view = rank_view(model, plans, consensus.rank)

    # PEFT export (optional): plan and bind now; the collective export runs as the produce step
    peft_step = None
    if options.peft is not None:
        peft_step = plan_export(model, options.peft.source, options.peft.lora, consensus, prefix=spec.peft_prefix)

    # this rank's files: its adapter shards, and what each saved child writes and records. A
    # DistributedOptimizer's DP ranks each write their own slice, produced lazily during the write:
    # no gather, no root. Rank 0 also takes the scheduler's state. Every rank takes its RNG states
    # as they are now, an asynchronous save's snapshot time.
    prepared = attempt(
        _rank_files,
        model,
        optimizer,
        view,
        layout,
        save_optim,
        opt_param_scheduler,
        consensus.rank == 0,
        consensus.rank if save_rng else None,
    )
    child_states = consensus.agree("optimizer-shards", prepared.map(lambda p: chain.recorded_states(p[0])))
    _, files, scheduler, rank_json = prepared.value

    training_state = None
    if consensus.rank == 0:
        training_state = {
            "iteration": iteration,
            "generation": None,
            "scheduler": scheduler,
            "optimizer_children": {k: v for states in child_states for k, v in states.items()},
        }
    return PlannedSave(
        iteration=iteration,
        saver=spec.saver,
        topology=plans[0].topology,
        metadata={
            **layout.metadata(save_optim, opt_param_scheduler, args),
            **({"rng_saved": save_rng} if spec.saver == SAVER else {}),
            **(spec.extra_metadata(layout) if spec.extra_metadata else {}),
        },
        files=files,
        training_state=training_state,
        peft_step=peft_step,
        export_after_write=spec.export_after_write,
        rank_json=rank_json,
        data_state=options.data_state if consensus.rank == 0 else None,
        links=spec.links,
    )


def write_planned_save(
    planned: PlannedSave,
    consensus: Consensus,
    save_dir: str | os.PathLike,
    *,
    keep: int | None = None,
) -> str:
    """Collective. The save's second half: `protocol.save_generation` of `planned` into `save_dir`.

    Its phases are prepare -> [produce: PEFT export] -> write -> commit -> publish, each agreed.
    `consensus` may be another group than `plan_save`'s, such as the asynchronous save's own.
    `keep` is `SaveOptions.keep`. Returns the committed generation directory. Raises the same
    CheckpointError on every rank.
    """
    peft_step = planned.peft_step

    # write, commit, publish: through the protocol; every rank writes its own files
    def write_files(writer: StagingWriter) -> None:
        for relpath, file in planned.files.items():
            # each adapter and optimizer file stamped with the digest of its global layout entries:
            # a manifest whose layout was edited and resealed no longer matches it (`layout_rules`)
            stamp = layout_rules.stamp(planned.metadata, relpath, file.binding)
            writer.write_tensors(relpath, file.tensors, metadata=stamp, binding=file.binding, blocks=file.blocks)
        for relpath, (value, binding) in planned.rank_json.items():
            writer.write_json(relpath, value, binding=binding)
        if planned.training_state is not None:
            training_state = {**planned.training_state, "generation": writer.generation}
            writer.write_json(TRAINING_STATE, training_state, binding=TRAINING_STATE_BINDING)
        if planned.data_state is not None:
            writer.write_json(DATA_STATE, planned.data_state, binding=DATA_STATE_BINDING)
        if peft_step is not None and not planned.export_after_write:
            peft_step.write(writer)

    generation = save_generation(
        consensus,
        save_dir,
        iteration=planned.iteration,
        saver=planned.saver,
        topology=planned.topology,
        write_files=write_files,
        metadata=planned.metadata,
        keep=keep,
        produce=peft_step.produce if peft_step is not None else None,
        links=planned.links,
        write_produced=peft_step.write if peft_step is not None and planned.export_after_write else None,
    )
    return str(generation)


def _rank_files(
    model, optimizer, view, layout: SaveLayout, save_optim: bool, scheduler, takes_scheduler: bool, rng_rank
) -> tuple[dict, dict[str, RankFile], dict | None, dict]:
    """Local. `(collected per child, files, scheduler state, rank JSON)` of this rank.

    `files` is `{relpath: RankFile}` in write order: adapter shards, optimizer files by name, then
    the RNG tensors. The scheduler's state is JSON with `takes_scheduler`, else None. Rank JSON is
    `{relpath: (JSON value, binding)}`: the RNG JSON, where `rng_rank` is not None.
    """
    # copies of every generator's state first, before anything here could draw from one (an
    # asynchronous save captures them at its snapshot: training is blocked until then)
    rng = rng_state.encode(rng_state.capture(rng_tracker.capture()), rng_rank) if rng_rank is not None else None
    files = _adapter_files(model, layout, view.rank)
    collected, optimizer_files = _optimizer_files(optimizer, view, layout.children) if save_optim else _no_files()
    for relpath, file in sorted(optimizer_files.items()):
        files[relpath] = RankFile(file.binding, file.tensors, file.partial_reads)
    state = scheduler_state(scheduler) if save_optim and takes_scheduler else None
    rank_json = {}
    if rng is not None:
        files[rng_state.tensor_file(rng_rank)] = RankFile(rng_state.binding(rng_rank), rng[1])
        rank_json[rng_state.json_file(rng_rank)] = (rng[0], rng_state.binding(rng_rank))
    return collected, files, state, rank_json


def _optimizer_files(optimizer, view, children: dict) -> tuple[dict, dict]:
    """(collected per child, `{relpath: OptimizerFile}`): local only; no family runs collectives."""
    collected = chain.collect(optimizer, view, children)
    return collected, chain.exchange_for_save(optimizer, view, children, collected)


def _no_files() -> tuple[dict, dict]:
    return {}, {}


@dataclass
class SaveLayout:
    """Decisions every rank derives identically from all ranks' plans."""

    plans: list[RankPlan]
    selection: list[int] | None
    adapter_names: set[str] | None  # with a selection or a filter: the adapter weights saved
    children: dict[str, dict] = field(default_factory=dict)  # the optimizer children's plan (manifest)
    dense_writers: dict[str, int] = field(default_factory=dict)  # dense key -> lowest rank holding it
    expert_writers: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_plans(
        cls, plans: list[RankPlan], save_optim: bool, selection: list[int] | None, adapter_filter=None
    ) -> SaveLayout:
        """The layout every rank derives from `plans`: the children's plan and each shard's writer."""
        layout = cls(plans, selection, filtered_adapter_names(plans, selection, adapter_filter))
        ranks = [p.coords for p in plans]
        layout.children = chain.plan([p.children for p in plans], ranks, save_optim)
        for rank, plan in enumerate(plans):
            coords = ranks[rank]
            if layout.adapter_subset(plan.dense):
                layout.dense_writers.setdefault(coords.dense_key, rank)
            if layout.adapter_subset(plan.expert):
                layout.expert_writers.setdefault(coords.expert_key, rank)
        return layout

    def adapter_subset(self, names):
        """The adapter names (or parameters by name) this save writes: all, or the selection's."""
        if self.adapter_names is None:
            return names
        if isinstance(names, dict):
            return {n: p for n, p in names.items() if n in self.adapter_names}
        return [n for n in names if n in self.adapter_names]

    def metadata(self, save_optim: bool, scheduler, args) -> dict:
        """The manifest's metadata: what was saved, the children's plan and the global layout."""
        active = {p.coords.model_parallel_key: list(p.active) for p in self.plans}
        return {
            "optimizer_saved": save_optim,
            "scheduler_saved": save_optim and scheduler is not None,
            "active_children": active,  # recorded even without optimizer state
            "optimizer_selection": self.selection,
            "optimizer_children": self.children,
            "adapter_files": {
                "dense": sorted(self.dense_writers),
                "expert": sorted(self.expert_writers),
            },
            "lora": _lora_args(args),
            "global_layout": self.global_layout(),
        }

    def global_layout(self) -> dict:
        """Format v3: where every saved tensor lies in the global model (`reshard` reads it).

        `params` holds, per model-parallel coordinate, each trainable parameter's `Block` as JSON;
        None where megatron's layout cannot describe it. `adapter_files` holds, per adapter file,
        the coordinate of the rank that wrote it and the names it holds. The optimizer's files are
        placed by each child's `layout.positions` (`optimizer_children.distributed`).
        """
        params, files = {}, {}
        for plan in self.plans:
            params.setdefault(plan.coords.model_parallel_key, plan.global_blocks)
        for kind, writers, file_of in (
            ("dense", self.dense_writers, shards.dense_file),
            ("expert", self.expert_writers, shards.expert_file),
        ):
            for rank in writers.values():
                coords = self.plans[rank].coords
                names = sorted(self.adapter_subset(getattr(self.plans[rank], kind)))
                files[file_of(coords)] = {"coordinate": coords.model_parallel_key, "names": names}
        return {"params": dict(sorted(params.items())), "adapter_files": dict(sorted(files.items()))}


def _lora_args(args) -> dict:
    names = ("lora_rank", "lora_alpha", "lora_dropout", "target_modules", "lora_type", "global_batch_size")
    return {n: getattr(args, n) for n in names if isinstance(getattr(args, n, None), int | float | str | list)}


def _adapter_files(model, layout: SaveLayout, rank: int) -> dict[str, RankFile]:
    """The adapter shards this rank writes, each with a block index.

    The lowest rank holding a coordinate's shard writes it. A resharding load then reads only the
    blocks holding the elements it needs.
    """
    coords = layout.plans[rank].coords
    dense, expert = (layout.adapter_subset(p) for p in shards.split_by_kind(shards.adapter_params(model)))
    files = {}
    if dense and layout.dense_writers.get(coords.dense_key) == rank:
        tensors = {n: p.detach() for n, p in dense.items()}
        files[shards.dense_file(coords)] = RankFile(adapter_binding("dense", coords.dense_key), tensors, blocks=True)
    if expert and layout.expert_writers.get(coords.expert_key) == rank:
        tensors = {n: p.detach() for n, p in expert.items()}
        files[shards.expert_file(coords)] = RankFile(adapter_binding("expert", coords.expert_key), tensors, blocks=True)
    return files
