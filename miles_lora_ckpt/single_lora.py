"""Single-LoRA save and resume for Miles' Megatron backend: adapter, optimizer, scheduler, exactly.

`save_lora_checkpoint` / `load_lora_adapter` have Miles' signatures, so the Miles hooks only register
them. Both are collective (every rank calls them) and read as phases::

    save:  plan -> agree -> local optimizer shards -> agree -> gather to DP roots -> agree
           -> protocol.save_generation (write -> agree -> commit -> agree)
    load:  classify path -> agree -> protocol.open_generation (verify, agree) -> preflight -> agree
           -> copy adapter, allocate optimizer state -> agree -> scatter -> agree
           -> install and check -> agree -> scheduler, master refresh

A generation holds (paths relative to it)::

    training_state.json                                   iteration, scheduler, per-child optimizer
                                                          param groups (JSON), written by rank 0
    adapter/dense_tp000_pp000.safetensors                 dense adapter shard per (TP, PP)
    adapter/expert_pp000_ep000_etp000.safetensors         expert adapter shard per (PP, EP, ETP)
    optimizer/child1_tp000_pp000_ep000_etp000.safetensors fp32 masters + every moment of one child,
                                                          per model-parallel coordinate of its DP root
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_lora_ckpt import faults
from miles_lora_ckpt.consensus import Consensus, Outcome, attempt
from miles_lora_ckpt.jsoncodec import from_json, to_json
from miles_lora_ckpt.layout import Manifest, Topology
from miles_lora_ckpt.megatron import adapter_shards as shards
from miles_lora_ckpt.megatron import optimizer_state as ostate
from miles_lora_ckpt.megatron.scheduler import reposition_scheduler, restore_scheduler, scheduler_state
from miles_lora_ckpt.megatron.topology import Coordinates, current_coordinates, current_topology
from miles_lora_ckpt.protocol import StagingWriter, open_generation, save_generation
from miles_lora_ckpt.verify import committed_candidates, is_legacy_miles_dir

log = logging.getLogger(__name__)

SAVER = "single-lora"
TRAINING_STATE = "training_state.json"


def optimizer_file(child_index: int, coordinate_key: str) -> str:
    return f"optimizer/child{child_index}_{coordinate_key}.safetensors"


# =========================================================================== save


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
) -> str:
    """Collective. Save adapter, optimizer parameter state and scheduler as one new generation.

    `save_dir` is the save root (see `layout`); returns the committed generation directory.
    With `args.no_save_optim` (or no optimizer) only the adapter and the iteration are saved.
    Raises the same CheckpointError on every rank if anything fails anywhere.
    """
    consensus = consensus or Consensus.for_world()
    iteration = int(iteration if iteration is not None else getattr(args, "iteration", 0) or 0)
    save_optim = optimizer is not None and not getattr(args, "no_save_optim", False)

    # plan: every rank says what it holds; everybody sees every rank's answer
    plans = consensus.agree("plan", attempt(_describe_rank, model, optimizer if save_optim else None))
    layout = SaveLayout.from_plans(plans)

    # optimizer, local: this rank's shard of every saved child, and DP roots' non-tensor state
    prepared = attempt(_prepare_optimizer_state, optimizer, layout)
    child_states = consensus.agree("optimizer-shards", prepared.map(lambda p: p.child_states))

    # optimizer, gather: each child's DP root receives the world tensors (collectives only)
    gathered = attempt(_gather_children, optimizer, prepared.value.shards if prepared.ok else {})
    consensus.agree("optimizer-gather", gathered.map(lambda _: None))

    training_state = {
        "iteration": iteration,
        "scheduler": scheduler_state(opt_param_scheduler) if save_optim else None,
        "optimizer_children": {k: v for states in child_states for k, v in states.items()},
    }

    def write_files(writer: StagingWriter) -> None:
        _write_rank_files(writer, model, layout, consensus.rank, gathered.value)
        if consensus.rank == 0:
            writer.write_json(TRAINING_STATE, training_state)

    generation = save_generation(
        consensus,
        save_dir,
        iteration=iteration,
        saver=SAVER,
        topology=current_topology(_chunk_count(model)),
        write_files=write_files,
        metadata=layout.metadata(save_optim, opt_param_scheduler, args),
        keep=keep,
    )
    return str(generation)


def _chunk_count(model) -> int:
    return len(model) if isinstance(model, list | tuple) else 1


def _describe_rank(model, optimizer) -> dict:
    """What this rank holds: coordinates, adapter shards it would write, optimizer children."""
    coords = current_coordinates()
    dense, expert = shards.split_by_kind(shards.adapter_params(model))
    children = []
    if optimizer is not None:
        for index, child in enumerate(ostate.optimizer_children(optimizer)):
            if ostate.is_stub(child):
                continue
            group = child.data_parallel_group_gloo
            if group is None:
                raise ValueError(f"optimizer child {index} has no gloo DP group (gloo process groups disabled?)")
            children.append(
                {
                    "index": index,
                    "dp_rank": group.rank(),
                    "dp_size": group.size(),
                    "has_params": ostate.local_param_count(child) > 0,
                    "has_state": ostate.has_state(child),
                    "keys": list(ostate.resolve_state_keys(child)),
                    "numel_unpadded": ostate.unpadded_numels(child),
                }
            )
    return {
        "coords": coords.to_dict(),
        "dense": sorted(dense),
        "expert": sorted(expert),
        "children": children,
    }


@dataclass
class SaveLayout:
    """Decisions every rank derives identically from all ranks' plans."""

    plans: list[dict]
    dense_writers: dict[str, int] = field(default_factory=dict)  # dense key -> lowest rank holding it
    expert_writers: dict[str, int] = field(default_factory=dict)
    stepped: dict[int, bool] = field(default_factory=dict)  # child index -> has optimizer state
    keys: dict[int, list[str]] = field(default_factory=dict)

    @classmethod
    def from_plans(cls, plans: list[dict]) -> SaveLayout:
        layout = cls(plans)
        for rank, plan in enumerate(plans):
            coords = Coordinates(**plan["coords"])
            if plan["dense"]:
                layout.dense_writers.setdefault(coords.dense_key, rank)
            if plan["expert"]:
                layout.expert_writers.setdefault(coords.expert_key, rank)
            for child in plan["children"]:
                index = child["index"]
                if child["has_state"]:
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
            active[key] = [c["index"] for c in plan["children"]] if save_optim else []
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
        writer.write_tensors(shards.dense_file(coords), {n: p.detach() for n, p in dense.items()})
    if expert and layout.expert_writers[coords.expert_key] == rank:
        writer.write_tensors(shards.expert_file(coords), {n: p.detach() for n, p in expert.items()})
    for index, world in sorted(payloads.items()):
        writer.write_tensors(optimizer_file(index, coords.model_parallel_key), world)


