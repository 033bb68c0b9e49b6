"""Multi-LoRA per-slot checkpoints (savers/multi_lora), the harness side.

Unit tests (one process, no megatron): reader links published with a generation and swapped
atomically, the same step saved twice, stray / malformed / half-written entries never chosen and
never crashing the scan, retention removing links, the operator tools on slot roots, the demo's
schedule. Multi-rank (real megatron, gloo): one W=4 job (the stale-shard scenario: an EP=4 slot save fails
inside its PEFT export after its shards are staged, then EP=1), one W=2 job (fault injection at every save and load phase on every rank, the empty-shard
guard, a slot generation resumed into another slot index bit for bit, a slot saved with its PEFT export), and `demo --slots 2` killed mid-save and resumed
bit-exact per slot (with a negative control).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from jobs_paths import TESTS
from plan_reads import through_the_plan
from slot_kwargs import slot_kwargs as _kw

from miles_lora_ckpt.core import faults, protocol
from miles_lora_ckpt.core.consensus import Consensus, Outcome
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import MANIFEST, TRACKER, Topology
from miles_lora_ckpt.core.protocol import save_generation
from miles_lora_ckpt.savers import multi_lora as ml
from miles_lora_ckpt.savers.multi_lora import (
    SLOT_SAVER,
    check_reader_name,
    latest_slot_step,
    reader_links,
    v1_step_name,
)
from miles_lora_ckpt.tools.cli import main as cli
from miles_lora_ckpt_harness.sim.model import SimConfig
from miles_lora_ckpt_harness.sim.slots import SlotTrainer
from miles_lora_ckpt_harness.sim.snapshot import compare_digests, snapshot, snapshot_digests
from miles_lora_ckpt_harness.sim.train import build_run, teardown

# --------------------------------------------------------------------------- one process


def slot_save(root: Path, step: int, links=(), **kwargs) -> Path:
    """A slot generation as the protocol writes it (the files are not the point here)."""
    return save_generation(
        Consensus.single_process(),
        root,
        iteration=step,
        saver=SLOT_SAVER,
        topology=Topology(),
        write_files=lambda writer: writer.write_json("x.json", {"step": step}),
        metadata={"slot": {"index": 1, "step": step, "params": []}},
        links=links,
        **kwargs,
    )


def test_reader_links_follow_every_publish_and_the_same_step_twice_replaces_it(tmp_path):
    root = tmp_path / "checkpoints"
    first = slot_save(root, 2, links=["step_2"])
    assert os.readlink(root / "step_2") == first.name  # relative: the root can move
    again = slot_save(root, 2, links=["step_2"])  # the retire save of the same step
    assert again != first and os.readlink(root / "step_2") == again.name
    assert (root / "step_2").is_dir() and (root / "step_2" / MANIFEST).is_file()  # what Miles v1's scan sees
    assert reader_links(root) == {"step_2": again.name}
    assert latest_slot_step(root, consensus=Consensus.single_process()) == 2
    assert json.loads((root / TRACKER).read_text())["generation_dir"] == again.name
    slot_save(root, 4, links=["step_4", "tag-final"], keep=1)  # a v2 name beside the v1 one; retention
    assert reader_links(root) == {"step_4": os.readlink(root / "step_4"), "tag-final": os.readlink(root / "step_4")}
    assert not (root / first.name).exists() and not (root / again.name).exists()  # pruned, with its link
    assert cli(["verify", str(root / "step_4")]) == 0 and cli(["verify", str(root)]) == 0


def test_no_moment_without_a_link_a_failed_publish_leaves_the_old_one(tmp_path):
    root = tmp_path / "checkpoints"
    first = slot_save(root, 2, links=["step_2"])
    faults.arm("before-publish", 0, "raise")
    try:
        with pytest.raises(CheckpointError, match="before-publish"):
            slot_save(root, 2, links=["step_2"])
    finally:
        faults.disarm()
    assert (
        os.readlink(root / "step_2") == first.name and [n for n in os.listdir(root) if n.startswith(".staging")] == []
    )


def test_link_names_are_checked_and_a_real_directory_is_never_replaced(tmp_path):
    root = tmp_path / "checkpoints"
    for bad in ("gen-000000001-0123456789abcdef", ".staging-x", "a/b", "latest_generation.json", "", ".hidden"):
        with pytest.raises(ValueError):
            slot_save(root, 1, links=[bad])
        with pytest.raises(ValueError):
            check_reader_name(bad)
    assert v1_step_name(7) == "step_7" and check_reader_name("my_adapter-v2") == "my_adapter-v2"
    (root / "step_3").mkdir(parents=True)  # a stock Miles step_3 directory: never replaced by a link
    with pytest.raises(CheckpointError, match="not a symlink"):
        slot_save(root, 3, links=["step_3"])
    assert (root / "step_3").is_dir() and not (root / "step_3").is_symlink()


def test_stray_malformed_and_half_written_entries_never_crash_the_scan_and_are_never_chosen(tmp_path):
    root = tmp_path / "checkpoints"
    good = slot_save(root, 2, links=["step_2"])
    (root / "step_foo").mkdir()  # Miles v1's int(name.split("_")[1]) would raise here
    (root / "step_12_x").mkdir()
    (root / "step_9").mkdir()
    (root / "step_9" / "adapter_megatron_tp0_pp0.pt").write_bytes(b"junk")
    half = root / "gen-000000009-00000000000000aa"  # half-written: no manifest
    (half / "adapter").mkdir(parents=True)
    (half / "adapter" / "dense_tp000_pp000.safetensors").write_bytes(b"partial")
    torn = root / "gen-000000008-00000000000000bb"
    torn.mkdir()
    (torn / MANIFEST).write_text('{"format": "miles-lora-ckpt", "truncated')
    (root / ".staging-00000000000000cc").mkdir()
    (root / ".staging-00000000000000cc" / "x.json").write_text("{}")
    (root / "gen-garbage").mkdir()
    (root / "gen-000000010-00000000000000dd").write_text("a file named like a generation")
    os.symlink("gen-000000099-00000000000000ee", root / "step_99")  # dangling
    os.symlink("/etc", root / "step_5")  # pointing out of the root: not a reader link
    consensus = Consensus.single_process()
    assert latest_slot_step(root, consensus=consensus) == 2
    assert reader_links(root) == {"step_2": good.name, "step_99": "gen-000000099-00000000000000ee"}
    assert cli(["ls", str(root)]) == 0 and cli(["verify", str(root)]) == 0
    assert cli(["verify", str(root / "step_2")]) == 0
    assert cli(["gc", str(root), "--keep", "1", "--staging-min-age", "0"]) == 0
    assert not os.path.lexists(root / "step_99") and os.readlink(root / "step_2") == good.name  # dangling link gone
    assert latest_slot_step(root, consensus=consensus) == 2


def test_tools_understand_a_directory_of_slot_roots(tmp_path, capsys):
    save_dir = tmp_path / "adapters"
    a = slot_save(save_dir / "alpha" / "checkpoints", 3, links=["step_3"])
    slot_save(save_dir / "beta" / "checkpoints", 4, links=["step_4"])
    capsys.readouterr()
    assert cli(["ls", str(save_dir / "alpha" / "checkpoints")]) == 0
    out = capsys.readouterr().out
    assert f"{a.name}  [slot 1]  <- step_3  <- tracker" in out
    assert cli(["verify", str(save_dir)]) == 0
    out = capsys.readouterr().out
    assert "== " + str(save_dir / "alpha" / "checkpoints") in out and out.count("\nOK ") + out.startswith("OK ") == 2
    assert cli(["ls", "--json", str(save_dir / "beta" / "checkpoints")]) == 0
    rows = json.loads(capsys.readouterr().out)["entries"]
    assert rows[0]["links"] == ["step_4"] and rows[0]["slot"] == 1
    assert cli(["inspect", str(save_dir / "alpha" / "checkpoints" / "step_3")]) == 0
    assert "saver multi-lora-slot" in capsys.readouterr().out
    (save_dir / "beta" / "checkpoints" / a.name).mkdir()  # damage: an empty generation directory
    assert cli(["verify", "--all", str(save_dir)]) == 1  # the worst root wins
    assert cli(["gc", str(save_dir), "--keep", "1", "--dry-run"]) == 0


def test_the_demo_schedule_retires_and_re_registers_the_last_slot():
    from miles_lora_ckpt_harness.demo.slots import cadence, plan_schedule

    events = plan_schedule(2, 8, 2)
    marks = [e for e in events if e[0] != "train"]
    assert marks == [
        ["save", 1, 2],
        ["retire", 1, 2],  # the same step saved twice
        ["save", 0, 3],
        ["register", 1, 2],
        ["save", 1, 4],
        ["save", 0, 6],
        ["save", 1, 6],
    ]
    for slot in (0, 1):  # every slot trains each of its steps exactly once, in order
        assert [e[2] for e in events if e[0] == "train" and e[1] == slot] == list(range(8))
    assert cadence(0, 2, 2) != cadence(1, 2, 2)


# --------------------------------------------------------------------------- multi-rank (megatron)

megatron = [pytest.mark.megatron, pytest.mark.multirank]
CONFIG = {"world_size": 2, "slots": 2, "adapters": "mixed", "distributed": False}


# ---- rank jobs: run in the workers as "test_multi_lora:suite" (the tests directory on their sys.path)
#
# Worker functions for the multi-LoRA tests (savers/multi_lora): one job runs many cases (`suite`).
#
# Sections (each named in the payload):
# - `stale_shards` (W=4): an EP=4 slot save with a PEFT export writes every rank's shards into its
#   attempt's staging directory, then fails inside the export on rank 3 (the exporter's `peft-export`
#   fault; the export sees the staged shards), with its coordinator gone (its staging directory left
#   behind, as after a SIGKILL); the run restarts at EP=1, trains, saves the same step and publishes;
#   a later EP=4 load resolves exactly that EP=1 generation, refuses it (the layout differs), changes
#   nothing and never reads the stale shards; the EP=1 generation restores the EP=1 values bit for
#   bit, and the EP=4 step-2 generation (by name) the EP=4 values.
# - `faults` (W=2): a `raise` fault at every save phase (prepare included) and every load phase on
#   every rank: the same CheckpointError on every rank, the previous generation intact and still
#   the one resumed, and a failed load changes neither the slot nor its co-tenant.
# - `guards` (W=2): the empty-shard guard (save: a filter matching nothing, a filter missing some of
#   the slot's parameters; load: a slot checkpoint that does not cover every parameter of the slot,
#   one of another slot index), each refused on every rank with nothing changed; then a slot-1
#   generation resumed into slot 0 (`rename_slot`), bit for bit, its co-tenant at index 1 untouched
#   (planned from the global layout through the model view), and refused into a TP 2 run.
# - `peft` (W=2): a slot saved with `peft=` holds an HF PEFT adapter directory.


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
    out["remap_tp2"] = _remap_at_tp2(case["config"], root / "one", consensus)
    return out


def _swap_layers(name: str, source: int, target: int) -> str:
    """The harness's slot renamer: slot s is layer s here (2 layers, 2 slots)."""
    return re.sub(rf"(^|\.)layers\.{source}\.", rf"\g<1>layers.{target}.", name, count=1)


