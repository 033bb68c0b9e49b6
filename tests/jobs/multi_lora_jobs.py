"""Worker functions for the multi-LoRA tests (savers/multi_lora): one job runs many cases (`suite`).

Sections (each named in the payload):
- `stale_shards` (W=4): an EP=4 slot save with a PEFT export writes every rank's shards into its
  attempt's staging directory, then fails inside the export on rank 3 (the exporter's `peft-export`
  fault; the export sees the staged shards), with its coordinator gone (its staging directory left
  behind, as after a SIGKILL); the run restarts at EP=1, trains, saves the same step and publishes;
  a later EP=4 load resolves exactly that EP=1 generation, refuses it (the layout differs), changes
  nothing and never reads the stale shards; the EP=1 generation restores the EP=1 values bit for
  bit, and the EP=4 step-2 generation (by name) the EP=4 values.
- `faults` (W=2): a `raise` fault at every save phase (prepare included) and every load phase on
  every rank: the same CheckpointError on every rank, the previous generation intact and still
  the one resumed, and a failed load changes neither the slot nor its co-tenant.
- `guards` (W=2): the empty-shard guard (save: a filter matching nothing, a filter missing some of
  the slot's parameters; load: a slot checkpoint that does not cover every parameter of the slot,
  one of another slot index), each refused on every rank with nothing changed; then a slot-1
  generation resumed into slot 0 (`rename_slot`), bit for bit, its co-tenant at index 1 untouched.
- `peft` (W=2): a slot saved with `peft=` holds an HF PEFT adapter directory.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from miles_lora_ckpt.core import faults, protocol
from miles_lora_ckpt.core.consensus import Consensus, Outcome
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.savers import multi_lora as ml
from miles_lora_ckpt_harness.sim.model import SimConfig
from miles_lora_ckpt_harness.sim.slots import SlotTrainer
from miles_lora_ckpt_harness.sim.snapshot import compare_digests, snapshot, snapshot_digests
from miles_lora_ckpt_harness.sim.train import build_run, teardown


class Args:
    lora_rank = 4
    lora_alpha = 4.0


def suite(payload: dict, ctx) -> dict:
    consensus = Consensus.for_world(timeout_s=120)
    out = {}
    sections = {"stale_shards": stale_shards, "faults": fault_matrix, "guards": guards, "retire": retire, "peft": peft}
    for name, section in sections.items():
        if name in payload:
            out[name] = section(payload[name], ctx, consensus)
    return out


def _build(config: dict):
    run = build_run(SimConfig.from_dict(config))
    return run, SlotTrainer(run)


def _kw(run, trainer, slot, consensus, **extra) -> dict:
    return {
        "slot": slot,
        "adapter_filter": trainer.adapter_filter(slot),
        "optimizer": run.optimizer,
        "opt_param_scheduler": trainer.schedulers[slot],
        "optimizer_children": trainer.children[slot],
        "consensus": consensus,
        **extra,
    }


def _train(trainer, slots, start, stop) -> None:
    for step in range(start, stop):
        for slot in slots:
            trainer.step(slot, step)


def _state(run, trainer) -> dict:
    digests = snapshot_digests(snapshot(run))
    for slot, scheduler in trainer.schedulers.items():
        digests[f"slot{slot}/scheduler"] = repr(sorted(scheduler.state_dict().items()))
    return digests


def _error(exc: CheckpointError) -> str:
    return str(exc)


# --------------------------------------------------------------------------- stale shards


class _StagingProbe:
    """An adapter source (the exporter's contract: prepare, export, conversion_helpers) that records,
    when the export runs, which tensor files the root's attempt directories hold, then yields a valid
    rank-4 LoRA factor pair (the export is made to fail before it is converted)."""

    kind = "test-staging-probe"

    def __init__(self, root: Path):
        self.root, self.seen = root, None

    def prepare(self) -> None:
        return None

    def export(self, model, on_item=None):
        import torch

        from miles_lora_ckpt.savers.peft_export import ExportedWeight

        staged = self.root.glob(".staging-*/**/*.safetensors")
        self.seen = sorted(str(p.relative_to(self.root)).split("/", 1)[1] for p in staged)
        weights = [
            ExportedWeight("model.layers.0.mlp.down_proj.lora_A.weight", torch.zeros(4, 8)),
            ExportedWeight("model.layers.0.mlp.down_proj.lora_B.weight", torch.zeros(8, 4)),
        ]
        for index, weight in enumerate(weights):
            if on_item is not None:
                on_item(index, weight)  # the exporter's `peft-export` fault point fires at item 0
        return weights

    def conversion_helpers(self):
        from miles_lora_ckpt.megatron.bridge_export import PeftHelpers

        return PeftHelpers()


def stale_shards(case: dict, ctx, consensus) -> dict:
    from miles_lora_ckpt.savers.peft_export import LoraSpec, PeftExport

    root = Path(case["root"])
    out = {}
    run, trainer = _build(case["ep4"])
    _train(trainer, [0, 1], 0, 2)
    ml.save_slot_checkpoint(run.model, Args(), root, step=2, reader_names=["step_2"], **_kw(run, trainer, 1, consensus))
    out_ep4_step2 = _state(run, trainer)
    _train(trainer, [0, 1], 2, 4)
    # the EP=4 attempt at step 4 writes every rank's shards, then fails inside the PEFT export on the
    # last rank; its coordinator never cleans up (as if killed there)
    probe = _StagingProbe(root)
    export = PeftExport(source=probe, lora=LoraSpec(r=4, alpha=4.0))
    discard, protocol._discard = protocol._discard, lambda staging: None
    faults.arm("peft-export", ctx.world_size - 1, "raise")
    try:
        ml.save_slot_checkpoint(
            run.model, Args(), root, step=4, reader_names=["step_4"], peft=export, **_kw(run, trainer, 1, consensus)
        )
        out["failed"] = None
    except CheckpointError as exc:
        out["failed"] = _error(exc)
    finally:
        faults.disarm()
        protocol._discard = discard
    out["staged_during_export"] = probe.seen  # what this rank's export saw in the attempt's staging
    staging = sorted(n for n in os.listdir(root) if n.startswith(".staging-"))
    out["stale_staging"] = staging
    out["stale_files"] = (
        sorted(str(p.relative_to(root / staging[0])) for p in (root / staging[0]).rglob("*.safetensors"))
        if staging
        else []
    )
    teardown(run)

    # restart at EP=1 (an EP=4 generation cannot be restored exactly at EP=1: the run starts over)
    # and save the same step again: published
    run, trainer = _build(case["ep1"])
    _train(trainer, [1], 0, 4)
    path = ml.save_slot_checkpoint(
        run.model, Args(), root, step=4, reader_names=["step_4"], **_kw(run, trainer, 1, consensus)
    )
    out["published"] = Path(path).name
    out["published_files"] = sorted(
        str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file() and p.name != "manifest.json"
    )
    out["links"] = ml.reader_links(root)
    out["miles_v1_scan"] = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    out["latest"] = ml.latest_slot_step(root, consensus=consensus)
    ep1_step4 = _state(run, trainer)
    teardown(run)
    # the published generation holds the EP=1 values: a fresh EP=1 run restores them bit for bit
    run, trainer = _build(case["ep1"])
    result = ml.load_slot_checkpoint(run.model, root, **_kw(run, trainer, 1, consensus))
    out["ep1_reload"] = [result.loaded, result.iteration, Path(result.path).name]
    out["ep1_reload_differs"] = _slot_differences(ep1_step4, _state(run, trainer), run, trainer, 1)
    teardown(run)

    # a later EP=4 load: refused (the newest generation is EP=1), nothing changed, stale shards never read
    run, trainer = _build(case["ep4"])
    before = _state(run, trainer)
    try:
        ml.load_slot_checkpoint(run.model, root, **_kw(run, trainer, 1, consensus))
        out["ep4_load"] = None
    except CheckpointError as exc:
        out["ep4_load"] = _error(exc)
    out["ep4_changed"] = compare_digests(before, _state(run, trainer))
    # the EP=4 step_2 generation is still loadable at EP=4, by name
    result = ml.load_slot_checkpoint(run.model, root, **_kw(run, trainer, 1, consensus, name="step_2"))
    out["ep4_step2"] = [result.loaded, result.iteration, result.optimizer_restored]
    out["ep4_step2_differs"] = _slot_differences(out_ep4_step2, _state(run, trainer), run, trainer, 1)
    teardown(run)
    return out


def _slot_differences(want: dict, got: dict, run, trainer, slot: int) -> list:
    """`[how many state entries of slot `slot` (adapter, masters, moments, steps, scheduler) were
    compared, those that differ]`."""
    names = sorted(want)
    mine = [n for n, s in zip(names, _slot_names(run, trainer, names), strict=True) if s == slot]
    return [len(mine), [n for n in mine if want[n] != got.get(n)]]


# --------------------------------------------------------------------------- faults


def fault_matrix(case: dict, ctx, consensus) -> dict:
    from miles_lora_ckpt.core import faults as fault_points

    root = Path(case["root"])
    run, trainer = _build(case["config"])
    _train(trainer, [0, 1], 0, 2)
    ml.save_slot_checkpoint(run.model, Args(), root, step=2, reader_names=["step_2"], **_kw(run, trainer, 1, consensus))
    previous = ml.reader_links(root)["step_2"]
    _train(trainer, [0, 1], 2, 3)
    out = {"save": {}, "load": {}}
    for phase in case["save_phases"]:
        for rank in range(ctx.world_size):
            fault_points.arm(phase, rank, "raise")
            try:
                ml.save_slot_checkpoint(
                    run.model, Args(), root, step=3, reader_names=["step_3"], **_kw(run, trainer, 1, consensus)
                )
                error = None
            except CheckpointError as exc:
                error = _error(exc)
            finally:
                fault_points.disarm()
            latest = ml.latest_slot_step(root, consensus=consensus)  # collective: the attempt is over everywhere
            links = ml.reader_links(root)
            out["save"][f"{phase}@{rank}"] = {
                "error": error,
                "previous_linked": links.get("step_2") == previous,
                "previous_exists": (root / previous / "manifest.json").is_file(),
                "staging": sorted(n for n in os.listdir(root) if n.startswith(".staging-")),
                "step_3": links.get("step_3"),
                "latest": latest,
            }
            # an attempt that did publish (after-publish) is undone by rank 0 once every rank has looked
            if ctx.rank == 0 and "step_3" in links:
                os.unlink(root / "step_3")
                shutil.rmtree(root / links["step_3"])
            consensus.agree("test-cleanup", Outcome.success())
    # loads: slot 1 from step_2 while slot 0 (its co-tenant) trained on; a failed load changes nothing
    _train(trainer, [0], 3, 4)
    for phase in case["load_phases"]:
        for rank in range(ctx.world_size):
            before = _state(run, trainer)
            fault_points.arm(phase, rank, "raise")
            try:
                ml.load_slot_checkpoint(run.model, root, **_kw(run, trainer, 1, consensus))
                error = None
            except CheckpointError as exc:
                error = _error(exc)
            finally:
                fault_points.disarm()
            out["load"][f"{phase}@{rank}"] = {"error": error, "changed": compare_digests(before, _state(run, trainer))}
    # and the load that then succeeds restores slot 1 and leaves slot 0 as it was
    before = _state(run, trainer)
    result = ml.load_slot_checkpoint(run.model, root, **_kw(run, trainer, 1, consensus))
    after = _state(run, trainer)
    changed = sorted(n for n in before if before[n] != after[n])
    out["good_load"] = {
        "iteration": result.iteration,
        "changed": changed,
        "slot_of": _slot_names(run, trainer, changed),
    }
    teardown(run)
    return out


def _slot_names(run, trainer, names) -> list:
    import re

    child_slot = {i: s for s, ix in trainer.children.items() for i in ix}
    slots = []
    for name in names:
        layer, child, own = (
            re.search(r"layers\.(\d+)\.", name),
            re.match(r"opt(\d+)/", name),
            re.match(r"slot(\d+)/", name),
        )
        if own:
            slots.append(int(own.group(1)))
        elif child:
            slots.append(child_slot.get(int(child.group(1))))
        elif layer:
            slots.append(run.config.slot_of(int(layer.group(1))))
        else:
            slots.append(None)
    return slots


# --------------------------------------------------------------------------- guards


def guards(case: dict, ctx, consensus) -> dict:
    root = Path(case["root"])
    run, trainer = _build(case["config"])
    _train(trainer, [0, 1], 0, 2)
    out = {}

    def attempt(name, fn):
        before = _state(run, trainer)
        try:
            fn()
            out[name] = {"error": None}
        except CheckpointError as exc:
            out[name] = {"error": _error(exc)}
        out[name]["changed"] = compare_digests(before, _state(run, trainer))
        out[name]["entries"] = sorted(os.listdir(root)) if root.exists() else []

    kw = _kw(run, trainer, 1, consensus)
    nothing = {**kw, "adapter_filter": lambda name: False}
    attempt("save_empty", lambda: ml.save_slot_checkpoint(run.model, Args(), root, step=2, **nothing))
    # the upstream bug: a filter that misses some of the slot's (slot-indexed) names
    slot_filter = trainer.adapter_filter(1)
    partial = {**kw, "adapter_filter": lambda name: slot_filter(name) and "linear_proj" not in name}
    attempt("save_partial", lambda: ml.save_slot_checkpoint(run.model, Args(), root, step=2, **partial))
    # a weights-only save of part of the slot (no children to disagree with) commits; loading it as
    # the whole slot is refused: it does not cover every parameter of the slot
    weights_only = {"slot": 1, "adapter_filter": partial["adapter_filter"], "consensus": consensus}
    ml.save_slot_checkpoint(run.model, Args(), root / "partial", step=2, **weights_only)
    attempt("load_partial", lambda: ml.load_slot_checkpoint(run.model, root / "partial", **kw))
    # ... and so is one whose files miss a whole kind of the slot's adapters (no expert file)
    dense_only = {**weights_only, "adapter_filter": lambda name: slot_filter(name) and ".experts." not in name}
    ml.save_slot_checkpoint(run.model, Args(), root / "dense-only", step=2, **dense_only)
    attempt("load_uncovered", lambda: ml.load_slot_checkpoint(run.model, root / "dense-only", **kw))
    # a slot-1 checkpoint loaded as slot 0
    ml.save_slot_checkpoint(run.model, Args(), root / "one", step=2, **kw)
    attempt(
        "load_other_slot", lambda: ml.load_slot_checkpoint(run.model, root / "one", **_kw(run, trainer, 0, consensus))
    )

    # a filter matching nothing at load
    attempt("load_empty", lambda: ml.load_slot_checkpoint(run.model, root / "one", **nothing))
    # a single-LoRA loader refuses a slot root, and the slot loader a single-LoRA root
    from miles_lora_ckpt.savers.single_lora import load_lora_checkpoint, save_lora_checkpoint

    attempt(
        "single_loads_slot",
        lambda: load_lora_checkpoint(run.model, root / "one", optimizer=run.optimizer, consensus=consensus),
    )
    save_lora_checkpoint(run.model, Args(), root / "single", optimizer=run.optimizer, iteration=2, consensus=consensus)
    attempt("slot_loads_single", lambda: ml.load_slot_checkpoint(run.model, root / "single", **kw))
    # a missing root loads nothing; latest_slot_step says None
    missing = ml.load_slot_checkpoint(run.model, root / "missing", **kw)
    out["missing"] = [missing.loaded, ml.latest_slot_step(root / "missing", consensus=consensus)]
    out["remap"] = _remap(run, trainer, root / "one", consensus)
    teardown(run)
    return out


def _swap_layers(name: str, source: int, target: int) -> str:
    """The harness's slot renamer: slot s is layer s here (2 layers, 2 slots)."""
    return re.sub(rf"(^|\.)layers\.{source}\.", rf"\g<1>layers.{target}.", name, count=1)


def _remap(run, trainer, one: Path, consensus) -> dict:
    """Slot 1's generation `one` (step 2) resumed into slot 0 (after slot 0 trained on to step 3),
    with slot 1 (the co-tenant at the saved index) untouched: this rank's digests, keyed as slot 0's."""
    _train(trainer, [0], 2, 3)
    before = _state(run, trainer)
    result = ml.load_slot_checkpoint(run.model, one, rename_slot=_swap_layers, **_kw(run, trainer, 0, consensus))
    after = _state(run, trainer)
    children = dict(zip(trainer.children[1], trainer.children[0], strict=True))

    def as_slot0(key: str) -> str:
        key = re.sub(r"^opt(\d+)/", lambda m: f"opt{children[int(m.group(1))]}/", key)
        return re.sub(r"(^|[./])layers\.1\.", r"\g<1>layers.0.", key.replace("slot1/", "slot0/"), count=1)

    slots = dict(zip(sorted(before), _slot_names(run, trainer, sorted(before)), strict=True))
    return {
        "loaded": [result.loaded, result.iteration, result.optimizer_restored, result.scheduler_restored],
        "saved": {as_slot0(k): v for k, v in before.items() if slots[k] == 1},  # slot 1 as saved
        "restored": {k: after[k] for k in after if slots.get(k) == 0},
        "before": {k: before[k] for k in before if slots[k] == 0},  # negative control: slot 0 at step 3
        "cotenant_changed": sorted(k for k in before if slots[k] == 1 and before[k] != after.get(k)),
        "others_changed": sorted(k for k in before if slots[k] not in (0, 1) and before[k] != after.get(k)),
    }


# --------------------------------------------------------------------------- retire


def retire(case: dict, ctx, consensus) -> dict:
    """A periodic save then the retire save of the same step: the link swapped, the slot cleared and
    its children reset, the co-tenant untouched; then registered again: exactly where it was."""
    root = Path(case["root"])
    run, trainer = _build(case["config"])
    _train(trainer, [0, 1], 0, 2)
    kw = _kw(run, trainer, 1, consensus)
    periodic = ml.save_slot_checkpoint(run.model, Args(), root, step=2, reader_names=["step_2"], **kw)
    before = _state(run, trainer)
    # the retire save takes the slot and the save as one value each (`SlotSpec`, `SlotSave`)
    spec = ml.SlotSpec.of(root, 1, kw["adapter_filter"], kw["optimizer_children"])
    live = {k: kw[k] for k in ("optimizer", "opt_param_scheduler", "consensus")}
    save = ml.SlotSave(step=2, reader_names=["step_2"])
    final = ml.retire_slot(run.model, Args(), spec, save, clear_slot=lambda: trainer.clear(1), **live)
    cleared = _state(run, trainer)
    changed = sorted(n for n in before if before[n] != cleared[n])
    slot1 = [n for n, p in run.named_parameters() if p.requires_grad and trainer.adapter_filter(1)("chunk0." + n)]
    params = dict(run.named_parameters())
    states = [
        state
        for i in trainer.children[1]
        for group in run.optimizer.chained_optimizers[i].optimizer.param_groups
        for p in group["params"]
        for state in run.optimizer.chained_optimizers[i].optimizer.state.get(p, {}).values()
    ]
    out = {
        "replaced": [Path(periodic).name != Path(final).name, ml.reader_links(root)["step_2"] == Path(final).name],
        "periodic_still_there": Path(periodic).is_dir(),
        "changed_slots": sorted(set(_slot_names(run, trainer, changed)), key=str),
        "slot1_zero": all(bool((params[n] == 0).all()) for n in slot1),
        "moments_zero": all(bool((t == 0).all()) for t in states if hasattr(t, "dim")),
    }
    ml.load_slot_checkpoint(run.model, root, **kw)
    out["registered_again"] = compare_digests(before, _state(run, trainer))
    teardown(run)
    return out


# --------------------------------------------------------------------------- PEFT


def peft(case: dict, ctx, consensus) -> dict:
    from miles_lora_ckpt.savers.peft_export import BridgeSource, LoraSpec, PeftExport, check_peft_dir
    from miles_lora_ckpt_harness import bridge_double
    from miles_lora_ckpt_harness.sim.train import config_from_dict

    bridge_double.install()  # the double: slot exports need expose_adapter_slot (Bridge main only, not 0.6.2)
    run = build_run(config_from_dict(case["config"]))
    lora = LoraSpec(r=run.config.lora_rank, alpha=run.config.lora_alpha, base_model_name_or_path=case["hf_base"])
    spec = PeftExport(source=BridgeSource(hf_checkpoint=case["hf_base"]), lora=lora)
    path = ml.save_slot_checkpoint(
        run.model,
        Args(),
        case["root"],
        slot=0,
        step=1,
        adapter_filter=lambda name: True,
        consensus=consensus,
        peft=spec,
        reader_names=["step_1"],
    )
    problems = check_peft_dir(Path(path) / "peft") if ctx.rank == 0 else []
    teardown(run)
    return {"path": path, "peft_files": sorted(os.listdir(Path(path) / "peft")), "problems": [str(p) for p in problems]}
