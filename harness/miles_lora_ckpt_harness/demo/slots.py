"""`miles-lora-ckpt demo --slots N`: multi-LoRA on the CPU harness, killed mid-save, resumed per slot, bit-exact.

N adapter slots share one base model, whose layers the harness deals round-robin to the slots. Each
slot has its own LayerWise children and scheduler, and trains on its own data, one slot at a time,
as Miles' multi-LoRA steps them (`sim.slots`). Each slot has its own slot root
`DIR/ckpt/adapters/slot<k>/checkpoints`, as Miles v1's `{save}/adapters/{name}/checkpoints`. Each
has its own cadence: the last slot saves every --save-every steps, slot k < N-1 every --save-every +
1 + k. The last slot is retired right after its first save, with a final save of the same step that
replaces the generation atomically. It sits out one round and is registered again, restored from its
slot root, while the others train on.

    reference  every slot trains --steps steps, uninterrupted, never retired -> DIR/reference.json
    train      the schedule above with every save and the retirement; with --crash-at, rank
               --crash-rank SIGKILLs itself at that protocol phase of the last save
    resume     fresh processes restore every slot from its own root (its newest intact generation,
               agreed by every rank), train each to --steps, and compare every tensor per slot
               (adapter, fp32 masters, every moment, steps, param groups, the slot's scheduler)
    all        reference, train with a crash in the middle of the last save, resume (the default)

The last line is `RESULT: bit-exact` (every slot), `RESULT: MISMATCH slot<k>:<tensor>` or
`RESULT: ERROR <reason>`. `--chain-slots 2` is the single-LoRA demo with two slots' children saved
together as one generation (the chain case).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

RETIRED_IDLE_ROUNDS = 1


def check_args(args) -> str | None:
    """A usage error of `--slots`, or None."""
    if args.slots < 1 or args.slots > 4:
        return "--slots must be between 1 and 4"
    if args.pp != 1 or args.vpp != 1:
        return "--slots needs --pp 1 (Miles' multi-LoRA requires PP == 1)"
    if args.optimizer == "muon" or args.distributed_optimizer or args.layer_wise or args.export_peft:
        return "--slots builds Miles' per-slot Adam/Lion LayerWise chain: drop --optimizer muon, " + (
            "--distributed-optimizer, --layer-wise and --export-peft"
        )
    if args.chain_slots != 1:
        return "--slots and --chain-slots are two different demos: pick one"
    return None


def cadence(slot: int, slots: int, save_every: int) -> int:
    """Save every this many of the slot's own steps (the retiring last slot: --save-every)."""
    return save_every if slot == slots - 1 else save_every + 1 + slot


def plan_schedule(slots: int, steps: int, save_every: int) -> list[list]:
    """The train phase's events, in order: `["train", slot, step]` (the slot's step-th step),
    `["save", slot, step]`, `["retire", slot, step]`, `["register", slot, step]`. Rounds: every
    active slot trains one step per round; the last slot retires after its first save, sits out
    RETIRED_IDLE_ROUNDS rounds, and is registered again."""
    events, done, retire = [], [0] * slots, slots - 1
    retired_round, registered, rnd = None, False, 0
    while any(d < steps for d in done):
        rnd += 1
        away = retired_round is not None and not registered
        if away and rnd > retired_round + RETIRED_IDLE_ROUNDS:
            events.append(["register", retire, done[retire]])
            registered, away = True, False
        for slot in range(slots):
            if done[slot] >= steps or (away and slot == retire):
                continue
            events.append(["train", slot, done[slot]])
            done[slot] += 1
            if done[slot] < steps and done[slot] % cadence(slot, slots, save_every) == 0:
                events.append(["save", slot, done[slot]])
                if slot == retire and retired_round is None:
                    events.append(["retire", slot, done[slot]])
                    retired_round = rnd
    return events


def slot_root(ckpt: Path | str, slot: int) -> Path:
    return Path(ckpt) / "adapters" / f"slot{slot}" / "checkpoints"


# =========================================================================== parent side