def _remap(run, trainer, one: Path, consensus) -> dict:
    """Slot 1's generation `one` (step 2) resumed into slot 0 (after slot 0 trained on to step 3),
    with slot 1 (the co-tenant at the saved index) untouched: this rank's digests, keyed as slot 0's."""
    _train(trainer, [0], 2, 3)
    before = _state(run, trainer)
    with through_the_plan() as plan:
        result = ml.load_slot_checkpoint(run.model, one, rename_slot=_swap_layers, **_kw(run, trainer, 0, consensus))
    after = _state(run, trainer)
    children = dict(zip(trainer.children[1], trainer.children[0], strict=True))

    def as_slot0(key: str) -> str:
        key = re.sub(r"^opt(\d+)/", lambda m: f"opt{children[int(m.group(1))]}/", key)
        return re.sub(r"(^|[./])layers\.1\.", r"\g<1>layers.0.", key.replace("slot1/", "slot0/"), count=1)

    slots = dict(zip(sorted(before), _slot_names(run, trainer, sorted(before)), strict=True))
    return {
        "loaded": [result.loaded, result.iteration, result.optimizer_restored, result.scheduler_restored],
        "through_plan": plan,  # planned from the global layout through the model view, and what it read
        "saved": {as_slot0(k): v for k, v in before.items() if slots[k] == 1},  # slot 1 as saved
        "restored": {k: after[k] for k in after if slots.get(k) == 0},
        "before": {k: before[k] for k in before if slots[k] == 0},  # negative control: slot 0 at step 3
        "cotenant_changed": sorted(k for k in before if slots[k] == 1 and before[k] != after.get(k)),
        "others_changed": sorted(k for k in before if slots[k] not in (0, 1) and before[k] != after.get(k)),
    }