# =========================================================================== load


@dataclass
class LoadResult:
    """What `load_lora_checkpoint` restored, so that callers step nothing twice."""

    loaded: bool
    iteration: int | None
    source: str  # "generation", "legacy-miles" or "none"
    path: str | None = None
    adapter_restored: bool = False
    optimizer_restored: bool = False  # fp32 masters and every moment of every stepped child
    scheduler_restored: bool = False  # False with a scheduler: it was repositioned from the iteration
    masters_refreshed: bool = False  # masters copied from the loaded adapter (no saved masters used)
    warnings: list[str] = field(default_factory=list)


def load_lora_adapter(model, adapter_path, *, optimizer=None, opt_param_scheduler=None) -> tuple[bool, int | None]:
    """Miles' signature. Collective. Returns `(loaded, iteration)`; see `load_lora_checkpoint`."""
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
) -> LoadResult:
    """Collective. Restore the newest intact generation under `path` (or `path` itself).

    - A generation restores adapter, fp32 masters, every moment, steps and scheduler exactly; the
      DP size may differ from the save, TP/PP/EP/ETP/VPP/CP and the optimizer child layout may not.
    - `load_optim=False` (Miles' `--no-load-optim`) or `weights_only=True` restore the adapter
      only, refresh the masters from it and reposition the scheduler from the iteration.
    - A stock Miles adapter directory warm-starts the adapter weights only, with a warning.
    - A missing path, or a save root with no committed generation yet, loads nothing.
    Any problem raises the same CheckpointError on every rank before model or optimizer change.
    """
    consensus = consensus or Consensus.for_world()
    # classify: the coordinator decides what `path` is; everybody follows
    consensus.agree_same("classify", Outcome.success(str(path)))
    kind = consensus.agree("classify", attempt(_classify, Path(path)) if consensus.rank == 0 else Outcome.success())[0]
    if kind in ("missing", "empty-root"):
        why = "does not exist" if kind == "missing" else "has no committed generation yet"
        log.warning("LoRA checkpoint %s %s: starting from the initial adapter", path, why)
        return LoadResult(False, None, "none", warnings=[f"{path} {why}"])
    if kind == "legacy-miles":
        return _warm_start_legacy(consensus, model, Path(path), optimizer, opt_param_scheduler)

    # plan: who holds what, so every rank can find its child's DP root coordinates
    plans = consensus.agree("plan", attempt(_describe_rank, model, optimizer))
    request = LoadRequest(
        model, optimizer, opt_param_scheduler, plans, consensus.rank, load_optim and not weights_only, weights_only
    )

    # verify: all ranks agree on one generation and read their own files, digest-checked
    opened = open_generation(consensus, path, request.files_for_rank)

    # preflight: every check against this rank's model and optimizer; nothing changes yet
    plan = attempt(request.preflight, opened)
    consensus.agree_same("preflight", plan.map(lambda p: p.summary))

    # apply: adapter weights, and optimizer state allocated for the children being restored
    consensus.agree("apply", attempt(_apply_adapter_and_allocate, request, plan.value))

    # scatter: collectives only; each DP root sends every rank its shard
    received = attempt(_scatter_children, request, plan.value)
    consensus.agree("scatter", received.map(lambda _: None))

    # install: copy shards into masters and moments, read them back bit for bit
    consensus.agree("install", attempt(_install_children, request, plan.value, received.value))

    # finish: scheduler, and masters refreshed where none were restored
    finished = attempt(_finish, request, plan.value, opened.path, scheduler_increment_per_iteration)
    consensus.agree("finish", finished.map(lambda _: None))
    return finished.value


