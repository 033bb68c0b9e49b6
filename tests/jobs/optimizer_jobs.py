"""Worker functions for the optimizer-children tests: every child family megatron builds for LoRA.

One job runs many checks (`suite`): a resume matrix, DP-elastic saves and loads, a two-slot
chosen-children round trip and refusals of mismatched optimizers. Cases the running megatron
cannot build (Muon on 0.16.1, say) come back as `{"skipped": reason}`.

These runs depend on the CPU harness (harness/miles_lora_ckpt_harness/sim/cpu_intercepts.py): its three megatron
fallback-path fixes for DistributedOptimizer cases, and its padded all-gather for the
LayerWiseDistributedOptimizer (gloo refuses megatron's uneven all-gather) for layer-wise and
multi-slot cases.
"""

from __future__ import annotations

import json
from pathlib import Path

from lora_jobs import (
    Args,
    case_name,
    child_classes,
    load,
    reference,
    run_steps,
    save,
    save_then_resume,
)

from miles_lora_ckpt.core import checked_reads
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.megatron.optimizer_children import chain, replicated
from miles_lora_ckpt.megatron.topology import current_coordinates
from miles_lora_ckpt.savers.single_lora import load_lora_checkpoint, save_lora_checkpoint
from miles_lora_ckpt_harness.sim.model import SimConfig
from miles_lora_ckpt_harness.sim.optimizers import why_not_buildable
from miles_lora_ckpt_harness.sim.snapshot import compare_digests, compare_snapshots, snapshot, snapshot_digests
from miles_lora_ckpt_harness.sim.train import build_run, teardown


def suite(payload: dict, ctx) -> dict:
    """Run every section the payload names; see the module docstring."""
    consensus = Consensus.for_world(timeout_s=120)
    out = {}
    if "matrix" in payload:
        out["matrix"] = matrix(payload["matrix"], payload.get("steps", 5), ctx, consensus)
    if "elastic_saves" in payload:
        out["elastic_saves"] = {n: elastic_save(c, consensus) for n, c in payload["elastic_saves"].items()}
    if "elastic_loads" in payload:
        out["elastic_loads"] = {n: elastic_load(c, consensus) for n, c in payload["elastic_loads"].items()}
    if "slots" in payload:
        out["slots"] = slot_selection(payload["slots"], ctx, consensus)
    if "refusals" in payload:
        out["refusals"] = refusals(payload["refusals"], ctx, consensus)
    if "diverged" in payload:
        out["diverged"] = diverged_replicas(payload["diverged"], ctx, consensus)
    if "rebound" in payload:
        out["rebound"] = rebound_file(payload["rebound"], ctx, consensus)
    return out


def _skip(config: SimConfig) -> dict | None:
    reason = why_not_buildable(config)
    return {"skipped": reason} if reason else None


# --------------------------------------------------------------------------- resume matrix


def matrix(cases: list[dict], steps: int, ctx, consensus: Consensus) -> dict:
    """Uninterrupted reference vs save at `save_at`, crash, resume: the first difference per case."""
    out = {}
    for index, case in enumerate(cases):
        config = SimConfig.from_dict(case["config"])
        name = f"{case_name(config)}/save@{case['save_at']}"
        skipped = _skip(config)
        if skipped:
            out[name] = skipped
            continue
        ref_losses, ref_digests = reference(config, steps)
        got = save_then_resume(config, steps, case["save_at"], ctx.scratch_dir / f"matrix{index}", consensus)
        out[name] = {
            "loss_mismatch": None if got["losses"] == ref_losses else [ref_losses, got["losses"]],
            "first_difference": compare_digests(ref_digests, got["digests"]),
            "names": sorted(ref_digests),
            "children": got["children"],
            "local_params": got["local_params"],
            "result": got["result"],
        }
    return out


# --------------------------------------------------------------------------- DP-elastic


def elastic_save(case: dict, consensus: Consensus) -> dict:
    config = SimConfig.from_dict(case["config"])
    skipped = _skip(config)
    if skipped:
        return skipped
    run = build_run(config)
    run_steps(run, 0, case["steps"])
    path = save(run, case["root"], case["steps"], consensus)
    teardown(run)
    return {"path": path}


