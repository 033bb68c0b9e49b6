"""Single-LoRA resume: verify, preflight, then restore adapter, masters, moments and scheduler.

Collective. It reads as phases:

    classify path -> agree -> plan -> agree -> protocol.open_generation (verify, agree)
    -> preflight -> agree -> apply adapter, allocate optimizer state -> agree
    -> install and check (each rank its own ranges, bucket by bucket) -> agree
    -> scheduler, master refresh, RNG states -> agree

A format-v3 generation is read by its global layout (`megatron.reshard.ReshardPlan`), at the saved
layout or another. At the saved layout every saved block is wanted whole, so the reads are this
rank's own files, as before. A v1 or v2 generation is read at its saved layout only, from this
rank's own files (`LoadRequest._own_files`, `_preflight_adapter`). So is a v3 one with a parameter
megatron cannot place at all: nothing records where it lies (`LoadRequest._planned`).

Nothing changes before the preflight agreement. If a later phase fails on any rank, every rank
rolls its model, optimizer and scheduler back to their bytes before the load (`megatron.undo`),
and its RNG states to those it held (they change in the last phase only).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Any

from miles_lora_ckpt.core import content_rules, faults, host_memory, native_dist, rng_state
from miles_lora_ckpt.core.consensus import Consensus, Outcome, attempt
from miles_lora_ckpt.core.errors import (
    CheckpointError,
    GenerationDamaged,
    IncompatibleCheckpoint,
    NotACheckpoint,
    NothingCommitted,
    RankFailure,
)
from miles_lora_ckpt.core.hyperparameters import HyperparameterPolicy, Reconciler
from miles_lora_ckpt.core.jsoncodec import from_json
from miles_lora_ckpt.core.layout import Manifest, Topology
from miles_lora_ckpt.core.protocol import open_generation
from miles_lora_ckpt.core.verify import (
    committed_candidates,
    is_generation_dir,
    is_legacy_miles_dir,
    is_save_root,
)
from miles_lora_ckpt.megatron import adapter_shards as shards
from miles_lora_ckpt.megatron import rng_tracker
from miles_lora_ckpt.megatron.optimizer_children import chain
from miles_lora_ckpt.megatron.optimizer_children.family import RankView
from miles_lora_ckpt.megatron.optimizer_children.masters import AdapterSource
from miles_lora_ckpt.megatron.reshard import ReshardPlan
from miles_lora_ckpt.megatron.scheduler import reposition_scheduler, restore_scheduler
from miles_lora_ckpt.megatron.topology import Coordinates
from miles_lora_ckpt.megatron.undo import UndoRecord
from miles_lora_ckpt.savers.options import LoadOptions, LoadSource
from miles_lora_ckpt.savers.single_lora.common import (
    SAVER,
    SINGLE_LORA,
    TRAINING_STATE,
    TRAINING_STATE_BINDING,
    LoadResult,
    RankPlan,
    SaverSpec,
    adapter_binding,
    agree_plans,
    bound_ranges,
    bound_tensors,
    check_binding,
    describe_rank,
    filtered_adapter_names,
    rank_view,
    saved_children,
    saved_metadata,
)
from miles_lora_ckpt.savers.single_lora.legacy_miles import warm_start_legacy
from miles_lora_ckpt.savers.single_lora.native_warm import warm_start_native

__all__ = ["PathKind", "load_adapter_generation", "load_lora_adapter", "load_lora_checkpoint"]

log = logging.getLogger(__name__)

_ADAPTER_DIR = "adapter/"  # where a generation's adapter files lie (`adapter_shards.dense_file`)


def load_lora_adapter(model, adapter_path, *, optimizer=None, opt_param_scheduler=None) -> tuple[bool, int | None]:
    """Miles' signature. Collective. Restores `adapter_path` into `model` (and, given, `optimizer`
    and `opt_param_scheduler`) as `load_lora_checkpoint` does with its defaults. Returns `(loaded,
    iteration)`: `(False, None)` when nothing was there. Raises as `load_lora_checkpoint`."""
    result = load_lora_checkpoint(model, adapter_path, optimizer=optimizer, opt_param_scheduler=opt_param_scheduler)
    return result.loaded, result.iteration


def load_lora_checkpoint(
    model,
    path: str | os.PathLike,
    *,
    optimizer=None,
    opt_param_scheduler=None,
    consensus: Consensus | None = None,
    load_optim: bool = True,
    weights_only: bool = False,
    scheduler_increment_per_iteration: int | None = None,
    optimizer_children: Iterable[int] | None = None,
    hyperparameters: HyperparameterPolicy | str | None = None,
    load_rng: bool = True,
) -> LoadResult:
    """Collective. Restore the newest intact generation under `path` (or `path` itself) into
    `model`, `optimizer` and `opt_param_scheduler`. Returns a `LoadResult`: what was restored, and
    from what (`LoadResult.source`). The keywords after `consensus` are the options
    (`savers.options.LoadOptions`). An unknown `hyperparameters` policy raises ValueError before
    anything collective.

    A generation restores adapter, fp32 masters, every moment, steps and scheduler exactly. The DP
    size may differ from the save. A format-v3 generation also reshards to another TP, expert TP,
    PP, VPP, CP or (experts numbered globally) EP (`megatron.reshard`). The optimizer child layout,
    each child's class and its optimizer may not change.

    `optimizer_children` restores only those children (leaf indices, e.g. one slot's
    `miles_slot_child_indices`) and the adapter weights they step. Every other child's masters,
    moments and param groups stay bit-identical, and nothing is refreshed from bf16. Pass the
    scheduler that drives only those children, or None.

    `load_optim=False` (Miles' `--no-load-optim`) or `weights_only=True` restore the adapter only.
    The masters are then refreshed from it and the scheduler repositioned from the iteration.

    A stock Miles adapter directory warm-starts the adapter weights only, with a warning. It holds
    per-rank `.pt` files (`legacy_miles`) or a native `torch_dist` checkpoint. The latter is
    resharded to this run's TP/PP/EP (`native_warm`), its metadata read by the plugin's own reader.
    A missing path, or a save root with no committed generation yet, loads nothing.

    Every restored param group and the scheduler's fields are compared with the ones this launch
    built (`core.hyperparameters`). A saved key the live optimizer lacks is refused. Each difference
    is reported (`LoadResult.hyperparameter_differences`, a warning on rank 0) and settled by
    `hyperparameters` (`HyperparameterPolicy` or its string). With "checkpoint" the checkpoint's
    values are restored, with "launch" the launch's kept, and "refuse" refuses the load. With
    "megatron" or None (the default) it does what megatron does: param groups from the checkpoint,
    the scheduler's own flags for its fields.

    Every restored fp32 master must be the one the saved adapter was cast from
    (`optimizer_children.masters`): a generation assembled from two training states is refused.

    Every rank's RNG states (Python, numpy, torch, CUDA, megatron's tracker) are restored from its
    own files as the load's last step, when the layout (world, TP, PP, EP, expert TP, DP, CP, VPP)
    is the saved one. At another layout they stay as megatron seeded them (rank 0 logs one line
    saying so). A generation without RNG state loads with a warning naming it. Not with
    `load_rng=False` (Miles' `--no-load-rng`) or `weights_only=True`.

    Any problem raises the same CheckpointError on every rank before model or optimizer change.
    """
    options = LoadOptions(
        load_optim=load_optim,
        weights_only=weights_only,
        load_rng=load_rng,
        optimizer_children=optimizer_children,
        hyperparameters=hyperparameters,
        scheduler_increment_per_iteration=scheduler_increment_per_iteration,
    )
    return load_adapter_generation(
        model, path, options, optimizer=optimizer, opt_param_scheduler=opt_param_scheduler, consensus=consensus
    )


def load_adapter_generation(
    model,
    path: str | os.PathLike,
    options: LoadOptions,
    *,
    optimizer=None,
    opt_param_scheduler=None,
    consensus: Consensus | None = None,
    spec: SaverSpec = SINGLE_LORA,
) -> LoadResult:
    """Collective. `load_lora_checkpoint` with its options as one value, for the Miles integration
    and other savers' generations. `spec` (`SaverSpec`) names the saver accepted, the adapter
    filter, more manifest checks, and whether a stock Miles directory may be warm-started. Only a
    single-LoRA generation holds RNG states: they are the process's, not a slot's. Returns the
    `LoadResult`. Raises the same CheckpointError on every rank."""
    consensus = consensus or Consensus.default()
    result = _load(consensus, model, path, optimizer, opt_param_scheduler, options, spec)
    for warning in result.warnings:  # every load warning reaches the log (the result has them too)
        log.warning("LoRA checkpoint %s: %s", path, warning)
    if consensus.rank == 0:  # the same launch on every rank: rank 0 reports the differences it found
        for difference in result.hyperparameter_differences:
            log.warning("LoRA checkpoint %s: %s", path, difference)
        if result.rng_note:  # the same on every rank: one line
            log.warning("LoRA checkpoint %s: %s", path, result.rng_note)
    return result


def _load(consensus, model, path, optimizer, opt_param_scheduler, options: LoadOptions, spec: SaverSpec) -> LoadResult:
    # classify: the coordinator decides what `path` is; everybody follows
    consensus.agree_same("classify", Outcome.success(str(path)))
    classified = attempt(_classify, Path(path)) if consensus.rank == 0 else Outcome.success()
    kind = PathKind(consensus.agree("classify", classified)[0])
    if kind in (PathKind.MISSING, PathKind.EMPTY_ROOT):
        why = "does not exist" if kind is PathKind.MISSING else "has no committed generation yet"
        return LoadResult(False, None, LoadSource.NONE, warnings=[f"{path} {why}: starting from the initial adapter"])
    if kind is PathKind.LEGACY_MILES:
        if not spec.legacy:
            raise CheckpointError(
                "classify", [RankFailure(0, f"{path} is a stock Miles adapter directory, not a {spec.saver} root")]
            )
        return warm_start_legacy(consensus, model, Path(path), optimizer, opt_param_scheduler)
    if kind is PathKind.NATIVE_DIST:
        found = native_dist.find_native_checkpoint(path) or Path(path) / native_dist.NATIVE_SUBDIR
        if not spec.legacy:
            raise CheckpointError(
                "classify",
                [
                    RankFailure(r, f"{path} is a stock Miles native LoRA checkpoint ({found}), not a {spec.saver} root")
                    for r in range(consensus.world_size)
                ],
            )
        return warm_start_native(consensus, model, Path(path), found, optimizer, opt_param_scheduler)

    # plan: who holds what, so every rank can find its children's files and DP roots
    plans = agree_plans(consensus, attempt(describe_rank, model, optimizer, options.selection))
    request = attempt(LoadRequest, model, optimizer, opt_param_scheduler, plans, consensus.rank, options, spec)
    consensus.agree("plan", attempt(request.value.check_selection) if request.ok else request)
    request = request.value

    # verify: all ranks agree on one generation and read their own files, every content rule checked
    opened = open_generation(consensus, path, request.files_for_rank)

    # preflight: every check against this rank's model and optimizer; nothing changes yet
    plan = attempt(request.preflight, opened)
    consensus.agree_same("preflight", plan.map(lambda p: p.summary))

    # record: what this rank holds now, so that a failure in any later phase rolls every rank back
    undo = attempt(_capture_undo, request, plan.value)
    consensus.agree("record", undo.map(lambda _: None))
    try:
        # apply: adapter weights, and optimizer state allocated for the children being restored
        consensus.agree("apply", attempt(_apply_adapter_and_allocate, request, plan.value, opened, undo.value))

        # install: every rank its own verified ranges, bucket by bucket (no scatter from a DP
        # root), into masters, moments and param groups, then read back bit for bit
        installed = attempt(_install, request, plan.value)
        consensus.agree("install", installed)

        # finish: scheduler, and masters refreshed where none were restored
        finished = attempt(_finish, request, plan.value, opened)
        consensus.agree("finish", finished.map(lambda _: None))
    except CheckpointError:
        undo.value.restore()
        rng_undo = undo.value.rng_before  # the RNG changes in the finish phase only: set back
        if rng_undo is not None:
            rng_state.restore(rng_undo)
            rng_tracker.restore(rng_undo.tracker)
        raise
    return finished.value


class PathKind(StrEnum):
    """What a load's path is (rank 0 classifies it; every rank follows)."""

    MISSING = "missing"
    EMPTY_ROOT = "empty-root"  # a save root with nothing committed yet (an empty directory too)
    LEGACY_MILES = "legacy-miles"  # a stock Miles adapter directory of per-rank `.pt` files
    NATIVE_DIST = "native-dist"  # a stock Miles native `torch_dist` checkpoint (or a dir holding one)
    GENERATION = "generation"  # a save root or generation directory of this plugin


def _classify(path: Path) -> PathKind:
    """The `PathKind` of `path` (native-dist only where no generation is there); raises when `path`
    is none of those."""
    if not path.exists():
        return PathKind.MISSING
    if native_dist.find_native_checkpoint(path) is not None and not is_save_root(path) and not is_generation_dir(path):
        return PathKind.NATIVE_DIST
    if path.is_dir() and not path.is_symlink() and not os.listdir(path):
        # a save root whose only attempt failed (its staging removed, its lease released) is an
        # empty directory, like a --save directory made before the first save
        return PathKind.EMPTY_ROOT
    try:
        committed_candidates(path)
    except NothingCommitted:
        return PathKind.EMPTY_ROOT
    except NotACheckpoint:
        if is_legacy_miles_dir(path):
            return PathKind.LEGACY_MILES
        raise
    return PathKind.GENERATION


@dataclass
class LoadPlan:
    """Everything preflight read and checked, ready to apply."""

    iteration: int
    adapter: list[tuple[dict, dict]]  # (params, saved tensors)
    restore_children: dict[int, object]  # index -> the family's restore (what preflight read)
    fresh_children: list[int]  # selected children whose masters are refreshed from the adapter
    scheduler: dict | None  # decoded, its fields settled against the launch's (core.hyperparameters)
    saved_num_steps: int | None
    summary: dict
    warnings: list[str]
    hyperparameters: Reconciler | None = None  # what the launch's hyperparameters comparison found
    rng: rng_state.RngState | None = None  # this rank's saved RNG states, checked, to set at finish


@dataclass
class LoadRequest:
    """One rank's load: what it restores into, every rank's plan (`describe_rank`), the options;
    `files_for_rank` and `preflight` run the phases that read."""

    model: Any
    optimizer: Any
    scheduler: Any
    plans: list[RankPlan]
    rank: int
    options: LoadOptions
    spec: SaverSpec = SINGLE_LORA
    reshard: ReshardPlan | None = None  # set by files_for_rank when the model-parallel layout changed
    rng_files: list[str] | None = None  # set by files_for_rank: this rank's RNG files, when restored
    rng_warning: str | None = None  # set by files_for_rank: what the generation lacks (a warning)
    rng_note: str | None = None  # set by files_for_rank: another layout (rank 0 logs it)

    @property
    def restore_optimizer(self) -> bool:
        """False for load_optim=False or weights_only=True."""
        return self.options.restore_optimizer

    @property
    def restore_rng(self) -> bool:
        """Restore this rank's RNG states where the layout is the saved one (a single-LoRA generation only)."""
        return self.options.restore_rng and self.spec.saver == SAVER

    @property
    def selection(self) -> list[int] | None:
        """The chosen optimizer children (None: all)."""
        return self.options.selection

    def check_selection(self) -> None:
        """The adapter filter's guard (every rank sees the same plans, so raises the same)."""
        self._adapter_names  # noqa: B018 - computed (and checked) once, before anything is read

    @cached_property
    def _adapter_names(self) -> set[str] | None:
        return filtered_adapter_names(self.plans, self.selection, self.spec.adapter_filter)

    @property
    def coords(self) -> Coordinates:
        return self.plans[self.rank].coords

    @cached_property
    def view(self) -> RankView:
        return rank_view(self.model, self.plans, self.rank)

    def selected(self) -> list[int]:
        return [c.index for c in self.plans[self.rank].children]

    def descriptions(self) -> list[list[dict]]:
        return [list(p.children) for p in self.plans]

    def adapter_params(self) -> dict:
        """The adapter parameters this load restores: all, or those the chosen children step."""
        params = shards.adapter_params(self.model)
        names = self._adapter_names
        return params if names is None else {n: p for n, p in params.items() if n in names}

    def files_for_rank(self, manifest: Manifest) -> list[str]:
        """The files this rank reads of `manifest`'s generation, after every check that needs no
        read; `reshard` is set where the global layout plans the load. A format-v3 generation is
        planned from its global layout, at the saved layout too (each saved block then wanted
        whole), after the checks of a load there (`_check_saved_layout`). A v1 or v2 generation,
        or one with a parameter megatron cannot place (`_planned`), loads at its saved layout only,
        from this rank's own files (`_own_files`). Raises IncompatibleCheckpoint."""
        if manifest.saver != self.spec.saver:
            raise IncompatibleCheckpoint(
                f"generation {manifest.generation} was written by saver {manifest.saver!r}, not {self.spec.saver!r}"
            )
        if self.spec.check_manifest is not None:
            self.spec.check_manifest(manifest)
        rng = self._rng_files(manifest)
        if not manifest.topology.model_parallel_differences(self.plans[self.rank].topology):
            self._check_saved_layout(manifest)
            if not self._planned(manifest):
                return self._own_files(manifest) + rng
        # format v3: read by the global layout (at another TP / PP / VPP: resharded), or refused
        # naming what cannot map (a v1 or v2 generation at another layout too)
        self.reshard = ReshardPlan.build(
            manifest, self, self._saved_children_or_none(manifest), self._optimizer_in(manifest)
        )
        return [TRAINING_STATE, *self.reshard.files, *rng]

    def _check_saved_layout(self, manifest: Manifest) -> None:
        """The checks of a load at the saved model-parallel layout, whichever path reads it: the
        slot's adapter coverage, the optimizer children and their layout, a DP change. Raises
        IncompatibleCheckpoint (or ValueError where the manifest lacks a record) before anything
        is read: the load fails, it never falls back to an older generation."""
        if self.spec.adapter_filter is not None:
            self._check_coverage(manifest, *shards.split_by_kind(self.adapter_params()))
        if self._optimizer_in(manifest):
            # another child class or optimizer, another child layout
            dp_changed = manifest.topology.dp != self.plans[self.rank].topology.dp
            chain.check_against(
                saved_children(manifest),
                self.descriptions(),
                self.rank,
                dp_changed,
                manifest.metadata.get("optimizer_selection"),
            )
            self._check_child_layout(manifest)

    def _own_files(self, manifest: Manifest) -> list:
        """The reader of v1 and v2 generations (and of a v3 one `_planned` refuses): the files it
        reads at the saved layout, this rank's own adapter and optimizer files. Run after
        `_check_saved_layout`."""
        dense, expert = shards.split_by_kind(self.adapter_params())
        files = [TRAINING_STATE]
        files += [shards.dense_file(self.coords)] if dense else []
        files += [shards.expert_file(self.coords)] if expert else []
        if self._optimizer_in(manifest):
            files += chain.files_to_read(self.view, self.descriptions(), saved_children(manifest))
        return files

    def _planned(self, manifest: Manifest) -> bool:
        """Whether a load at the saved layout is planned from the global layout: a format-v3
        generation that records one, with every parameter placed on both sides. A malformed
        layout is planned: the plan reports it.

        A parameter megatron cannot place is `null` in the manifest and None in this run
        (`megatron.param_blocks`: a tensor-parallel parameter whose module gives no
        `ShardedTensor`, a layer without `layer_number`, a local expert without
        `local_expert_indices`). Nothing records where it lies, nor its shape, so a plan can
        neither name it nor check what it reads. Such a generation is read at its saved layout by
        the reader of each rank's own files (`_own_files`), as v1 and v2 generations are.

        Everything else is planned: a slot remap's model view (described through its chunk), an
        expert without a global number (named by its EP rank, `...@ep1/2`), a DistributedOptimizer
        child recorded without `positions` (placed as this run describes them, its buckets checked
        to be the saved ones: `DistributedFamily.plan_reshard`)."""
        layout = manifest.metadata.get("global_layout")
        if manifest.format_version < 3 or not isinstance(layout, dict):
            return False
        saved = layout.get("params")
        saved = saved.values() if isinstance(saved, dict) else []
        placed = all(not isinstance(blocks, dict) or None not in blocks.values() for blocks in saved)
        return placed and all(None not in plan.global_blocks.values() for plan in self.plans)

    def _rng_files(self, manifest: Manifest) -> list[str]:
        """This rank's RNG files where they are restored; else the reason, as a warning (the
        generation lacks them) or a note (another layout: megatron's seeding stands)."""
        self.rng_files, self.rng_warning, self.rng_note = None, None, None
        if not self.restore_rng:
            return []
        saved = manifest.metadata.get("rng_saved")
        keeps = "every RNG keeps the state this launch seeded (megatron's, from --seed)"
        if saved is not True:
            why = "saved with --no-save-rng" if saved is False else "saved before RNG states were saved"
            self.rng_warning = (
                f"the generation holds no RNG state ({why}): {keeps}; a run with dropout or other random "
                "layers does not continue bit-exact"
            )
            return []
        here = self.plans[self.rank].topology
        if manifest.topology != here:
            self.rng_note = (
                f"RNG state not restored: saved at {_layout(manifest.topology)}, this run is {_layout(here)}; "
                f"{keeps}, as megatron does at another layout (a run with dropout does not continue bit-exact)"
            )
            return []
        self.rng_files = [rng_state.json_file(self.rank), rng_state.tensor_file(self.rank)]
        return list(self.rng_files)

    def _saved_children_or_none(self, manifest: Manifest) -> dict:
        return saved_children(manifest) if self._optimizer_in(manifest) else {}

    def _check_coverage(self, manifest: Manifest, dense: dict, expert: dict) -> None:
        """Every adapter weight of the slot on this rank must have its file (empty-shard guard)."""
        written = saved_metadata(manifest, "adapter_files")
        for kind, group, key in (("dense", dense, self.coords.dense_key), ("expert", expert, self.coords.expert_key)):
            if group and key not in written.get(kind, []):
                raise IncompatibleCheckpoint(
                    f"generation {manifest.generation} holds no {kind} adapter file for {key}, yet this rank's slot "
                    f"has {len(group)} {kind} adapter parameter(s) there (e.g. {sorted(group)[0]}): it does not "
                    "cover every parameter of the slot"
                )

    def _optimizer_in(self, manifest: Manifest) -> bool:
        return (
            self.restore_optimizer
            and self.optimizer is not None
            and saved_metadata(manifest, "optimizer_saved") is True
        )

    def preflight(self, opened) -> LoadPlan:
        manifest = opened.manifest  # its saver and topology were checked by files_for_rank
        # the training state's invariants were checked as it was read (core.training_state)
        check_binding(opened, TRAINING_STATE, TRAINING_STATE_BINDING)
        state = opened.json(TRAINING_STATE)
        warnings = self._check_optimizer_claim(manifest)
        reconciler = Reconciler(self.options.hyperparameters)
        if self.reshard is not None:
            # the adapter from the files' global blocks (a whole saved tensor as read); every
            # restored master is checked against it below (masters.py)
            self._check_adapter_params()
            adapter = self.reshard.adapter_tensors(opened, self.adapter_params(), check_binding)
            sources = self.reshard.adapter_sources(adapter)
        else:
            adapter, sources = self._preflight_adapter(opened)
        restore, fresh = {}, []
        if self._optimizer_in(manifest) and self.reshard is not None:
            restore = self.reshard.restores(
                self.optimizer,
                bound_ranges(opened),
                bound_tensors(opened),
                state.get("optimizer_children", {}),
                hyperparameters=reconciler,  # the saved param groups against the launch's, as below
                adapter=lambda param: sources.get(id(param)),  # every master: its adapter's (masters.py)
            )
            fresh = [i for i in self.selected() if i not in restore]
        elif self._optimizer_in(manifest):
            restore = chain.preflight(
                self.optimizer,
                self.view,
                self.descriptions(),
                saved_children(manifest),
                bound_tensors(opened),
                state.get("optimizer_children", {}),
                bound_ranges(opened),
                adapter=lambda param: sources.get(id(param)),  # every master: its adapter's (masters.py)
                hyperparameters=reconciler,
            )
            fresh = [i for i in self.selected() if i not in restore]
        elif self.optimizer is not None:
            fresh = self.selected()
        scheduler = state.get("scheduler") if self._optimizer_in(manifest) else None
        if scheduler is not None and self.scheduler is not None:
            scheduler = from_json(scheduler)
            reconciler.scheduler(scheduler, self.scheduler.state_dict())
        reconciler.settle()  # "refuse": every difference, before anything changes
        saved_steps = (state.get("scheduler") or {}).get("num_steps")
        summary = {
            "generation": manifest.generation,
            "iteration": manifest.iteration,
            "optimizer": bool(restore),
            "scheduler": scheduler is not None and self.scheduler is not None,
        }
        warnings += reconciler.notes
        rng = None
        if self.rng_files is not None:
            json_path, tensor_path = self.rng_files
            check_binding(opened, json_path, rng_state.binding(self.rank))
            check_binding(opened, tensor_path, rng_state.binding(self.rank))
            try:
                rng = rng_state.decode(opened.json(json_path), dict(opened.tensors(tensor_path)), self.rank)
            except ValueError as exc:  # the files disagree with each other: damage
                raise GenerationDamaged(f"{tensor_path}: {exc}") from None
            try:
                rng_tracker.check_restorable(rng.tracker)
            except ValueError as exc:  # another device's generator: not damage, this run cannot take it
                raise IncompatibleCheckpoint(f"{tensor_path}: {exc}") from None
            summary["rng"] = True
        return LoadPlan(
            manifest.iteration, adapter, restore, fresh, scheduler, saved_steps, summary, warnings, reconciler, rng
        )

    def _check_optimizer_claim(self, manifest: Manifest) -> list[str]:
        """`optimizer_saved: false` must mean no optimizer files (else the manifest was edited), and
        loading such a checkpoint into a run with an optimizer says so."""
        if saved_metadata(manifest, "optimizer_saved") is True:
            return []
        saved_children(manifest)  # the metadata describes the children (a ValueError names a missing key)
        content_rules.check_optimizer_claim(manifest)  # the rule verify applies (verify.check_structure)
        if self.optimizer is None or not self.restore_optimizer:
            return []
        return [
            "the checkpoint holds no optimizer state (saved with no_save_optim): optimizer moments start "
            "fresh and the fp32 masters are refreshed from the adapter"
        ]

    def _preflight_adapter(self, opened) -> tuple[list[tuple[dict, dict]], dict[int, AdapterSource]]:
        """The reader of v1 and v2 generations (and of a v3 one `_planned` refuses): `(params,
        saved tensors)` per adapter file of this rank, checked, and `{id(param): AdapterSource}`."""
        params = self._check_adapter_params()
        dense, expert = shards.split_by_kind(params)
        checked, sources = [], {}
        for kind, group, file, key in (
            ("dense", dense, shards.dense_file(self.coords), self.coords.dense_key),
            ("expert", expert, shards.expert_file(self.coords), self.coords.expert_key),
        ):
            if group:
                check_binding(opened, file, adapter_binding(kind, key))
                saved = opened.tensors(file)
                if self.selection is not None and self.spec.adapter_filter is None:
                    # a chosen-children load restores a subset of the file (a slot file: exactly it)
                    saved = {n: t for n, t in saved.items() if n in group}
                shards.preflight_adapter(group, saved, file)
                checked.append((group, saved))
                sources.update({id(p): AdapterSource(n, saved[n], file) for n, p in group.items()})
        return checked, sources

    def _check_adapter_params(self) -> dict:
        """This load's adapter parameters; a ValueError where there are none."""
        params = self.adapter_params()
        if not params:
            what = (
                "the slot's adapter filter accepts none of this rank's"
                if self.spec.adapter_filter
                else "the model has no"
            )
            raise ValueError(f"{what} adapter parameters (names with 'lora_' or '.adapter.')")
        return params

    def _check_child_layout(self, manifest: Manifest) -> None:
        recorded = saved_metadata(manifest, "active_children").get(self.coords.model_parallel_key)
        mine = list(self.plans[self.rank].active)
        if recorded is None:
            raise ValueError(f"checkpoint records no optimizer children for {self.coords.model_parallel_key}")
        if sorted(recorded) != sorted(mine):
            raise IncompatibleCheckpoint(
                f"optimizer child layout differs at {self.coords.model_parallel_key}: checkpoint has active "
                f"children {sorted(recorded)}, this run has {sorted(mine)} (a stub child on one side only?)"
            )


def _capture_undo(request: LoadRequest, plan: LoadPlan) -> UndoRecord:
    touched = [
        c.optimizer
        for c in chain.select(request.optimizer, sorted(set(plan.restore_children) | set(plan.fresh_children)))
    ]
    # the moments a DistributedOptimizer install replaces are kept as they are, not copied
    replaced = chain.replaced_keys(request.optimizer, plan.restore_children)
    # each adapter parameter swaps contents with its verified saved tensor at apply: that buffer
    # then holds the old bytes, and nothing is copied for them (`UndoRecord.write_params`)
    incoming = {id(param): saved[name] for params, saved in plan.adapter for name, param in params.items()}
    undo = UndoRecord.capture(request.adapter_params().values(), touched, request.scheduler, replaced, incoming)
    # the RNG states this rank holds now, set back if the load fails after they were restored
    undo.rng_before = rng_state.capture(rng_tracker.capture()) if plan.rng is not None else None
    return undo


def _apply_adapter_and_allocate(request: LoadRequest, plan: LoadPlan, opened, undo: UndoRecord) -> None:
    faults.point("after-preflight", request.rank)
    for params, saved in plan.adapter:
        undo.write_params(params, saved)
    # the saved adapter is in the parameters now (their old bytes in the undo record: swapped
    # into the read buffer, which the record now holds, or copied): the load's own references go
    # before the optimizer allocates (bounded memory)
    plan.adapter.clear()
    for file in [f for f in opened.files if f.startswith(_ADAPTER_DIR)]:  # every adapter file read whole
        checked = opened.files.pop(file, None)
        if checked is not None:  # what it holds now that is zero (a relaunch's LoRA B) takes no memory
            host_memory.release_zero_pages(checked.buffer)
    chain.allocate(request.optimizer, plan.restore_children)


def _install(request: LoadRequest, plan: LoadPlan) -> None:
    chain.install(request.optimizer, plan.restore_children)


def _finish(request: LoadRequest, plan: LoadPlan, opened) -> LoadResult:
    # only the selected children's own masters, never the chain's (co-tenants keep their fp32 masters)
    for child in chain.select(request.optimizer, plan.fresh_children):
        child.optimizer.reload_model_params()
    result = LoadResult(
        loaded=True,
        iteration=plan.iteration,
        source=LoadSource.GENERATION,
        path=str(opened.path),
        adapter_restored=True,
        optimizer_restored=bool(plan.restore_children),
        masters_refreshed=bool(plan.fresh_children),
        warnings=[*opened.warnings, *plan.warnings],
        hyperparameter_differences=list(plan.hyperparameters.differences) if plan.hyperparameters else [],
    )
    if request.scheduler is not None:
        if plan.scheduler is not None:
            checkpoint_fields = request.options.hyperparameters is HyperparameterPolicy.CHECKPOINT
            restore_scheduler(request.scheduler, plan.scheduler, checkpoint_fields=checkpoint_fields)
            result.scheduler_restored = True
        else:
            step = request.options.scheduler_increment_per_iteration or _increment_from_saved(plan)
            reposition_scheduler(request.scheduler, plan.iteration, step)
            result.warnings.append(f"scheduler repositioned to iteration {plan.iteration} x {step}")
    if request.optimizer is not None and not result.optimizer_restored and not plan.warnings:
        result.warnings.append("optimizer moments not restored (fresh optimizer state, masters refreshed)")
    result.warnings += [request.rng_warning] if request.rng_warning else []
    result.rng_note = request.rng_note
    if plan.rng is not None:  # last: nothing after it can fail on this rank
        rng_state.restore(plan.rng)
        rng_tracker.restore(plan.rng.tracker)
        result.rng_restored = True
    return result


def _layout(topology: Topology) -> str:
    return " ".join(f"{axis}{value}" for axis, value in topology.to_dict().items())


def _increment_from_saved(plan: LoadPlan) -> int:
    if plan.saved_num_steps and plan.iteration:
        return max(1, plan.saved_num_steps // plan.iteration)
    return 1