def run(args, config: dict, workdir: Path) -> int:
    """The three phases (see the module docstring); returns the exit code."""
    crash_at = args.crash_at or ("mid-write" if args.phase == "all" else None)
    crash_rank = args.world_size - 1 if args.crash_rank is None else args.crash_rank
    events = plan_schedule(args.slots, args.steps, args.save_every)
    cadences = ", ".join(f"slot{k} every {cadence(k, args.slots, args.save_every)}" for k in range(args.slots))
    print(f"multi-LoRA: {args.slots} slots, cadences {cadences}, slot{args.slots - 1} retired after its first save")
    if args.phase in ("all", "reference"):
        _reference(workdir, config, args)
    if args.phase in ("all", "train"):
        _train(workdir, config, args, events, crash_at, crash_rank)
    if args.phase in ("all", "resume"):
        return _resume(workdir, config, args)
    print("RESULT: reference written" if args.phase == "reference" else "RESULT: trained")
    return 0


def _job(name: str, config: dict, payload: dict, args):
    from miles_lora_ckpt_harness.sim.launch import run_workers

    started = time.monotonic()
    results = run_workers(
        config["world_size"], f"miles_lora_ckpt_harness.demo.slots:{name}", payload, timeout_s=args.timeout
    )
    return results, time.monotonic() - started


def _reference(workdir: Path, config: dict, args) -> None:
    from miles_lora_ckpt_harness.sim.launch import check_all

    results, seconds = _job("reference_job", config, {"config": config, "steps": args.steps}, args)
    per_rank = check_all(results)
    reference = {
        "config": config,
        "steps": args.steps,
        "digests": {str(r): res["digests"] for r, res in enumerate(per_rank)},
    }
    (workdir / "reference.json").write_text(json.dumps(reference, indent=1))
    print(f"reference: every slot {args.steps} uninterrupted steps in {seconds:.1f}s -> {workdir / 'reference.json'}")


def _train(workdir: Path, config: dict, args, events: list, crash_at, crash_rank: int) -> None:
    from miles_lora_ckpt_harness.demo.report import report_train

    ckpt = workdir / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    payload = {"config": config, "events": events, "ckpt": str(ckpt), "crash_at": crash_at, "crash_rank": crash_rank}
    results, seconds = _job("train_job", config, payload, args)
    shown = [f"{e[0]} slot{e[1]}@{e[2]}" for e in events if e[0] != "train"]
    print(f"train: {'; '.join(shown)} ({seconds:.1f}s)")
    report_train(results, crash_at)


def _resume(workdir: Path, config: dict, args) -> int:
    from miles_lora_ckpt_harness.sim.launch import check_all

    reference = json.loads((workdir / "reference.json").read_text())
    if reference["config"] != config:
        print("ERROR reference.json was made with another configuration; rerun --phase reference", file=sys.stderr)
        return 2
    payload = {"config": config, "steps": reference["steps"], "ckpt": str(workdir / "ckpt")}
    results, seconds = _job("resume_job", config, payload, args)
    per_rank = check_all(results)
    if "refused" in per_rank[0]:
        print(f"RESULT: ERROR {per_rank[0]['refused']}")
        return 1
    print(f"resume ({seconds:.1f}s):")
    first = None
    for slot in range(args.slots):
        compared, mismatch = 0, None
        for rank, result in enumerate(per_rank):
            expected, got = reference["digests"][str(rank)], result["digests"]
            names = sorted(n for n in set(expected) | set(got) if result["slot_of"].get(n) == slot)
            compared += len(names)
            mismatch = mismatch or next((f"rank{rank}:{n}" for n in names if expected.get(n) != got.get(n)), None)
        verdict = "bit-exact" if mismatch is None else f"MISMATCH {mismatch}"
        print(f"  slot{slot}: {per_rank[0]['restored'][str(slot)]}; {compared} tensors -> {verdict}")
        first = first or (None if mismatch is None else f"slot{slot}:{mismatch}")
    if first is None:
        print("compared every slot's adapter, fp32 masters, every moment, steps, param groups and scheduler")
        print("RESULT: bit-exact")
        return 0
    print(f"RESULT: MISMATCH {first}")
    return 1


# =========================================================================== worker side


class _Args:
    """The few Miles args the saver reads."""

    lora_rank = 4
    lora_alpha = 4.0


def _build(payload: dict):
    from miles_lora_ckpt_harness.sim.model import SimConfig
    from miles_lora_ckpt_harness.sim.slots import SlotTrainer
    from miles_lora_ckpt_harness.sim.train import build_run

    run = build_run(SimConfig.from_dict(payload["config"]))
    return run, SlotTrainer(run)