def elastic_load(case: dict, consensus: Consensus) -> dict:
    """Load a save of another DP size; compare every entry this rank now holds with the saved files."""
    config = SimConfig.from_dict(case["config"])
    skipped = _skip(config)
    if skipped:
        return skipped
    run = build_run(config)
    result = load(run, case["root"], consensus)
    generation = Path(result.path)
    saved = json.loads((generation / "manifest.json").read_text())["metadata"]["optimizer_children"]
    coords, names = current_coordinates(), chain.param_names(run.model)
    compared, differing, files = 0, [], {}
    for child in chain.select(run.optimizer):
        entries = saved[str(child.index)]["layout"]["entries"]
        for _, model_param, main, state in replicated.param_states(child.optimizer):
            name = names[id(model_param)]
            file = entries[replicated.entry_name(coords, model_param, name)]["file"]
            tensors = files.setdefault(file, checked_reads.load_tensors(generation / file)[0])
            for key, live in [("param", main), *state.items()]:
                compared += 1
                if not live.detach().cpu().equal(tensors[f"{name}.{key}"]):
                    differing.append(f"child{child.index}.{name}.{key}")
    loss = run_steps(run, result.iteration, result.iteration + 1)  # training goes on at the new size
    classes = child_classes(run)
    teardown(run)
    return {
        "compared": compared,
        "differing": differing,
        "files_read": sorted(files),
        "children": classes,
        "loss": loss,
        "result": result.__dict__,
    }


# --------------------------------------------------------------------------- chosen children


def slot_selection(case: dict, ctx, consensus: Consensus) -> dict:
    """A two-slot LayerWise chain: save slot 1's children alone, train on, load slot 1 alone.

    Slot 0's adapter weights, masters, moments and param groups must stay bit-identical; slot 1's
    must be exactly what was saved. Negative control: Miles' `reload_model_params()` on the whole
    chain afterwards does change slot 0's masters (its bf16 truncation), so the check can fail.
    """
    config = SimConfig.from_dict(case["config"])
    run = build_run(config)
    slot_children = {int(k): v for k, v in run.optimizer.miles_slot_child_indices.items()}
    run_steps(run, 0, 2)
    root = ctx.scratch_dir / "slot1"
    path = save_lora_checkpoint(
        run.model, Args(), root, optimizer=run.optimizer, iteration=2, consensus=consensus,
        optimizer_children=slot_children[1],
    )  # fmt: skip
    saved_slot1 = _slot_view(snapshot(run), config, slot_children, 1)
    run_steps(run, 2, 3)
    before = snapshot(run)
    result = load_lora_checkpoint(run.model, root, optimizer=run.optimizer, optimizer_children=slot_children[1])
    after = snapshot(run)
    run.optimizer.reload_model_params()  # what Miles does after a slot load: the whole chain
    reloaded = snapshot(run)
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    out = {
        "slot_children": slot_children,
        "local_params": [sum(len(g["params"]) for g in c.optimizer.optimizer.param_groups) for c in chain.select(run.optimizer)],
        "slot0_changed": compare_snapshots(_slot_view(before, config, slot_children, 0), _slot_view(after, config, slot_children, 0)),
        "slot0_compared": sorted(_slot_view(after, config, slot_children, 0)),
        "slot1_vs_saved": compare_snapshots(saved_slot1, _slot_view(after, config, slot_children, 1)),
        "slot1_moved_before_load": compare_snapshots(saved_slot1, _slot_view(before, config, slot_children, 1)),
        "slot0_changed_by_chain_reload": compare_snapshots(
            _slot_view(after, config, slot_children, 0, masters_only=True),
            _slot_view(reloaded, config, slot_children, 0, masters_only=True),
        ),
        "saved_children": sorted(manifest["metadata"]["optimizer_children"]),
        "saved_files": sorted(manifest["files"]),
        "result": result.__dict__,
    }  # fmt: skip
    teardown(run)
    return out


def _slot_view(snap: dict, config: SimConfig, slot_children: dict, slot: int, masters_only: bool = False) -> dict:
    """The part of a snapshot that belongs to one slot: its adapters and its children's state."""
    prefixes = tuple(f"opt{i}/" for i in slot_children[slot])

    def in_slot(name: str) -> bool:
        if name.startswith(prefixes):
            return not masters_only or "/master/" in name
        if name.startswith("param/") and not masters_only:
            return config.slot_of(int(name.split("/")[1].split(".")[1])) == slot
        return False

    return {n: t for n, t in snap.items() if in_slot(n)}