def _remap_at_tp2(config: dict, one: Path, consensus) -> dict:
    """Slot 1's generation `one` (saved at TP 1) into slot 0 of a TP 2 run through `rename_slot`:
    the error, and whether anything changed (a renamer names this layout's parameters)."""
    run, trainer = _build({**config, "tp": 2})
    before = _state(run, trainer)
    try:
        ml.load_slot_checkpoint(run.model, one, rename_slot=_swap_layers, **_kw(run, trainer, 0, consensus))
        error = None
    except CheckpointError as exc:
        error = _error(exc)
    changed = compare_digests(before, _state(run, trainer))
    teardown(run)
    return {"error": error, "changed": changed}


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


def run_suite(world: int, payload: dict) -> list[dict]:
    from miles_lora_ckpt_harness.sim.launch import check_all, run_workers

    results = run_workers(world, "test_multi_lora:suite", payload, sys_path=[TESTS], timeout_s=500)
    return check_all(results)


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    from miles_lora_ckpt.core.faults import LOAD_PHASES, PREPARE_PHASES, SAVE_PHASES
    from miles_lora_ckpt_harness.sim.hf_base import build_tiny_qwen2
    from miles_lora_ckpt_harness.sim.qwen2_model import Qwen2SimConfig

    base = tmp_path_factory.mktemp("multi_lora_w2")
    build_tiny_qwen2(base / "hf-base", Qwen2SimConfig().hf_config_kwargs())
    payload = {
        "faults": {
            "root": str(base / "faults"),
            "config": CONFIG,
            "save_phases": list(PREPARE_PHASES + SAVE_PHASES),
            "load_phases": list(LOAD_PHASES),
        },
        "guards": {"root": str(base / "guards"), "config": CONFIG},
        "retire": {"root": str(base / "retire"), "config": CONFIG},
        "peft": {
            "root": str(base / "peft"),
            "config": {"model": "qwen2", "world_size": 2},
            "hf_base": str(base / "hf-base"),
        },
    }
    return run_suite(2, payload)