def _classify(path: Path) -> str:
    if not path.exists():
        return "missing"
    try:
        committed_candidates(path)
    except Exception as exc:  # noqa: BLE001 - classification only; open_generation reports damage
        if is_legacy_miles_dir(path):
            return "legacy-miles"
        if "no committed generation" in str(exc):
            return "empty-root"
        raise
    return "generation"


@dataclass
class LoadPlan:
    """Everything preflight read and checked, ready to apply."""

    iteration: int
    adapter: list[tuple[dict, dict]]  # (params, saved tensors)
    restore_children: dict[int, dict]  # index -> {"keys", "state", "payload" (DP root only)}
    fresh_children: list[int]  # active children whose masters are refreshed from the adapter
    scheduler: dict | None
    saved_num_steps: int | None
    summary: dict


@dataclass
class LoadRequest:
    model: Any
    optimizer: Any
    scheduler: Any
    plans: list[dict]
    rank: int
    restore_optimizer: bool
    weights_only: bool

    @property
    def coords(self) -> Coordinates:
        return Coordinates(**self.plans[self.rank]["coords"])

    def children(self) -> list:
        return ostate.optimizer_children(self.optimizer) if self.optimizer is not None else []

    def active(self) -> list[int]:
        return [c["index"] for c in self.plans[self.rank]["children"]]

    def files_for_rank(self, manifest: Manifest) -> list[str]:
        _check_topology(manifest, current_topology(_chunk_count(self.model)))
        dense, expert = shards.split_by_kind(shards.adapter_params(self.model))
        files = [TRAINING_STATE]
        files += [shards.dense_file(self.coords)] if dense else []
        files += [shards.expert_file(self.coords)] if expert else []
        if self._optimizer_in(manifest):
            stepped = set(manifest.metadata.get("stepped_children", []))
            for index in self.active():
                if index in stepped and self._dp_rank(index) == 0:
                    files.append(optimizer_file(index, self.coords.model_parallel_key))
        return files

    def _optimizer_in(self, manifest: Manifest) -> bool:
        return self.restore_optimizer and self.optimizer is not None and manifest.metadata.get("optimizer_saved", False)

    def _dp_rank(self, index: int) -> int:
        return next(c["dp_rank"] for c in self.plans[self.rank]["children"] if c["index"] == index)

    def _dp_root_key(self, index: int) -> str:
        group = self.children()[index].data_parallel_group_gloo
        import torch.distributed as dist

        root = dist.get_process_group_ranks(group)[0] if dist.is_initialized() else 0
        return Coordinates(**self.plans[root]["coords"]).model_parallel_key

    def preflight(self, opened) -> LoadPlan:
        manifest = opened.manifest
        if manifest.saver != SAVER:
            raise ValueError(f"{opened.path} was written by saver {manifest.saver!r}, not {SAVER!r}")
        state = opened.json(TRAINING_STATE)
        if state.get("iteration") != manifest.iteration:
            raise ValueError(f"{TRAINING_STATE}: iteration {state.get('iteration')} != manifest {manifest.iteration}")
        adapter = self._preflight_adapter(opened)
        restore, fresh = {}, []
        if self._optimizer_in(manifest):
            self._check_child_layout(manifest)
            stepped = set(manifest.metadata.get("stepped_children", []))
            for index in self.active():
                if index not in stepped:
                    fresh.append(index)
                    continue
                restore[index] = self._preflight_child(opened, state, index)
        elif self.optimizer is not None:
            fresh = self.active()
        scheduler = state.get("scheduler") if self._optimizer_in(manifest) else None
        saved_steps = (state.get("scheduler") or {}).get("num_steps")
        summary = {
            "generation": manifest.generation,
            "iteration": manifest.iteration,
            "optimizer": bool(restore),
            "scheduler": scheduler is not None and self.scheduler is not None,
        }
        return LoadPlan(manifest.iteration, adapter, restore, fresh, scheduler, saved_steps, summary)

    def _preflight_adapter(self, opened) -> list[tuple[dict, dict]]:
        params = shards.adapter_params(self.model)
        if not params:
            raise ValueError("the model has no adapter parameters (names with 'lora_' or '.adapter.')")
        dense, expert = shards.split_by_kind(params)
        checked = []
        for group, file in ((dense, shards.dense_file(self.coords)), (expert, shards.expert_file(self.coords))):
            if group:
                saved = opened.tensors(file)
                shards.preflight_adapter(group, saved, file)
                checked.append((group, saved))
        return checked

    def _check_child_layout(self, manifest: Manifest) -> None:
        recorded = manifest.metadata.get("active_children", {}).get(self.coords.model_parallel_key)
        mine = self.active()
        if recorded is None:
            raise ValueError(f"checkpoint records no optimizer children for {self.coords.model_parallel_key}")
        if sorted(recorded) != sorted(mine):
            raise ValueError(
                f"optimizer child layout differs at {self.coords.model_parallel_key}: checkpoint has active "
                f"children {sorted(recorded)}, this run has {sorted(mine)} (a stub child on one side only?)"
            )

    def _preflight_child(self, opened, state: dict, index: int) -> dict:
        child = self.children()[index]
        saved_keys = tuple(opened.manifest.metadata["state_keys"][str(index)])
        keys = ostate.resolve_state_keys(child)
        if set(saved_keys) != set(keys):
            raise ValueError(
                f"optimizer child {index}: checkpoint holds state {list(saved_keys)}, this run's optimizer "
                f"keeps {list(keys)} (different optimizer?); load with weights_only=True to warm-start"
            )
        root_key = self._dp_root_key(index)
        child_state = state.get("optimizer_children", {}).get(f"{index}:{root_key}")
        if child_state is None:
            raise ValueError(f"{TRAINING_STATE}: no optimizer state for child {index} at {root_key}")
        entry = {"keys": saved_keys, "state": child_state, "payload": None}
        if self._dp_rank(index) == 0:
            file = optimizer_file(index, self.coords.model_parallel_key)
            payload = opened.tensors(file)
            numels = opened.manifest.metadata["numel_unpadded"][str(index)][self.coords.model_parallel_key]
            try:
                ostate.preflight_payload(child, saved_keys, payload, numels)
            except ValueError as exc:
                raise ValueError(f"{file}: {exc}") from None
            entry["payload"] = payload
        return entry