# --------------------------------------------------------------------------- refusals


def refusals(case: dict, ctx, consensus: Consensus) -> dict:
    """Save each `saves` config; load each into another optimizer: refused, and nothing changed."""
    roots = {}
    for label, config_dict in case["saves"].items():
        config = SimConfig.from_dict(config_dict)
        if why_not_buildable(config) is None:
            run = build_run(config)
            run_steps(run, 0, 2)
            roots[label] = save(run, ctx.scratch_dir / f"refusal-{label}", 2, consensus)
            teardown(run)
    out = {}
    for name, (label, config_dict) in case["loads"].items():
        config = SimConfig.from_dict(config_dict)
        reason = why_not_buildable(config) or (None if label in roots else f"{label} was not saved")
        if reason:
            out[name] = {"skipped": reason}
            continue
        run = build_run(config)
        run_steps(run, 0, 1)
        before = snapshot_digests(snapshot(run))
        try:
            load(run, roots[label], consensus)
            error = None
        except CheckpointError as exc:
            error = str(exc)
        out[name] = {"error": error, "changed": compare_digests(before, snapshot_digests(snapshot(run)))}
        teardown(run)
    return out


def rebound_file(case: dict, ctx, consensus: Consensus) -> dict:
    """A whole-parameter child's file re-stamped and re-listed as another child's (stamp and manifest
    agree, so the generation verifies): the family's binding check refuses it before any change.
    And `transplanted`: the child's files of a generation one step later put under this
    generation's stamps (everything verifies): the masters are not the adapter's, refused too.
    Needs the tests folder on the workers' sys.path (damage.py)."""
    import shutil

    from damage import rebind, transplant_tensors

    from miles_lora_ckpt.core.consensus import Outcome, attempt

    run = build_run(SimConfig.from_dict(case["config"]))
    run_steps(run, 0, 2)
    generation = Path(save(run, ctx.scratch_dir / "rebound", 2, consensus))
    files = sorted(p.relative_to(generation).as_posix() for p in (generation / "optimizer").glob("child0_*"))
    copy = ctx.scratch_dir / "transplanted" / generation.name
    copied = attempt(lambda: str(shutil.copytree(generation, copy))) if consensus.rank == 0 else Outcome.success()
    consensus.agree("copy", copied)
    damaged = attempt(rebind, generation, files[0], child="1") if consensus.rank == 0 else Outcome.success()
    consensus.agree("rebind", damaged)
    outcomes = {}
    for name, path in (("rebound", generation), ("transplanted", copy)):
        if name == "transplanted":  # one step later, then that generation's child-0 files into the copy
            run_steps(run, 2, 3)
            later = Path(save(run, ctx.scratch_dir / "later", 3, consensus))
            forged = [attempt(transplant_tensors, copy, f, later) for f in files] if consensus.rank == 0 else []
            consensus.agree("transplant", next((f for f in forged if not f.ok), Outcome.success()))
        before = snapshot_digests(snapshot(run))
        try:
            load(run, str(path), consensus)
            error = None
        except CheckpointError as exc:
            error = str(exc)
        outcomes[name] = {"error": error, "changed": compare_digests(before, snapshot_digests(snapshot(run)))}
    children = child_classes(run)
    teardown(run)
    return {"file": files[0], **outcomes["rebound"], "transplanted": outcomes["transplanted"], "children": children}


def diverged_replicas(case: dict, ctx, consensus: Consensus) -> dict:
    """Float16 children under a DDP that reduce-scatters (what megatron 0.19 builds for Lion with
    --use-distributed-optimizer): each rank steps its own partial gradients, the replicas drift
    apart, and the save is refused instead of keeping one of them."""
    from miles_lora_ckpt_harness.sim import train

    original = train.ddp_config

    def reduce_scatter(config):
        built = original(config)
        built.use_distributed_optimizer = True
        return built

    train.ddp_config = reduce_scatter
    try:
        run = build_run(SimConfig.from_dict(case["config"]))
    finally:
        train.ddp_config = original
    run_steps(run, 0, 2)
    root = ctx.scratch_dir / "diverged"
    try:
        save(run, root, 2, consensus)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    teardown(run)
    return {"error": error, "committed": sorted(p.name for p in root.glob("gen-*")) if root.exists() else []}