@pytest.mark.megatron
@pytest.mark.multirank
def test_stale_shards_of_a_failed_ep4_attempt_are_never_promoted_nor_read(tmp_path):
    ep4 = {**CONFIG, "world_size": 4, "ep": 4}
    results = run_suite(
        4, {"stale_shards": {"root": str(tmp_path / "slot"), "ep4": ep4, "ep1": {**CONFIG, "world_size": 4}}}
    )
    for rank, result in enumerate(results):
        r = result["stale_shards"]
        assert r == results[0]["stale_shards"], rank  # every rank saw the same
        assert "'peft-export' on rank 3" in r["failed"]  # failed inside the export ...
        # ... after every rank's shards of that attempt were staged: the export saw them on disk
        seen = results[rank]["stale_shards"]["staged_during_export"]
        assert (
            "adapter/expert_pp000_ep003_etp000.safetensors" in seen and "adapter/dense_tp000_pp000.safetensors" in seen
        )
        assert not any("adapter_model" in f for f in seen)  # the PEFT files were never written
        # the failed EP=4 attempt left its shards behind (its coordinator never cleaned up)
        assert len(r["stale_staging"]) == 1 and "adapter/expert_pp000_ep003_etp000.safetensors" in r["stale_files"]
        # EP=1 saved the same step: a new attempt directory, only EP=1 shards published
        assert not any("_ep001" in f or "_ep002" in f or "_ep003" in f for f in r["published_files"]), r[
            "published_files"
        ]
        assert "adapter/expert_pp000_ep000_etp000.safetensors" in r["published_files"]
        assert (
            r["links"]["step_4"] == r["published"] and r["miles_v1_scan"] == ["step_2", "step_4"] and r["latest"] == 4
        )
        # a later EP=4 load refuses the EP=1 generation on every rank, changing nothing
        assert "ep: 1 -> 4 (expert parallel)" in r["ep4_load"] and "rank(s) [0, 1, 2, 3]" in r["ep4_load"]
        assert r["ep4_changed"] is None
        assert r["ep4_step2"] == [True, 2, True]  # the EP=4 generation by its name: restored ...
        assert r["ep4_step2_differs"][0] > 0 and r["ep4_step2_differs"][1] == []  # ... bit for bit
        # the published step 4 holds the EP=1 run's values: an EP=1 load restores them bit for bit
        assert r["ep1_reload"] == [True, 4, r["published"]] and r["ep1_reload_differs"][1] == []
        assert r["ep1_reload_differs"][0] > 0  # slot 1's adapter, masters, moments, steps, scheduler compared