def _check_topology(manifest: Manifest, current: Topology) -> None:
    differences = manifest.topology.model_parallel_differences(current)
    if differences:
        raise ValueError(
            "exact restore needs the same model-parallel layout; checkpoint -> this run differs in "
            + ", ".join(differences)
            + " (only the data-parallel size may change)"
        )


def _apply_adapter_and_allocate(request: LoadRequest, plan: LoadPlan) -> None:
    faults.point("after-preflight", request.rank)
    for params, saved in plan.adapter:
        shards.copy_into(params, saved)
    children = request.children()
    for index, entry in plan.restore_children.items():
        child = children[index]
        had = {id(p): set(s) for p, s in child.optimizer.state.items()}
        child.load_state_dict(from_json(entry["state"]))
        _drop_planted_keys(child, entry["keys"], had)


def _drop_planted_keys(child, keys: tuple[str, ...], had: dict) -> None:
    # megatron 0.16's load_state_dict plants an uninitialised `exp_avg_sq` even for one-moment
    # optimizers; keep only what the optimizer really uses (and what it had before).
    for main_param, state in child.optimizer.state.items():
        for key in [k for k in state if k not in keys and k != "step" and k not in had.get(id(main_param), ())]:
            del state[key]


def _scatter_children(request: LoadRequest, plan: LoadPlan) -> dict[int, list]:
    received = {}
    children = request.children()
    for index, entry in sorted(plan.restore_children.items()):
        child = children[index]
        split = ostate.split_for_scatter(child, entry["keys"], entry["payload"]) if entry["payload"] else None
        received[index] = ostate.scatter_from_dp_root(child, entry["keys"], split)
    return received