def _slot_kwargs(run, trainer, slot: int, consensus) -> dict:
    return {
        "slot": slot,
        "adapter_filter": trainer.adapter_filter(slot),
        "optimizer": run.optimizer,
        "opt_param_scheduler": trainer.schedulers[slot],
        "optimizer_children": trainer.children[slot],
        "consensus": consensus,
    }


def _digests(run, trainer) -> tuple[dict, dict]:
    """Every tensor's digest, and which slot each belongs to."""
    import re

    from miles_lora_ckpt_harness.sim.snapshot import _json_tensor, snapshot, snapshot_digests

    snap = snapshot(run)
    for slot, scheduler in trainer.schedulers.items():
        snap[f"slot{slot}/scheduler"] = _json_tensor(scheduler.state_dict())
    digests = snapshot_digests(snap)
    child_slot = {i: slot for slot, ix in trainer.children.items() for i in ix}
    slot_of = {}
    for name in digests:
        layer = re.search(r"layers\.(\d+)\.", name)
        child = re.match(r"opt(\d+)/", name)
        owner = re.match(r"slot(\d+)/", name)
        if owner:
            slot_of[name] = int(owner.group(1))
        elif child:
            slot_of[name] = child_slot.get(int(child.group(1)))
        elif layer:
            slot_of[name] = run.config.slot_of(int(layer.group(1)))
    return digests, slot_of


def reference_job(payload: dict, ctx) -> dict:
    run, trainer = _build(payload)
    for step in range(payload["steps"]):
        for slot in trainer.slots:
            trainer.step(slot, step)
    digests, slot_of = _digests(run, trainer)
    return {"digests": digests, "slot_of": slot_of}


def train_job(payload: dict, ctx) -> dict:
    from miles_lora_ckpt.core import faults
    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt.savers.multi_lora import SlotSave, SlotSpec, load_slot, retire_slot, save_slot, v1_step_name

    run, trainer = _build(payload)
    consensus = Consensus.for_world(timeout_s=60)
    events = payload["events"]
    last_save = max(i for i, e in enumerate(events) if e[0] == "save")
    written = []
    for index, (kind, slot, step) in enumerate(events):
        spec = SlotSpec.of(slot_root(payload["ckpt"], slot), slot, trainer.adapter_filter(slot), trainer.children[slot])
        live = {"optimizer": run.optimizer, "opt_param_scheduler": trainer.schedulers[slot], "consensus": consensus}
        if kind == "train":
            trainer.step(slot, step)
        elif kind in ("save", "retire"):
            if index == last_save and payload["crash_at"] and ctx.rank == payload["crash_rank"]:
                faults.arm(payload["crash_at"], ctx.rank, "kill")
            save = SlotSave(step=step, reader_names=[v1_step_name(step)])
            if kind == "retire":
                path = retire_slot(run.model, _Args(), spec, save, clear_slot=lambda s=slot: trainer.clear(s), **live)
            else:
                path = save_slot(run.model, _Args(), spec, save, **live)
            written.append(f"slot{slot}:{Path(path).name}" + (" (retire)" if kind == "retire" else ""))
        elif kind == "register":
            result = load_slot(run.model, spec, **live)
            written.append(f"slot{slot} registered from step {result.iteration}")
    return {"summary": ", ".join(written)}


def resume_job(payload: dict, ctx) -> dict:
    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt.core.errors import CheckpointError
    from miles_lora_ckpt.savers.multi_lora import load_slot_checkpoint

    run, trainer = _build(payload)
    consensus = Consensus.for_world(timeout_s=60)
    restored, start = {}, {}
    for slot in trainer.slots:
        try:
            result = load_slot_checkpoint(
                run.model, slot_root(payload["ckpt"], slot), **_slot_kwargs(run, trainer, slot, consensus)
            )
        except CheckpointError as exc:
            return {"refused": " ".join(line.strip() for line in str(exc).splitlines())}
        start[slot] = result.iteration or 0
        if result.loaded:
            what = ["adapter"] + (["fp32 masters + moments"] if result.optimizer_restored else [])
            what += ["scheduler"] if result.scheduler_restored else []
            restored[str(slot)] = f"restored {', '.join(what)} from {Path(result.path).name} (step {result.iteration})"
        else:
            restored[str(slot)] = "nothing committed: from step 0"
    for step in range(payload["steps"]):
        for slot in trainer.slots:
            if step >= start[slot]:
                trainer.step(slot, step)
    digests, slot_of = _digests(run, trainer)
    return {"digests": digests, "slot_of": slot_of, "restored": restored}