@pytest.mark.megatron
@pytest.mark.multirank
def test_faults_at_every_save_phase_on_every_rank_keep_the_previous_generation(w2):
    saves = w2[0]["faults"]["save"]
    assert len(saves) == 8 * 2
    for case, r in saves.items():
        phase, rank = case.split("@")
        assert all(res["faults"]["save"][case]["error"] == r["error"] for res in w2), case  # the same everywhere
        assert r["error"] and f"'{phase}' on rank {rank}" in r["error"], case
        assert r["previous_linked"] and r["previous_exists"] and r["staging"] == [], case
        if phase == "after-publish":  # already published when the fault fired: the new one is complete
            assert r["step_3"] is not None and r["latest"] == 3, case
        else:
            assert r["step_3"] is None and r["latest"] == 2, case


@pytest.mark.megatron
@pytest.mark.multirank
def test_a_failed_load_changes_neither_the_slot_nor_its_co_tenant(w2):
    for rank, result in enumerate(w2):
        loads = result["faults"]["load"]
        assert len(loads) == 2 * 2
        for case, r in loads.items():
            phase, failing = case.split("@")
            assert r["error"] == w2[0]["faults"]["load"][case]["error"] and f"'{phase}' on rank {failing}" in r["error"]
            assert r["changed"] is None, (rank, case, r["changed"])
        good = result["faults"]["good_load"]
        assert good["iteration"] == 2 and good["changed"]  # the slot moved back to step 2 ...
        assert set(good["slot_of"]) == {1}, good  # ... and nothing of slot 0 changed


@pytest.mark.megatron
@pytest.mark.multirank
def test_the_empty_shard_guard_refuses_on_every_rank(w2):
    for result in w2:
        g = result["guards"]
        for case in g:
            if case not in ("missing", "remap"):
                assert g[case]["error"] == w2[0]["guards"][case]["error"] and g[case]["changed"] is None, case
        assert "empty slot shard" in g["save_empty"]["error"] and "rank(s) [0, 1]" in g["save_empty"]["error"]
        assert "incomplete slot shard" in g["save_partial"]["error"] and "linear_proj" in g["save_partial"]["error"]
        assert not any(n.startswith(("gen-", "step_")) for n in g["save_partial"]["entries"])  # nothing written
        assert (
            "adapter names differ: missing" in g["load_partial"]["error"]
            and "linear_proj" in g["load_partial"]["error"]
        )
        assert "does not cover every parameter of the slot" in g["load_uncovered"]["error"]
        assert "holds slot 1, not slot 0" in g["load_other_slot"]["error"]
        assert "empty slot shard" in g["load_empty"]["error"]
        assert "saver 'multi-lora-slot', not 'single-lora'" in g["single_loads_slot"]["error"]
        assert "saver 'single-lora', not 'multi-lora-slot'" in g["slot_loads_single"]["error"]
        assert g["missing"] == [False, None]