def _install_children(request: LoadRequest, plan: LoadPlan, received: dict[int, list]) -> None:
    children = request.children()
    for index, entry in sorted(plan.restore_children.items()):
        ostate.install_shards(children[index], entry["keys"], received[index])
        ostate.check_installed(children[index], entry["keys"], received[index])


def _finish(request: LoadRequest, plan: LoadPlan, path: Path, increment: int | None) -> LoadResult:
    children = request.children()
    for index in plan.fresh_children:
        children[index].reload_model_params()
    result = LoadResult(
        loaded=True,
        iteration=plan.iteration,
        source="generation",
        path=str(path),
        adapter_restored=True,
        optimizer_restored=bool(plan.restore_children),
        masters_refreshed=bool(plan.fresh_children),
    )
    if request.scheduler is not None:
        if plan.scheduler is not None:
            restore_scheduler(request.scheduler, plan.scheduler)
            result.scheduler_restored = True
        else:
            step = increment or _increment_from_saved(plan)
            reposition_scheduler(request.scheduler, plan.iteration, step)
            result.warnings.append(f"scheduler repositioned to iteration {plan.iteration} x {step}")
    if request.optimizer is not None and not result.optimizer_restored:
        result.warnings.append("optimizer moments not restored (fresh optimizer state, masters refreshed)")
    return result


def _increment_from_saved(plan: LoadPlan) -> int:
    if plan.saved_num_steps and plan.iteration:
        return max(1, plan.saved_num_steps // plan.iteration)
    return 1


# =========================================================================== legacy Miles


def _warm_start_legacy(consensus: Consensus, model, path: Path, optimizer, scheduler) -> LoadResult:
    """Stock Miles `adapter_megatron_rank*.pt`: adapter weights only, read with weights_only=True."""
    read = attempt(_read_legacy_shard, model, path, consensus.rank)
    iterations = consensus.agree("legacy-preflight", read.map(lambda r: r[1]))
    consensus.agree("legacy-apply", attempt(_apply_legacy, model, optimizer, read.value[0] if read.ok else None))
    iteration = iterations[0] if len(set(iterations)) == 1 else None
    message = (
        f"{path} is a stock Miles adapter directory: restored the adapter weights only; NOT restored: "
        "fp32 master weights (refreshed from the adapter), optimizer moments, scheduler state"
    )
    log.warning(message)
    result = LoadResult(True, iteration, "legacy-miles", str(path), adapter_restored=True, warnings=[message])
    result.masters_refreshed = optimizer is not None
    if scheduler is not None and iteration:
        reposition_scheduler(scheduler, iteration, 1)
    return result


def _read_legacy_shard(model, path: Path, rank: int):
    coords = current_coordinates()
    candidates = [path / f"adapter_megatron_rank{rank}.pt", path / f"adapter_megatron_tp{coords.tp}_pp{coords.pp}.pt"]
    file = next((c for c in candidates if c.exists()), None)
    if file is None:
        raise FileNotFoundError(
            f"no legacy adapter shard for rank {rank} in {path} (tried {[c.name for c in candidates]})"
        )
    if _chunk_count(model) != 1:
        raise ValueError("legacy Miles adapters have no chunk index: cannot warm-start a virtual-pipeline model")
    raw = torch.load(file, map_location="cpu", weights_only=True)
    saved = {f"chunk0.{_strip(name)}": tensor for name, tensor in raw.items() if shards.is_adapter_param_name(name)}
    params = shards.adapter_params(model)
    shards.preflight_adapter(params, saved, str(file))
    return saved, _legacy_iteration(path, rank)


def _strip(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def _legacy_iteration(path: Path, rank: int) -> int | None:
    state_file = path / f"training_state_rank{rank}.pt"
    if not state_file.exists():
        return None
    try:
        return int(torch.load(state_file, map_location="cpu", weights_only=True)["iteration"])
    except Exception:  # noqa: BLE001 - the iteration is informative; weights_only refusals are expected
        return None


def _apply_legacy(model, optimizer, saved: dict) -> None:
    shards.copy_into(shards.adapter_params(model), saved)
    if optimizer is not None:
        for child in ostate.optimizer_children(optimizer):
            if not ostate.is_stub(child):
                child.reload_model_params()