@pytest.mark.megatron
@pytest.mark.multirank
def test_a_slot_generation_resumes_bit_exact_into_another_slot_index_its_co_tenant_untouched(w2):
    def over_ranks(part: str) -> dict:  # LayerWise: slot 0's whole params sit on other ranks than slot 1's
        merged: dict = {}
        for result in w2:
            for key, digest in result["guards"]["remap"][part].items():
                merged.setdefault(key, []).append(digest)
        return {key: sorted(digests) for key, digests in merged.items()}

    saved, restored, before = over_ranks("saved"), over_ranks("restored"), over_ranks("before")
    assert sorted(saved) == sorted(restored), sorted(set(saved) ^ set(restored))
    assert any("/state/" in k for k in saved) and "slot0/scheduler" in saved
    assert [k for k in saved if saved[k] != restored[k]] == []  # every tensor, counter, group, scheduler
    assert [k for k in saved if saved[k] != before[k]]  # negative control: slot 0 held other values
    for result in w2:
        r = result["guards"]["remap"]
        assert r["loaded"] == [True, 2, True, True]
        # planned from the global layout through the view (`param_blocks.describe`), reading exactly
        # the files the reader of each rank's own files reads at the saved layout
        assert r["through_plan"]["planned"] and r["through_plan"]["same_files"], r["through_plan"]
        assert r["cotenant_changed"] == [] and r["others_changed"] == []  # slot 1, now at the saved index
        # through rename_slot at another layout: refused on every rank, saying why, nothing changed
        other = result["guards"]["remap_tp2"]
        assert other["changed"] is None, other
        assert "tp: 1 -> 2 (tensor parallel)" in other["error"], other["error"]
        assert "a slot resumes into another slot index (rename_slot) at its saved layout only" in other["error"]


@pytest.mark.megatron
@pytest.mark.multirank
def test_retire_replaces_the_same_step_resets_only_the_slot_and_registers_back_exactly(w2):
    for result in w2:
        r = result["retire"]
        assert r["replaced"] == [True, True] and r["periodic_still_there"]  # a new generation, the link swapped
        assert r["changed_slots"] == [1], r["changed_slots"]  # slot 0 (the co-tenant) untouched
        assert r["slot1_zero"] and r["moments_zero"]
        assert r["registered_again"] is None  # restored bit for bit from the retire save


@pytest.mark.megatron
@pytest.mark.multirank
def test_a_slot_saved_with_its_peft_export(w2):
    r = w2[0]["peft"]
    assert r["peft_files"] == ["adapter_config.json", "adapter_model.safetensors"] and r["problems"] == []
    assert cli(["verify", r["path"]]) == 0  # verify also checks the PEFT adapter in it


@pytest.mark.megatron
@pytest.mark.multirank
@pytest.mark.skipif(
    os.environ.get("MILES_LORA_CKPT_TIER") == "mcore-0.19",
    reason="tier 2 runs the slot jobs above (save, load, retire on 0.19's LayerWise); the demo runs on tier 1",
)
def test_demo_slots_killed_mid_save_resumes_every_slot_bit_exact(tmp_path, capsys):
    args = ["demo", "--slots", "2", "--workdir", str(tmp_path), "--crash-at", "before-publish", "--crash-rank", "0"]
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == "RESULT: bit-exact"
    assert "killed by signal 9 (crash injected at before-publish)" in out
    assert "retire slot1@2" in out and "register slot1@2" in out
    assert "slot0: restored adapter, fp32 masters + moments, scheduler from gen-000000006" in out
    assert (
        "slot1: restored adapter, fp32 masters + moments, scheduler from gen-000000004" in out
    )  # after re-registering
    roots = tmp_path / "ckpt" / "adapters"
    assert sorted(reader_links(roots / "slot1" / "checkpoints")) == ["step_2", "step_4"]  # step_6 never published
    assert cli(["verify", str(roots)]) == 0
    # negative control: one differing tensor of slot 1 in the reference is found and named
    reference = json.loads((tmp_path / "reference.json").read_text())
    name = next(n for n in sorted(reference["digests"]["0"]) if "layers.1." in n)
    reference["digests"]["0"][name] = "0" * 64
    (tmp_path / "reference.json").write_text(json.dumps(reference))
    capsys.readouterr()
    assert cli(["demo", "--slots", "2", "--workdir", str(tmp_path), "--phase", "resume"]) == 1
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == f"RESULT: MISMATCH slot1:rank0:{name}" and "slot0: " in out


def test_bad_arguments_fail_collectively_before_anything_is_touched(tmp_path):
    from miles_lora_ckpt.savers.multi_lora import load_slot_checkpoint, save_slot_checkpoint

    one = Consensus.single_process()
    cases = [
        dict(slot=-1, step=2, adapter_filter=lambda n: True),
        dict(slot=0, step=2.5, adapter_filter=lambda n: True),
        dict(slot=0, step=2, adapter_filter=None),
        dict(slot=0, step=2, adapter_filter=lambda n: True, reader_names=["gen-000000002-0123456789abcdef"]),
    ]
    for case in cases:  # the model is never looked at: None would fail any later phase differently
        with pytest.raises(CheckpointError, match="checkpoint phase 'arguments' failed"):
            save_slot_checkpoint(None, None, tmp_path / "root", consensus=one, **case)
    with pytest.raises(CheckpointError, match="checkpoint phase 'arguments' failed"):
        load_slot_checkpoint(None, tmp_path / "root", slot=True, adapter_filter=lambda n: True, consensus=one)
    assert not (tmp_path / "root").exists()


def test_a_slot_remap_shows_the_loader_the_saved_slot_names_and_children_and_refuses_what_differs():
    import re
    from types import SimpleNamespace

    import torch

    from miles_lora_ckpt.core.errors import IncompatibleCheckpoint
    from miles_lora_ckpt.megatron.optimizer_children import leaf_children
    from miles_lora_ckpt.savers.multi_lora import rename_by_pattern
    from miles_lora_ckpt.savers.multi_lora.remap import SlotRemap, model_view, optimizer_view

    rename = rename_by_pattern(re.compile(r"\.adapter\.adapters\.(\d+)\."))
    remap = SlotRemap(saved=1, slot=2, rename=rename)  # saved from slot 1, loading into slot 2

    def name(slot: int) -> str:
        return f"fc1.adapter.adapters.{slot}.linear_in.weight"

    assert [remap.view_name(name(s)) for s in (0, 1, 2)] == [name(0), name(2), name(1)]  # a swap
    assert remap.view_name("fc1.adapter.adapters.12.linear_in.weight").endswith("adapters.12.linear_in.weight")
    in_slot_2 = remap.view_filter(lambda n: ".adapters.2." in n)
    assert in_slot_2(name(1)) and not in_slot_2(name(2))  # the loading slot's params under saved names

    adapters = torch.nn.ModuleList(torch.nn.ModuleDict({"linear_in": torch.nn.Linear(2, 2)}) for _ in range(3))
    model = torch.nn.Module()
    model.fc1 = torch.nn.Module()
    model.fc1.adapter = torch.nn.Module()
    model.fc1.adapter.adapters = adapters
    real = dict(model.named_parameters())
    viewed = dict(model_view(model, remap)[0].named_parameters())
    assert viewed[name(1)] is real[name(2)] and viewed[name(2)] is real[name(1)] and viewed[name(0)] is real[name(0)]
    assert real[name(1)] is not real[name(2)]  # negative control: unmapped, slot 1's names are another slot's
    with pytest.raises(ValueError, match="collide"):  # a renamer that is no swap
        model_view(model, SlotRemap(1, 2, lambda n, a, b: name(0)))

    # the chain: slot s has children [2s, 2s + 1]; the saved [2, 3] stand for slot 2's [4, 5]
    chain = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=object()) for _ in range(6)])
    leaves = [c.optimizer for c in leaf_children(chain)]
    view, children = optimizer_view(chain, [2, 3], [4, 5])
    assert children == [2, 3]
    assert [c.optimizer for c in leaf_children(view)] == [leaves[i] for i in (0, 1, 4, 5, 2, 3)]
    assert [c.index for c in leaf_children(view)] == list(range(6))
    view, children = optimizer_view(chain, [2, 3], [3, 4])  # overlapping: still a permutation
    assert children == [2, 3] and [c.optimizer for c in leaf_children(view)] == [leaves[i] for i in (0, 1, 3, 4, 2, 5)]
    with pytest.raises(IncompatibleCheckpoint, match="do not correspond one-to-one"):
        optimizer_view(chain, [2, 3], [4])
    with pytest.raises(IncompatibleCheckpoint, match="this chain has 6"):
        optimizer_view(chain, [6, 7], [4, 5])
