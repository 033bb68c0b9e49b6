"""Single-LoRA save/resume through the real megatron-core DistributedOptimizer (CPU, gloo).

Every resume is compared with an uninterrupted run tensor by tensor, bit for bit: adapter weights,
fp32 masters, every optimizer state tensor (moments and steps) and the scheduler state. These runs
rely on the CPU harness's megatron fallback-path fixes (see harness/miles_lora_ckpt_harness/sim/cpu_intercepts.py).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import time
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from damage import (
    drop_file,
    edit_manifest,
    edit_training_state,
    rebind,
    reseal_file,
    rewrite_header,
    rewrite_tensors,
    set_param_group,
    swap_files,
    swap_tensors,
    to_gathered_layout,
    torch_pickle_bytes,
    transplant_tensors,
)
from jobs_paths import TESTS
from plan_reads import through_the_plan
from single_lora_steps import Args, _failing_install, case_name, load, reference, run_steps, save, save_then_resume

from miles_lora_ckpt.core import checked_reads, faults, json_files, safetensors_write
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.verify import verify_generation
from miles_lora_ckpt.savers.single_lora import load_lora_checkpoint, save_lora_checkpoint
from miles_lora_ckpt_harness.sim.launch import check_all, run_workers
from miles_lora_ckpt_harness.sim.model import SimConfig
from miles_lora_ckpt_harness.sim.snapshot import compare_digests, snapshot, snapshot_digests
from miles_lora_ckpt_harness.sim.train import build_run, teardown, train_step

pytestmark = [pytest.mark.megatron, pytest.mark.multirank]

STEPS = 5


def cfg(world: int, dtype: str = "bf16", adapters: str = "mixed", **extra) -> dict:
    return SimConfig(world_size=world, dtype=dtype, adapters=adapters, **extra).to_dict()


def run(world, target, payload):
    return check_all(run_workers(world, f"test_single_lora:{target}", payload, sys_path=[TESTS], timeout_s=400))


def resume_matrix(payload: dict, ctx) -> dict:
    """For each case: uninterrupted reference vs save at k, crash, resume; first mismatch per case.

    A case is `{"config": SimConfig dict, "save_at": k}`, plus `"load_optim": false` or (with LoRA
    dropout) `"load_rng": false` for a negative control (resume without optimizer state, or without
    the RNG states, must NOT be bit-exact, or the comparison is blind).
    """
    consensus = Consensus.for_world(timeout_s=120)
    out = {}
    for index, case in enumerate(payload["cases"]):
        config = SimConfig.from_dict(case["config"])
        load_optim, load_rng = case.get("load_optim", True), case.get("load_rng", True)
        name = case_name(config) + f"/save@{case['save_at']}" + ("" if load_optim else "/no-optim-control")
        name += "" if load_rng else "/no-rng-control"
        started = time.monotonic()
        ref_losses, ref_digests = reference(config, payload["steps"])
        root = ctx.scratch_dir / f"case{index}"
        got = save_then_resume(config, payload["steps"], case["save_at"], root, consensus, load_optim, load_rng)
        out[name] = {
            "loss_mismatch": None if got["losses"] == ref_losses else [ref_losses, got["losses"]],
            "first_difference": compare_digests(ref_digests, got["digests"]),
            "names": sorted(ref_digests),
            "optimizer": config.optimizer,
            "children": got["children"],
            "local_params": got["local_params"],
            "result": got["result"],
            "seconds": round(time.monotonic() - started, 2),
        }
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_resume_matrix_is_bit_exact(world):
    cases = [
        {"config": cfg(world, dtype, adapters), "save_at": 2}
        for dtype in ("bf16", "fp32")
        for adapters in ("dense", "expert-only", "mixed")
    ]
    if world == 2:  # expert parallel and pipeline stages: files per EP and per PP coordinate
        cases.append({"config": cfg(world, "bf16", "mixed", ep=2), "save_at": 2})
        cases.append({"config": cfg(world, "bf16", "mixed", pp=2), "save_at": 2})
        # context parallel with DP=1 (the optimizer shards over CP alone); two chunks per stage
        cases.append({"config": cfg(world, "bf16", "mixed", cp=2), "save_at": 2})
        cases.append({"config": cfg(world, "bf16", "mixed", pp=2, vpp=2, num_layers=4), "save_at": 2})
    if world == 4:  # tensor parallel, alone and with expert parallel; pipeline with expert parallel
        cases += [
            {"config": cfg(world, "fp32", "mixed", tp=2), "save_at": 2},
            {"config": cfg(world, "bf16", "mixed", tp=2, ep=2), "save_at": 2},
            {"config": cfg(world, "bf16", "mixed", pp=2, ep=2), "save_at": 2},
            # context parallel with DP=2 (optimizer over DP x CP = 4), and with expert parallel
            {"config": cfg(world, "bf16", "mixed", cp=2), "save_at": 2},
            {"config": cfg(world, "bf16", "mixed", cp=2, ep=2), "save_at": 2},
        ]
    if world in (2, 3):  # Lion: one moment (megatron 0.16: the harness's Lion in DistributedOptimizer
        # children; 0.19: megatron's own, in Float16/FP32 children: see test_optimizer_children.py)
        cases += [
            {"config": cfg(world, dtype, adapters, optimizer="lion"), "save_at": 2}
            for dtype, adapters in (("bf16", "mixed"), ("fp32", "dense"))
        ]
    if world == 2:
        cases.append({"config": cfg(world, "bf16", "mixed"), "save_at": 0})  # before the first step
        cases.append({"config": cfg(world, "bf16", "mixed"), "save_at": 2, "load_optim": False})
        # LoRA dropout: bit-exact only with every rank's RNG states restored (the control: without)
        cases.append({"config": cfg(world, "bf16", "mixed", lora_dropout=0.1), "save_at": 2})
        cases.append({"config": cfg(world, "bf16", "mixed", lora_dropout=0.1), "save_at": 2, "load_rng": False})
    if world == 4:  # dropout at TP 2: each TP rank's row-parallel inputs drop from its own tracker stream
        cases.append({"config": cfg(world, "bf16", "mixed", tp=2, lora_dropout=0.1), "save_at": 2})
    results = run(world, "resume_matrix", {"cases": cases, "steps": STEPS})
    for rank, per_case in enumerate(results):
        assert len(per_case) == len(cases)
        for name, case in per_case.items():
            if name.endswith("no-optim-control"):
                # without moments and masters the resume must differ: the comparison can fail
                assert case["first_difference"] is not None, name
                assert case["result"]["optimizer_restored"] is False
                continue
            if name.endswith("no-rng-control"):  # dropout without the RNG states: not bit-exact
                assert case["loss_mismatch"] is not None and case["first_difference"] is not None, name
                assert case["result"]["optimizer_restored"] and not case["result"]["rng_restored"], name
                continue
            assert case["result"]["rng_restored"] and case["result"]["rng_note"] is None, name
            assert case["loss_mismatch"] is None, (rank, name, case["loss_mismatch"])
            assert case["first_difference"] is None, (rank, name, case["first_difference"])
            names = case["names"]
            lion = case["optimizer"] == "lion"
            assert any("/master/" in n for n in names) and any(n.endswith("/exp_avg") for n in names), name
            assert any(n.endswith("/exp_avg_sq") for n in names) != lion, name
            assert "scheduler" in names and (lion or any(n.endswith("/step") for n in names)), name
            if "-vpp2" in name:  # every chunk's adapter, masters and moments are compared
                for chunk in ("chunk0.", "chunk1."):
                    assert any(n.startswith(f"param/{chunk}") for n in names), (name, chunk)
                    assert any(f"/master/{chunk}" in n for n in names), (name, chunk)
                    assert any(f"/state/{chunk}" in n and n.endswith("/exp_avg_sq") for n in names), (name, chunk)
            if "save@0" in name:
                assert case["result"]["optimizer_restored"] is False and case["result"]["masters_refreshed"]
            else:
                assert case["result"]["optimizer_restored"] and case["result"]["scheduler_restored"], name


def train_and_save(payload: dict, ctx) -> dict:
    """Train `steps` steps, then save into `root` (`saves` times, default once), and into
    `no_optim_root` (if given) once more as `--no-save-optim --no-save-rng` would; with `later_root`, train one
    more step and save there (a generation of another training state, for transplants)."""
    consensus = Consensus.for_world(timeout_s=60)
    run = build_run(SimConfig.from_dict(payload["config"]))
    run_steps(run, 0, payload["steps"])
    paths = [save(run, payload["root"], payload["steps"], consensus) for _ in range(payload.get("saves", 1))]
    if payload.get("no_optim_root"):
        no_optim = Args()
        no_optim.no_save_optim = no_optim.no_save_rng = True  # as --no-save-optim --no-save-rng would
        save(run, payload["no_optim_root"], payload["steps"], consensus, no_optim)
    digests = snapshot_digests(snapshot(run))
    later = None
    if payload.get("later_root"):
        run_steps(run, payload["steps"], payload["steps"] + 1)
        later = save(run, payload["later_root"], payload["steps"] + 1, consensus)
    return {"paths": paths, "digests": digests, "later": later}


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("neg") / "ckpt"
    payload = {
        "config": cfg(2),
        "root": str(root),
        "steps": 2,
        "saves": 2,
        "no_optim_root": str(root.parent / "no-optim"),
        "later_root": str(root.parent / "later"),  # one step further: a donor of foreign files
    }
    results = run(2, "train_and_save", payload)
    return root, results[0]["paths"], results[0]["later"]


def _copy_generation(gen: str, dest) -> str:
    target = dest / gen.rsplit("/", 1)[-1]
    shutil.copytree(gen, target)
    return str(target)


def try_loads(payload: dict, ctx) -> dict:
    """One run (trained `pre_steps`) tries to load each case path; report errors and bit-identity."""
    consensus = Consensus.for_world(timeout_s=60)
    run = build_run(SimConfig.from_dict(payload["config"]))
    outcomes = {}
    # `fresh_cases` run first, into the fresh optimizer (no step yet); `install_faults`:
    # {case: rank} fails that rank right after its install wrote masters and moments
    outcomes.update(_try_cases(run, payload, payload.get("fresh_cases", {}), consensus, ctx))
    run_steps(run, 0, payload.get("pre_steps", 1))
    outcomes.update(_try_cases(run, payload, payload["cases"], consensus, ctx))
    return outcomes


def _try_cases(run, payload: dict, cases: dict, consensus, ctx) -> dict:
    from miles_lora_ckpt.megatron import undo
    from miles_lora_ckpt.savers.single_lora import load as load_module

    outcomes = {}
    logged = _capture_warnings()
    for name, path in cases.items():
        logged.clear()
        if isinstance(path, list):
            path = path[ctx.rank]
        _move_rng()  # every case starts from generator states no checkpoint holds
        before, rng_before = snapshot_digests(snapshot(run)), rng_digest()
        phase, failing = payload.get("faults", {}).get(name, (None, None))
        if phase is not None and ctx.rank == failing:
            faults.arm(phase, failing, "raise")
        real_install, real_capture, records = load_module._install, undo.UndoRecord.__dict__["capture"], []
        install = _failing_install(real_install, payload.get("install_faults", {}).get(name) == ctx.rank, ctx.rank)
        capture = _recording_capture(undo.UndoRecord.capture, records)
        load_module._install, undo.UndoRecord.capture = install, capture
        real_finish = load_module._finish
        load_module._finish = _failing_finish(real_finish, payload.get("finish_faults", {}).get(name) == ctx.rank)
        kwargs = {**payload.get("load_kwargs", {}), **payload.get("case_kwargs", {}).get(name, {})}
        try:
            with through_the_plan() as plan:
                result = load(run, path, consensus, **kwargs)
            error = None
        except CheckpointError as exc:
            result, error = None, str(exc)
        finally:
            load_module._install, undo.UndoRecord.capture = real_install, real_capture
            load_module._finish = real_finish
        after = snapshot_digests(snapshot(run))
        masters = [entry for record in records for *_, entries in record.children for entry in entries]
        outcomes[name] = {
            "error": error,
            "through_plan": plan,  # planned from the global layout? its files against the own-file reader's
            "changed": compare_digests(before, after),
            "rng_changed": rng_digest() != rng_before,  # Python, numpy, torch and megatron's tracker
            "result": result.__dict__ if result else None,
            "logged": list(logged),
            "state_digests": after,  # what the run holds after this case (model, optimizer, scheduler)
            "hyperparameters": live_hyperparameters(run),  # after this case: first child's groups, scheduler
            # the undo record's masters: how many, how many are remade from the parameters, and how
            # many are kept as they were (the load gave those masters new data, never writing the old)
            "undo_masters": [
                len(masters),
                sum(
                    not kept and saved.data_ptr() != live.data_ptr() and saved.dtype != live.dtype
                    for live, saved, kept in masters
                ),
                sum(kept for _, _, kept in masters),
            ],
            # bytes the undo record copied (`UndoRecord.copied_bytes`), and the adapter parameters
            # it swapped with their verified buffers instead of copying them
            "undo_copied": sum(record.copied_bytes() for record in records),
            "undo_swapped": sum(len(record.swaps) for record in records),
        }
    return outcomes


def live_hyperparameters(run) -> dict:
    """The first non-stub child's param groups (JSON, no parameters) and the scheduler's max_lr."""
    from miles_lora_ckpt.core.jsoncodec import to_json
    from miles_lora_ckpt.megatron.optimizer_children import leaf_children

    child = next(c for c in leaf_children(run.optimizer) if not c.is_stub)
    groups = [to_json({k: v for k, v in g.items() if k != "params"}) for g in child.optimizer.optimizer.param_groups]
    return {"groups": groups, "scheduler_max_lr": run.scheduler.max_lr}


def _failing_finish(real, fail: bool):
    """The load's finish phase, failing on this rank before it restores anything (the other ranks
    finish, RNG states included, and must roll back)."""

    def finish(request, *args):
        if fail:
            raise RuntimeError(f"injected failure in the finish phase on rank {request.rank}")
        return real(request, *args)

    return finish


def _move_rng() -> None:
    import random

    import numpy
    import torch

    random.random(), numpy.random.rand(), torch.rand(1)


def rng_digest() -> str:
    """A digest of every RNG state of this process (Python, numpy, torch, megatron's tracker)."""
    import hashlib

    from miles_lora_ckpt.core import json_files, rng_state
    from miles_lora_ckpt.megatron import rng_tracker

    value, tensors = rng_state.encode(rng_state.capture(rng_tracker.capture()), 0)
    digest = hashlib.sha256(json_files.json_bytes(value))
    for name in sorted(tensors):
        digest.update(name.encode() + tensors[name].numpy().tobytes())
    return digest.hexdigest()


def _recording_capture(real, records: list):
    def capture(*args, **kwargs):
        records.append(real(*args, **kwargs))
        return records[-1]

    return capture


def _capture_warnings() -> list[str]:
    """Every WARNING the package logs from now on in this process, as text."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("miles_lora_ckpt")
    logger.addHandler(Keep(logging.WARNING))
    return records


# ------------------------------------------------------------------------------ refused loads
#
# One W=2 job (`try_loads`) loads every damaged copy of the newer generation in turn; each family of
# damage below is its own test over that job's outcomes. Every refusal must be the same
# CheckpointError on every rank, hold the family's words, and change no tensor, counter or generator.

OPTIM = "optimizer/child0_tp000_pp000_ep000_etp000_s000of002.safetensors"  # DP rank 0's slice
OPTIM1 = "optimizer/child1_tp000_pp000_ep000_etp000_s000of002.safetensors"
ADAPTER = "adapter/dense_tp000_pp000.safetensors"
RNG0, RNG1 = "rng/rank00000.json", "rng/rank00001.json"

# Each table: case name -> (damage(generation, donors), words the error must hold). `donors.older`
# is the older generation, `donors.later` one trained a step further; `{older_id}` in the words is
# the older generation's id.
DAMAGED_FILES = {
    "invalid state structure": (
        lambda g, d: rewrite_tensors(g, OPTIM, lambda t: t.pop("buf0.bucket0.exp_avg_sq")),
        "exp_avg_sq",
    ),
    "wrong numel": (
        lambda g, d: rewrite_tensors(
            g, OPTIM, lambda t: t.update({"buf0.bucket0.exp_avg": t["buf0.bucket0.exp_avg"][:-1]})
        ),
        "buf0.bucket0.exp_avg",
    ),
    "NaN in a moment (manifest honest)": (
        lambda g, d: rewrite_tensors(g, OPTIM, lambda t: t["buf0.bucket0.exp_avg"].__setitem__(0, float("nan"))),
        "NaN",
    ),
    "NaN in a moment (finite flag stripped)": (
        lambda g, d: rewrite_tensors(
            g, OPTIM, lambda t: t["buf0.bucket0.exp_avg"].__setitem__(0, float("nan")), finite=False
        ),
        "NaN",
    ),
    "torn: adapter shard gone from manifest": (lambda g, d: drop_file(g, ADAPTER), "dense_tp000_pp000"),
    "torn: optimizer file deleted": (lambda g, d: (g / OPTIM).unlink(), OPTIM),
    "layout: checkpoint with stub, run without": (
        lambda g, d: edit_manifest(g, lambda b: b["metadata"]["active_children"].update(tp000_pp000_ep000_etp000=[1])),
        "child layout differs",
    ),
    "pickle payload": (lambda g, d: reseal_file(g, OPTIM, torch_pickle_bytes()), "not safetensors"),
    "adapter shape changed": (
        lambda g, d: rewrite_tensors(g, ADAPTER, lambda t: t.update({k: v[:1] for k, v in list(t.items())[:1]})),
        "adapter",
    ),
}
# semantic binding and training-state invariants: self-consistent (resealed) but wrong; then unkeyed
# semantic cross-checks: every stamp, binding and digest agrees, only the adapter and the masters
# tell (the adapter must be the bf16 cast of its fp32 master, as megatron keeps it)
FORGED = {
    "optimizer file of another generation": (
        lambda g, d: reseal_file(g, OPTIM, (d.older / OPTIM).read_bytes()),
        OPTIM + ": the file says it is [generation {older_id}",
    ),
    "optimizer files swapped between children": (
        lambda g, d: swap_files(g, OPTIM, OPTIM1),
        OPTIM + ": the file says it is [generation",
    ),
    "optimizer file bound to another child": (
        lambda g, d: rebind(g, OPTIM, child="1"),
        OPTIM + ": the manifest binds it to {{'child': '1',",
    ),
    "adapter of another generation, restamped": (
        lambda g, d: transplant_tensors(g, ADAPTER, d.later),
        f"the adapter in {ADAPTER} is not the bfloat16 cast of its fp32 "
        "master in optimizer/child0_tp000_pp000_ep000_etp000_s00",
    ),
    "optimizer slices of another generation, restamped": (
        lambda g, d: transplant_tensors(g, OPTIM, d.later),
        f"the adapter in {ADAPTER} is not the bfloat16 cast of its fp32 master in {OPTIM} (optimizer child 0)",
    ),
    "optimizer children swapped with their stamps": (
        lambda g, d: [swap_tensors(g, OPTIM.replace("s000", s), OPTIM1.replace("s000", s)) for s in ("s000", "s001")],
        "optimizer child",
    ),
}
# training state against the launch: unknown keys never reach the live optimizer; under the
# "refuse" policy (resume.strict without --use-checkpoint-opt-param-scheduler) any difference is refused
TRAINING_STATE = {
    "eps NaN through the JSON codec": (
        lambda g, d: edit_training_state(g, lambda s: set_param_group(s, eps={"__float__": "nan"})),
        "param_groups[0].eps is 'nan' (not finite)",
    ),
    "param group with an unknown key": (
        lambda g, d: edit_training_state(g, lambda s: set_param_group(s, surprise=0.5)),
        "param group 0: the checkpoint holds keys this run's optimizer does not have: ['surprise']",
    ),
    "betas differ, policy refuse": (
        lambda g, d: edit_training_state(g, lambda s: set_param_group(s, betas=BETAS)),
        "param group 0: betas differs: checkpoint (0.5, 0.999), launch (",
    ),
    "scheduler max_lr differs, policy refuse": (
        lambda g, d: edit_training_state(g, lambda s: s["scheduler"].update(max_lr=s["scheduler"]["max_lr"] * 2)),
        "scheduler: max_lr differs: checkpoint",
    ),
    "negative scheduler num_steps": (
        lambda g, d: edit_training_state(g, lambda s: s["scheduler"].update(num_steps=-1)),
        "scheduler.num_steps is -1",
    ),
    "optimizer_saved false with optimizer files": (
        lambda g, d: edit_manifest(g, lambda b: b["metadata"].update(optimizer_saved=False)),
        "optimizer_saved is false, yet lists optimizer state",
    ),
    "missing metadata key": (
        lambda g, d: edit_manifest(g, lambda b: b["metadata"].pop("optimizer_children")),
        "manifest metadata has no 'optimizer_children'",
    ),
}
REFUSE_POLICY = {"betas differ, policy refuse", "scheduler max_lr differs, policy refuse"}
# each rank's RNG files: bounded, checked field by field, its own (verify refuses the same)
RNG_FILES = {
    "rng tensor renamed": (
        lambda g, d: rewrite_tensors(
            g, RNG0.replace(".json", ".safetensors"), lambda t: t.update(a=t.pop("torch.cpu"))
        ),
        "RNG tensor name 'a' is none of",
    ),
    "rng JSON oversized": (
        lambda g, d: reseal_file(g, RNG0, (g / RNG0).read_bytes() + b" " * (1 << 20)),
        "an RNG file of 1",
    ),
    "rng files of two ranks swapped": (
        lambda g, d: swap_files(g, RNG0, RNG1),
        "rng.rank is 1, but the file is rank 0's",
    ),
    "rng file of a rank gone": (
        lambda g, d: drop_file(g, RNG1.replace(".json", ".safetensors")),
        "rng/rank00001.safetensors",
    ),
}
# verify = the loader (issue 23): each of these verify passed while the loader refused it (or, for
# the decay style, applied it silently); both now refuse, for the same reason
VERIFY_AGREES = {
    "scalar tensor of an unknown dtype": (
        lambda g, d: edit_training_state(
            g, lambda s: set_param_group(s, step={"__scalar_tensor__": 2.0, "dtype": "Tensor"})
        ),
        "is a scalar tensor of dtype 'Tensor'",
    ),
    "unknown scheduler decay style": (
        lambda g, d: edit_training_state(g, lambda s: s["scheduler"].update(lr_decay_style="warp")),
        "scheduler.lr_decay_style is 'warp', not a style megatron knows",
    ),
    "optimizer slice holding int32 (index dropped)": (
        lambda g, d: rewrite_header(g, OPTIM, lambda h: h["buf0.bucket0.exp_avg"].update(dtype="I32")),
        "is I32, but an optimizer file of a DistributedOptimizer",
    ),
    "optimizer slice holding int32 (index agrees)": (
        lambda g, d: _int32_slice_with_its_block_index(g, OPTIM),
        "is I32, but an optimizer file of a DistributedOptimizer",
    ),
    "tensor name with a path character": (
        lambda g, d: rewrite_header(g, ADAPTER, lambda h: h.__setitem__("../x", h.pop(sorted(h)[-1]))),
        "the name holds a path or control character",
    ),
    "rng JSON malformed": (
        lambda g, d: reseal_file(g, RNG0, _rng_json(g, RNG0, lambda v: v["python"].update(state=[1, 2]))),
        "rng.python.state must be a list of 625 integers",
    ),
}
# not a damaged copy: the ranks ask for different generations; a fault after the preflight on rank 1,
# when rank 0 has already applied (it must roll back)
COLLECTIVE = {
    "iterations differ across ranks": "ranks disagree",
    "fault after preflight on rank 1": "injected fault at phase 'after-preflight' on rank 1",
}


@pytest.fixture(scope="module")
def refused_loads(saved_root, tmp_path_factory):
    """The outcomes on every rank of one job loading every damaged case; and the cases' paths."""
    _, (older, newer), later = saved_root
    donors = SimpleNamespace(older=Path(older), later=Path(later))
    base = tmp_path_factory.mktemp("damaged")
    cases = {}
    for table in (DAMAGED_FILES, FORGED, TRAINING_STATE, RNG_FILES, VERIFY_AGREES):
        for name, (damage, _) in table.items():
            gen = _copy_generation(newer, base / name)
            damage(Path(gen), donors)
            cases[name] = gen
    cases["iterations differ across ranks"] = [older, newer]
    cases["fault after preflight on rank 1"] = newer
    failing = {"fault after preflight on rank 1": ["after-preflight", 1]}
    case_kwargs = {name: {"hyperparameters": "refuse"} for name in REFUSE_POLICY}
    payload = {"config": cfg(2), "cases": cases, "pre_steps": 1, "faults": failing, "case_kwargs": case_kwargs}
    return cases, run(2, "try_loads", payload), Path(older).name[-16:]


def _assert_refused_everywhere(refused_loads, name: str, words: str) -> None:
    _, outcomes, older_id = refused_loads
    word = words.format(older_id=older_id)
    errors = [o[name]["error"] for o in outcomes]
    assert all(errors), (name, errors)
    assert errors[0] == errors[1], (name, errors)  # the same CheckpointError on every rank
    assert word in errors[0], (name, errors[0])
    assert all(o[name]["changed"] is None for o in outcomes), (name, [o[name]["changed"] for o in outcomes])
    assert not any(o[name]["rng_changed"] for o in outcomes), name  # no generator touched either


def test_every_case_ran_once(refused_loads):
    cases, outcomes, _ = refused_loads
    tables = (DAMAGED_FILES, FORGED, TRAINING_STATE, RNG_FILES, VERIFY_AGREES, COLLECTIVE)
    assert sum(len(t) for t in tables) == len(cases) == len(set().union(*tables))
    assert all(set(o) == set(cases) for o in outcomes)


@pytest.mark.parametrize("name", list(DAMAGED_FILES))
def test_a_damaged_or_torn_file_is_refused_on_every_rank_changing_nothing(refused_loads, name):
    _assert_refused_everywhere(refused_loads, name, DAMAGED_FILES[name][1])


@pytest.mark.parametrize("name", list(FORGED))
def test_a_file_of_another_generation_or_child_is_refused_even_restamped(refused_loads, name):
    _assert_refused_everywhere(refused_loads, name, FORGED[name][1])


@pytest.mark.parametrize("name", list(TRAINING_STATE))
def test_an_invalid_training_state_is_refused_on_every_rank_changing_nothing(refused_loads, name):
    _assert_refused_everywhere(refused_loads, name, TRAINING_STATE[name][1])


@pytest.mark.parametrize("name", list(RNG_FILES))
def test_a_bad_rng_file_is_refused_on_every_rank_changing_nothing(refused_loads, name):
    _assert_refused_everywhere(refused_loads, name, RNG_FILES[name][1])


@pytest.mark.parametrize("name", list(COLLECTIVE))
def test_disagreeing_ranks_or_a_fault_after_preflight_fail_together_and_roll_back(refused_loads, name):
    _assert_refused_everywhere(refused_loads, name, COLLECTIVE[name])


@pytest.mark.parametrize("name", list(VERIFY_AGREES))
def test_verify_refuses_what_the_loader_refuses_for_the_same_reason(refused_loads, name):
    _assert_refused_everywhere(refused_loads, name, VERIFY_AGREES[name][1])
    cases, outcomes, _ = refused_loads
    checked = verify_generation(Path(cases[name]))  # the loader's reason, naming the same file
    said = [f"{checked.path / p.file}: {p.reason}" for p in checked.problems]
    assert said and any(line in outcomes[0][name]["error"] for line in said), (name, said)


# ------------------------------------------------------------------------------ loads that succeed or roll back
#
# One W=2 job loads these generations one after another, in the same processes: the newest; a
# checkpoint saved without optimizer state loads with a warning that reaches the log; a generation
# whose metadata predates the child families (DistributedOptimizer keys only) restores its optimizer;
# generations written before slices (the DP root wrote each child's world tensors; every rank now
# reads its own ranges of that file), with and without the child-family metadata; hyperparameters
# that differ from the launch's, reported under every policy and settled by it; a generation saved
# before RNG states were saved; and late failures, which roll back bit for bit.


# a late failure (after install replaced masters and moments) of a load into a fresh optimizer
# rolls back bit for bit, with no copy of its masters; into an optimizer that has stepped, too:
# the install replaced its moments and gave its masters new data (never writing the old), and
# the undo record puts the old tensors and data back
# (a fresh optimizer: its masters written in place and remade from the parameters on undo, its
# moments never allocated before, the adapter swapped with its verified buffer: no copy at all)
FRESH_FAILURES = {
    "install fails on rank 1, fresh optimizer": "injected failure after install on rank 1",
    "finish fails on rank 1, fresh optimizer": "injected failure in the finish phase on rank 1",
}
STEPPED = "install fails on rank 1, stepped optimizer"


@pytest.fixture(scope="module")
def sane_loads(saved_root, tmp_path_factory):
    """The outcomes on every rank of one job loading the undamaged, older-format and
    other-hyperparameter generations, and the late failures (each rolled back)."""
    root, (_, newer), later = saved_root
    base = tmp_path_factory.mktemp("sane")
    no_optim = root.parent / "no-optim"
    gathered = _copy_generation(newer, base / "gathered")
    to_gathered_layout(Path(gathered))
    pre_family = _copy_generation(gathered, base / "pre-family")
    edit_manifest(Path(pre_family), _to_pre_family_metadata)
    # hyperparameters that differ from the launch's: reported under every policy, settled by it
    launch_case = _copy_generation(newer, base / "launch-policy")
    edit_training_state(Path(launch_case), _change_hyperparameters)
    default_case = _copy_generation(newer, base / "default-policy")
    edit_training_state(Path(default_case), lambda s: set_param_group(s, betas=BETAS))
    checkpoint_case = _copy_generation(newer, base / "checkpoint-policy")
    edit_training_state(Path(checkpoint_case), _change_hyperparameters)
    # a generation saved before RNG states were saved: no rng/ files, no rng_saved
    pre_rng = _copy_generation(newer, base / "pre-rng")
    for rel in [f for f in os.listdir(Path(pre_rng) / "rng")]:
        drop_file(Path(pre_rng), f"rng/{rel}")
    edit_manifest(Path(pre_rng), lambda b: b["metadata"].pop("rng_saved"))
    cases = {
        "newest": str(root),
        "no-optim": str(no_optim),
        "newer": newer,
        "gathered": gathered,
        "pre-family": pre_family,
        "launch policy": launch_case,
        "default policy": default_case,
        "checkpoint policy": checkpoint_case,
        "pre-rng": pre_rng,
        "finish fails on rank 1": newer,  # rank 0 restored its RNG states: it must set them back
    }
    case_kwargs = {
        "launch policy": {"hyperparameters": "launch"},
        "checkpoint policy": {"hyperparameters": "checkpoint"},
    }
    fresh = dict.fromkeys(FRESH_FAILURES, newer)
    # the last case: every other one loads first; a generation one step further, whose masters and
    # moments differ from the ones this optimizer holds then (the earlier cases loaded `newer`)
    cases[STEPPED] = later
    payload = {
        "config": cfg(2),
        "cases": cases,
        "fresh_cases": fresh,
        "install_faults": {next(iter(fresh)): 1, STEPPED: 1},
        "finish_faults": {"finish fails on rank 1": 1, "finish fails on rank 1, fresh optimizer": 1},
        "case_kwargs": case_kwargs,
    }
    return run(2, "try_loads", payload)


def test_the_newest_generation_loads(sane_loads):
    assert all(o["newest"]["error"] is None and o["newest"]["result"]["iteration"] == 2 for o in sane_loads)


def test_hyperparameters_that_differ_from_the_launch_are_settled_by_the_policy(sane_loads):
    _check_hyperparameter_policies(sane_loads)


def test_a_late_failure_rolls_back_bit_for_bit_without_copying(sane_loads):
    for o in sane_loads:
        for name, words in FRESH_FAILURES.items():
            late = o[name]  # every tensor and counter as before the load, with nothing copied to get there
            assert words in late["error"] and late["changed"] is None and not late["rng_changed"], late
            # every master remade from the restored parameters (none kept, none copied), no state
            # to copy, every adapter parameter swapped with its verified buffer
            n = late["undo_masters"][0]
            assert n > 0 and late["undo_masters"] == [n, n, 0], late
            assert late["undo_copied"] == 0 and late["undo_swapped"] > 0, late
        late = o[STEPPED]  # every tensor (masters and moments included) and counter as before the load
        assert "injected failure after install on rank 1" in late["error"] and late["changed"] is None, late
        assert late["undo_masters"][0] > 0 and late["undo_masters"][1:] == [0, late["undo_masters"][0]], late
        assert late["undo_swapped"] > 0, late


def test_rng_states_are_restored_set_back_on_failure_and_missing_ones_warn(sane_loads):
    for o in sane_loads:
        late = o["finish fails on rank 1"]
        assert "injected failure in the finish phase on rank 1" in late["error"], late["error"]
        assert late["changed"] is None and not late["rng_changed"], late
        # every rank's RNG states restored from its own files; the pre-RNG generation loads with a
        # warning naming what it lacks, which reaches the log, and leaves every generator as it was
        assert o["newer"]["result"]["rng_restored"] and o["newer"]["rng_changed"]
        result = o["pre-rng"]["result"]
        assert result["optimizer_restored"] and not result["rng_restored"] and not o["pre-rng"]["rng_changed"]
        warning = next(w for w in result["warnings"] if "holds no RNG state" in w)
        assert "(saved before RNG states were saved)" in warning, warning
        assert any(warning in line for line in o["pre-rng"]["logged"]), o["pre-rng"]["logged"]


def test_generations_written_before_slices_or_child_families_restore_the_same_state(sane_loads):
    for o in sane_loads:
        for name in ("gathered", "pre-family"):
            assert o[name]["error"] is None, o[name]["error"]
            # format v3 (edited to the older layouts): planned from the global layout, the record
            # without positions too, reading what the reader of each rank's own files reads
            plan = o[name]["through_plan"]
            assert plan["planned"] and plan["same_files"], (name, plan)
            assert o[name]["result"]["optimizer_restored"] and o[name]["result"]["scheduler_restored"]
            # the same adapter, masters and moments as the sliced original (param groups and scheduler
            # come from the same JSON either way; their digests also depend on earlier loads here)
            tensors = {k: v for k, v in o[name]["state_digests"].items() if "/master/" in k or "/state/" in k}
            assert tensors and all(o["newer"]["state_digests"][k] == v for k, v in tensors.items()), name


def test_a_generation_without_optimizer_or_rng_state_loads_with_warnings_in_the_log(sane_loads):
    for o in sane_loads:
        result = o["no-optim"]["result"]
        assert result and not result["optimizer_restored"] and result["masters_refreshed"], o["no-optim"]
        warning = next(w for w in result["warnings"] if "holds no optimizer state" in w)
        assert any(warning in line for line in o["no-optim"]["logged"]), o["no-optim"]["logged"]
        warning = next(w for w in result["warnings"] if "holds no RNG state" in w)  # saved with --no-save-rng too
        assert "(saved with --no-save-rng)" in warning and not result["rng_restored"], warning


def _rng_json(gen: Path, rel: str, change) -> bytes:
    value = json.loads((gen / rel).read_text())
    change(value)
    return json_files.json_bytes(value)


def _int32_slice_with_its_block_index(gen: Path, rel: str) -> None:
    """One fp32 tensor of an optimizer slice relabelled int32 (same bytes), its manifest record and
    block index rewritten to agree: only the rule on what such a file holds can refuse it."""
    tensors, metadata = checked_reads.load_tensors(gen / rel)
    tensors = {k: (v.view(torch.int32) if k == "buf0.bucket0.exp_avg" else v).clone() for k, v in tensors.items()}
    record = safetensors_write.save_tensors(gen / rel, tensors, metadata=metadata, blocks=True)
    edit_manifest(gen, lambda b: b["files"][rel].update({**record.to_dict(), "binding": b["files"][rel]["binding"]}))


BETAS = {"__tuple__": [0.5, 0.999]}  # as the JSON codec writes a tuple


def _change_hyperparameters(state: dict) -> None:
    """A relaunch with other betas and twice the learning rate, seen from the checkpoint's side."""
    set_param_group(state, betas=BETAS, max_lr=state["scheduler"]["max_lr"] * 2)
    state["scheduler"]["max_lr"] *= 2


def _check_hyperparameter_policies(outcomes: list[dict]) -> None:
    for rank, o in enumerate(outcomes):
        original = o["newer"]["hyperparameters"]  # the launch's values (the unforged checkpoint's)
        assert original["groups"][0]["betas"] != BETAS, original
        launch, default, checkpoint = o["launch policy"], o["default policy"], o["checkpoint policy"]
        for case in (launch, default, checkpoint):
            assert case["error"] is None and case["result"]["optimizer_restored"], case["error"]
        # "launch": every difference named with both values, the launch's kept (groups and scheduler)
        found = launch["result"]["hyperparameter_differences"]
        assert len(found) == 3, found
        assert "param group 0: betas differs: checkpoint (0.5, 0.999), launch (" in found[0], found
        assert "param group 0: max_lr differs: checkpoint " in found[1] and "(the launch's kept)" in found[1], found
        assert found[2].startswith("scheduler: max_lr differs: checkpoint "), found
        assert launch["hyperparameters"] == original, (launch["hyperparameters"], original)
        # default (megatron's behaviour): the checkpoint's param groups, each difference reported,
        # as a warning on rank 0 only
        found = default["result"]["hyperparameter_differences"]
        assert len(found) == 1 and "betas differs: checkpoint (0.5, 0.999)" in found[0], found
        assert default["hyperparameters"]["groups"][0]["betas"] == BETAS
        assert any(found[0] in line for line in default["logged"]) == (rank == 0), default["logged"]
        # "checkpoint" (--use-checkpoint-opt-param-scheduler): the checkpoint's groups and schedule
        assert checkpoint["hyperparameters"]["scheduler_max_lr"] == 2 * original["scheduler_max_lr"]
        assert checkpoint["hyperparameters"]["groups"][0]["max_lr"] == 2 * original["groups"][0]["max_lr"]
        assert any("scheduler: max_lr differs" in d for d in checkpoint["result"]["hyperparameter_differences"])


def _to_pre_family_metadata(body: dict) -> None:
    """The single-LoRA metadata as it was before every child family was saved (DistributedOptimizer only)."""
    meta = body["metadata"]
    children = meta.pop("optimizer_children")
    meta.pop("optimizer_selection")
    assert {c["family"] for c in children.values()} == {"distributed"}, children
    meta["stepped_children"] = [int(i) for i, c in children.items() if c["stepped"]]
    meta["state_keys"] = {i: c["keys"] for i, c in children.items()}
    meta["numel_unpadded"] = {i: c["layout"]["numel_unpadded"] for i, c in children.items() if c["stepped"]}


# ------------------------------------------------------------------------------ layout changes
#
# Three batched jobs (W=2 -> W=4 -> W=2) cover every layout change between save and resume:
# model-parallel changes refused before mutation, DP-size changes restored bit for bit.

MIXED2, CP2 = cfg(2), cfg(2, cp=2)
VPP2, VPP1 = cfg(2, pp=2, vpp=2, num_layers=4), cfg(2, pp=2, num_layers=4)
REFUSED = {  # name: (saved label, run config, words the error must hold)
    # one expert per EP rank (no global expert numbers): experts cannot move (test_reshard: numbered ones do)
    "ep change": ("mixed", cfg(2, ep=2), "ep: 1 -> 2 (expert parallel)): expert parameter layers.0.mlp.experts"),
    # the mixed checkpoint has a real dense child; an expert-only run has a stub there
    "checkpoint without stub, run with one": ("mixed", cfg(2, adapters="expert-only"), "child layout differs"),
}
# TP, PP, VPP and CP changes reshard (format v3; bit-exactness: test_reshard.py): here they just load
RESHARDED = {
    "tp change": ("mixed", cfg(2, tp=2)),
    "pp change": ("mixed", cfg(2, pp=2)),
    "vpp 2 -> 1": ("vpp2", VPP1),
    "vpp 1 -> 2": ("vpp1", VPP2),
    "cp 2 -> 1": ("cp2", MIXED2),
    "cp 1 -> 2": ("mixed", CP2),
}
CONTROLS = {"cp 2 -> 2 (control)": ("cp2", CP2), "vpp 2 -> 2 (control)": ("vpp2", VPP2), **RESHARDED}
ELASTIC_UP = {  # W=2 save -> W=4 load: name: (saved label, layout)
    "2->4": ("mixed", {}),
    "2->4 ep2": ("ep2", {"ep": 2}),
    "2->4 pp2": ("pp2", {"pp": 2}),
    "2->4 cp2 (DP x CP 2->4)": ("cp2", {"cp": 2}),
}
ELASTIC_DOWN = {"4->2": ("mixed", {}), "4->2 cp2 (DP x CP 4->2)": ("cp2", {"cp": 2})}  # W=4 save -> W=2


def layouts_job(payload: dict, ctx) -> dict:
    """Layout changes between save and resume, many cases in one job, in three parts:

    * `"elastic"`: `[{"name", "config", "root"}]`: load a checkpoint saved at another DP size (by an
      earlier job) and compare the regathered optimizer state with the saved bits;
    * `"saves"`: `{label: config}`: train 2 steps and save into `<root>/<label>` (returned in `roots`);
    * `"tries"`: `[{"name", "from": label, "config"}]`: a run of `config`, trained one step, tries
      to load the save `label`; reports the error (or None) and the first tensor that changed.
    """
    consensus = Consensus.for_world(timeout_s=120)
    elastic = {case["name"]: _elastic_check(case, consensus) for case in payload.get("elastic", [])}
    roots = {}
    for label, config in payload.get("saves", {}).items():
        run = build_run(SimConfig.from_dict(config))
        run_steps(run, 0, 2)
        roots[label] = str(Path(payload["root"]) / label)
        save(run, roots[label], 2, consensus)
        teardown(run)
    tries = {}
    for case in payload.get("tries", []):
        run = build_run(SimConfig.from_dict(case["config"]))
        run_steps(run, 0, 1)
        before = snapshot_digests(snapshot(run))
        try:
            load(run, roots[case["from"]], consensus)
            error = None
        except CheckpointError as exc:
            error = str(exc)
        tries[case["name"]] = {"error": error, "changed": compare_digests(before, snapshot_digests(snapshot(run)))}
        teardown(run)
    return {"elastic": elastic, "roots": roots, "tries": tries}


def _elastic_check(case: dict, consensus: Consensus) -> dict:
    """Load `case["root"]` into a run of `case["config"]`; on every rank, compare its restored shard
    of every DistributedOptimizer bucket with the same elements of the world tensor that the saved
    slice files (of another DP size) hold together."""
    run = build_run(SimConfig.from_dict(case["config"]))
    rng_before, logged = rng_digest(), _capture_warnings()
    result = load(run, case["root"], consensus)
    # another layout: every generator as megatron seeded it at build, one line logged (rank 0)
    rng = {"unchanged": rng_digest() == rng_before, "logged": [line for line in logged if "RNG" in line]}
    logged.clear()
    differing, names = [], []
    for name, (live, saved) in restored_against_saved(run, Path(result.path)).items():
        names.append(name)
        if not live.equal(saved):
            differing.append(name)
    loss = train_step(run, result.iteration)  # and training goes on at the new DP size
    teardown(run)
    return {"differing": differing, "names": sorted(names), "loss": loss, "result": result.__dict__, "rng": rng}


def restored_against_saved(run, generation: Path) -> dict:
    """`{"child{i}.buf{g}.bucket{b}.{key}": (this rank's live elements, the saved ones)}`: the
    saved world tensor of each bucket is the concatenation of every slice file's part, in slice
    order, read here with the plain safetensors loader."""
    import torch
    import torch.distributed as dist

    from miles_lora_ckpt.core.verify import resolve
    from miles_lora_ckpt.megatron.optimizer_children import distributed as dopt
    from miles_lora_ckpt.megatron.optimizer_children import leaf_children, resolve_state_keys

    coords = consensus_coords()  # collective: once, on every rank
    manifest = resolve(generation).generation.manifest
    out = {}
    for child in leaf_children(run.optimizer):
        if child.is_stub:
            continue
        opt, keys = child.optimizer, resolve_state_keys(child.optimizer)
        group = dopt.dp_group(opt)
        rank, size = group.rank(), group.size()
        root = dist.get_process_group_ranks(group)[0]
        key = _coords_of(root, coords)
        slices = manifest.metadata["optimizer_children"][str(child.index)]["layout"]["slices"][key]
        files = [checked_reads.load_tensors(generation / entry["file"])[0] for entry in slices]
        for layout in dopt.bucket_layouts(opt):
            n = layout.local_numel(size)
            lo, hi = min(rank * n, layout.numel_unpadded), min((rank + 1) * n, layout.numel_unpadded)
            if hi <= lo:
                continue
            for state_key in ("param", *keys):
                tensor = f"buf{layout.buffer_index}.bucket{layout.bucket_index}.{state_key}"
                world = torch.cat([f[tensor] for f in files if tensor in f])
                live = _live_shard(opt, layout, state_key, n)[: hi - lo]
                out[f"child{child.index}.{tensor}"] = (live, world[lo:hi])
    return out


def consensus_coords() -> list:
    """Every rank's coordinates (all-gathered)."""
    import torch.distributed as dist

    from miles_lora_ckpt.megatron.topology import current_coordinates

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, current_coordinates().to_dict())
    return gathered


def _coords_of(rank: int, coords: list) -> str:
    from miles_lora_ckpt.megatron.topology import Coordinates

    return Coordinates(**coords[rank]).model_parallel_key


def _live_shard(opt, layout, key: str, numel: int):
    """This rank's shard of one bucket for `key`, built from the masters and the optimizer state."""
    import torch

    from miles_lora_ckpt.megatron.optimizer_children import distributed as dopt

    shard = torch.zeros(numel, dtype=torch.float32)
    maps = next(iter(opt.gbuf_ranges[layout.buffer_index].values()))[layout.bucket_index]["param_map"]
    for model_param, ranges in maps.items():
        main_param, state = dopt.main_and_state(opt, model_param)
        source = main_param if key == "param" else state[key]
        shard[ranges["gbuf_local"].start : ranges["gbuf_local"].end] = source.detach().view(-1)
    return shard


@pytest.fixture(scope="module")
def layouts_w2(tmp_path_factory):
    """W=2: save every W=2 layout, then try each refused change and the controls."""
    payload = {
        "root": str(tmp_path_factory.mktemp("layouts2")),
        "saves": {"mixed": MIXED2, "ep2": cfg(2, ep=2), "pp2": cfg(2, pp=2), "cp2": CP2, "vpp2": VPP2, "vpp1": VPP1},
        "tries": [
            {"name": name, "from": label, "config": config}
            for name, (label, config, *_) in {**REFUSED, **CONTROLS}.items()
        ],
    }
    return run(2, "layouts_job", payload)


@pytest.fixture(scope="module")
def layouts_w4(layouts_w2, tmp_path_factory):
    """W=4: load the W=2 saves at the larger DP size, then save W=4 runs for the way down."""
    roots = layouts_w2[0]["roots"]
    payload = {
        "root": str(tmp_path_factory.mktemp("layouts4")),
        "elastic": [
            {"name": name, "config": cfg(4, **layout), "root": roots[label]}
            for name, (label, layout) in ELASTIC_UP.items()
        ],
        "saves": {label: cfg(4, **layout) for label, layout in ELASTIC_DOWN.values()},
    }
    return run(4, "layouts_job", payload)


@pytest.fixture(scope="module")
def layouts_w2_down(layouts_w4):
    roots = layouts_w4[0]["roots"]
    elastic = [
        {"name": n, "config": cfg(2, **layout), "root": roots[label]} for n, (label, layout) in ELASTIC_DOWN.items()
    ]
    return run(2, "layouts_job", {"elastic": elastic})


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_layout_changes_are_refused_before_mutation(layouts_w2, name):
    words = REFUSED[name][2]
    outcomes = [r["tries"][name] for r in layouts_w2]
    assert outcomes[0]["error"] == outcomes[1]["error"], outcomes  # the same error on every rank
    for o in outcomes:
        assert o["error"] and words in o["error"], o["error"]
        assert o["changed"] is None, o  # adapter, masters, moments, steps and scheduler bit-identical


def test_same_cp_and_vpp_layouts_load(layouts_w2):
    # the controls: the CP and VPP refusals are about the layout, not about those checkpoints;
    # and the TP, PP and VPP changes that reshard now load
    for r in layouts_w2:
        for name in CONTROLS:
            assert r["tries"][name]["error"] is None and r["tries"][name]["changed"] is not None, name


def test_cp_and_vpp_files_are_keyed_by_coordinates_with_one_writer_each(layouts_w2):
    # CP=2 at W=2: both ranks hold the same (TP, PP, EP) coordinate and the same adapter; the
    # protocol refuses a file written by two ranks, so one file per coordinate (and slice) means one writer.
    from miles_lora_ckpt.core.verify import resolve

    roots = layouts_w2[0]["roots"]
    manifest = resolve(Path(roots["cp2"])).generation.manifest
    assert manifest.topology.to_dict() == {"world": 2, "tp": 1, "pp": 1, "ep": 1, "etp": 1, "dp": 1, "cp": 2, "vpp": 1}
    assert sorted(manifest.files) == [
        "adapter/dense_tp000_pp000.safetensors",
        "adapter/expert_pp000_ep000_etp000.safetensors",
        # no gather: each rank of the DP x CP group of 2 writes its own slice of each child
        "optimizer/child0_tp000_pp000_ep000_etp000_s000of002.safetensors",
        "optimizer/child0_tp000_pp000_ep000_etp000_s001of002.safetensors",
        "optimizer/child1_tp000_pp000_ep000_etp000_s000of002.safetensors",
        "optimizer/child1_tp000_pp000_ep000_etp000_s001of002.safetensors",
        # every rank its own RNG states (by global rank: they are the process's, not a coordinate's)
        "rng/rank00000.json",
        "rng/rank00000.safetensors",
        "rng/rank00001.json",
        "rng/rank00001.safetensors",
        "training_state.json",
    ]
    # VPP=2 on two stages: one adapter file per stage holding both chunks, one optimizer file per stage
    manifest = resolve(Path(roots["vpp2"])).generation.manifest
    assert (manifest.topology.pp, manifest.topology.vpp, manifest.topology.dp) == (2, 2, 1)
    assert sorted(f for f in manifest.files if f.startswith("adapter/dense")) == [
        "adapter/dense_tp000_pp000.safetensors",
        "adapter/dense_tp000_pp001.safetensors",
    ]
    assert sorted(f for f in manifest.files if f.startswith("optimizer/child0")) == [
        "optimizer/child0_tp000_pp000_ep000_etp000_s000of001.safetensors",
        "optimizer/child0_tp000_pp001_ep000_etp000_s000of001.safetensors",
    ]


@pytest.mark.parametrize("direction, name", [("up", n) for n in ELASTIC_UP] + [("down", n) for n in ELASTIC_DOWN])
def test_dp_elastic_restore_is_bit_exact(direction, name, request):
    """The DP size may change, under CP too: the optimizer group is DP x CP and its bucket-space
    payload does not depend on that size, so the state is restored bit for bit and training goes on."""
    results = [
        r["elastic"][name] for r in request.getfixturevalue("layouts_w4" if direction == "up" else "layouts_w2_down")
    ]
    roots = [r for r in results if r["names"]]
    assert roots, "no rank compared anything"
    compared = sorted(n for r in roots for n in r["names"])
    assert any(n.endswith(".param") for n in compared) and any(n.endswith(".exp_avg_sq") for n in compared)
    assert {n.split(".")[0] for n in compared} == {"child0", "child1"}  # dense and expert children
    for rank, r in enumerate(results):
        assert r["differing"] == [], r["differing"]
        assert r["result"]["optimizer_restored"] and r["result"]["iteration"] == 2
        # RNG states at another layout: megatron's (as seeded at build), said in one line on rank 0
        note = r["result"]["rng_note"]
        assert not r["result"]["rng_restored"] and r["rng"]["unchanged"], r
        assert note.startswith("RNG state not restored: saved at world") and "as megatron does" in note, note
        logged = r["rng"]["logged"]
        assert len(logged) == (rank == 0) and all(line.endswith(f": {note}") for line in logged), (rank, logged)


def test_weights_only_and_no_load_optim_restore_adapter_and_reposition_scheduler(saved_root):
    root = saved_root[0]
    outcomes = run(
        2, "try_loads", {"config": cfg(2), "cases": {"root": str(root)}, "load_kwargs": {"load_optim": False}}
    )
    for o in outcomes:
        result = o["root"]["result"]
        assert result["adapter_restored"] and not result["optimizer_restored"] and not result["scheduler_restored"]
        assert result["masters_refreshed"] and any("repositioned" in w for w in result["warnings"])


def test_optimizer_mismatch_is_refused_unless_weights_only(saved_root, tmp_path):
    """Adam <-> Lion with megatron's default children (0.16: both DistributedOptimizer; 0.19: Lion is
    a Float16 child). test_optimizer_children.py covers every other mismatch."""
    adam_root = saved_root[0]
    lion_root = tmp_path / "lion"
    run(2, "train_and_save", {"config": cfg(2, optimizer="lion"), "root": str(lion_root), "steps": 2})
    into_lion = run(2, "try_loads", {"config": cfg(2, optimizer="lion"), "cases": {"adam->lion": str(adam_root)}})
    into_adam = run(2, "try_loads", {"config": cfg(2), "cases": {"lion->adam": str(lion_root)}})
    for outcome, name, saved, running in (
        (into_lion, "adam->lion", "adam", "lion"),
        (into_adam, "lion->adam", "lion", "adam"),
    ):
        for o in outcome:
            error = o[name]["error"]
            assert error and (f"of {saved}," in error or f"over {saved}," in error), error
            assert f"({running})" in error or f"over {running} " in error, error
            assert o[name]["changed"] is None
    warm = run(
        2,
        "try_loads",
        {"config": cfg(2, optimizer="lion"), "cases": {"warm": str(adam_root)}, "load_kwargs": {"weights_only": True}},
    )
    for o in warm:
        result = o["warm"]["result"]
        assert result["adapter_restored"] and not result["optimizer_restored"] and result["masters_refreshed"]


def legacy_warm_start(payload: dict, ctx) -> dict:
    """Write a stock-Miles adapter directory (torch.save per global rank) and, with `native_dir`, a
    stock native torch_dist checkpoint (megatron-core dist_checkpointing.save); warm-start from each."""
    import torch

    from miles_lora_ckpt.megatron.adapter_shards import is_adapter_param_name

    config = SimConfig.from_dict(payload["config"])
    trained = build_run(config)
    run_steps(trained, 0, 2)
    legacy = Path(payload["dir"])
    legacy.mkdir(parents=True, exist_ok=True)
    # what stock Miles writes: {wrapped-chunk name: tensor} per global rank, and pickled training state
    adapter = {n: p.data.cpu() for n, p in trained.model[0].named_parameters() if is_adapter_param_name(n)}
    torch.save(adapter, legacy / f"adapter_megatron_rank{ctx.rank}.pt")
    torch.save({"iteration": 2, "optimizer": {"param_groups": []}}, legacy / f"training_state_rank{ctx.rank}.pt")
    if payload.get("native_dir"):
        _write_native_torch_dist(trained, Path(payload["native_dir"]))
    teardown(trained)

    consensus = Consensus.for_world(timeout_s=120)
    fresh = build_run(config)
    run_steps(fresh, 0, 1)  # moments and step counters exist: the native warm start must leave them
    native = _native_warm_starts(fresh, payload, consensus, adapter) if payload.get("native_dir") else {}
    result = load(fresh, legacy, consensus)
    loaded = {n: p for n, p in fresh.model[0].named_parameters() if is_adapter_param_name(n)}
    same_adapter = sorted(adapter) == sorted(loaded) and all(torch.equal(adapter[n], loaded[n]) for n in adapter)
    out = {
        "result": result.__dict__,
        "same_adapter": same_adapter,
        "masters_match_adapter": _masters_match(fresh),
        "native": native,
    }
    teardown(fresh)
    if payload.get("native_dir"):
        out["native_refusals"] = _native_refusals(config, Path(payload["native_dir"]), consensus)
        out["native_tp2_into_tp1"] = _native_across_tp(config, Path(payload["native_dir"]), consensus)
        out["native_names"] = _native_names(config, Path(payload["native_dir"]), consensus)
    return out


def _write_native_torch_dist(run, save_dir: Path) -> None:
    """What stock Miles' native (raw-mode) LoRA save writes: ONE megatron-core
    dist_checkpointing checkpoint in `<save>/iter_NNNNNNN/adapter/torch_dist` holding the adapter's
    sharded state dict, the optimizer's fully_reshardable sharded state and the scheduler."""
    from miles_lora_ckpt_harness.bench.distckpt import _dc_save

    _dc_save(run, save_dir / "iter_0000002" / "adapter" / "torch_dist")


class _Warnings:
    """The WARNING records the plugin logs (logger `miles_lora_ckpt`) while it is installed."""

    def __init__(self):
        import logging

        self.records: list[str] = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.records.append(record.getMessage())
        self.logger = logging.getLogger("miles_lora_ckpt")

    def __enter__(self):
        self.logger.addHandler(self.handler)
        return self.records

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)


def _native_warm_starts(run, payload: dict, consensus, adapter: dict) -> dict:
    """Warm-start `run` from the stock native adapter dir, then (its adapter scrambled first) from
    its torch_dist dir; per path: the result, the warnings logged, whether every adapter tensor is
    bit-identical to the saved run's and every master the cast of it, and whether the optimizer
    moments and scheduler were left as they were."""
    import torch

    from miles_lora_ckpt.megatron.adapter_shards import is_adapter_param_name

    native = Path(payload["native_dir"]) / "iter_0000002" / "adapter"
    outcomes = {}
    for name, path in (("adapter dir", native), ("torch_dist dir", native / "torch_dist")):
        with torch.no_grad():  # every adapter weight different from the saved one before the load
            for n, p in run.model[0].named_parameters():
                if is_adapter_param_name(n):
                    p.add_(1.0)
        before = snapshot(run)
        with _Warnings() as logged:
            result = load(run, path, consensus)
        after = snapshot(run)
        loaded = {n: p for n, p in run.model[0].named_parameters() if is_adapter_param_name(n)}
        kept = [k for k in before if not k.startswith("param/") and "/master/" not in k]
        outcomes[name] = {
            "result": result.__dict__,
            "logged": list(logged),
            "same_adapter": sorted(adapter) == sorted(loaded)
            and all(torch.equal(adapter[n], loaded[n]) for n in adapter),
            "masters_match_adapter": _masters_match(run),
            "rest_unchanged": [k for k in kept if not torch.equal(before[k], after[k])],
            "kept_moments": sum(k.endswith(("/exp_avg", "/exp_avg_sq")) for k in kept),
            "kept_scheduler": "scheduler" in kept,
        }
    return outcomes


def _native_refusals(config: SimConfig, native_dir: Path, consensus) -> dict:
    """Refused warm starts, every tensor compared before and after: a native checkpoint missing one
    adapter parameter (megatron-core dist_checkpointing.save of the adapter's sharded state dict
    without it), and the full one into a run of another LoRA rank and into one without the expert
    adapters the checkpoint holds; and a warm start whose install fails on rank 1 after rank 0
    installed (an injected fault): rank 0 rolls its model and optimizer back."""
    from megatron.core import dist_checkpointing

    from miles_lora_ckpt_harness.bench.distckpt import model_sharded_state_dict

    outcomes = {}
    run = build_run(config)
    partial = native_dir / "partial" / "torch_dist"
    sharded = model_sharded_state_dict(run)
    dropped = sorted(sharded)[0]
    del sharded[dropped]
    partial.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save({"model": sharded}, str(partial))
    outcomes["missing"] = {**_refused(run, partial.parent, consensus), "dropped": dropped}
    # the install fails on rank 1 (nothing changed there) after rank 0 installed: rank 0 rolls back
    run_steps(run, 0, 1)
    faults.arm("after-preflight", 1, "raise")
    try:
        outcomes["install fails on rank 1"] = _refused(run, native_dir / "iter_0000002" / "adapter", consensus)
    finally:
        faults.disarm()
    teardown(run)
    saved = native_dir / "iter_0000002" / "adapter"
    for name, change in (("lora rank 8", {"lora_rank": 8}), ("dense only", {"adapters": "dense"})):
        other = build_run(SimConfig.from_dict({**config.to_dict(), **change}))
        outcomes[name] = _refused(other, saved, consensus)
        teardown(other)
    return outcomes


def _refused(run, path: Path, consensus) -> dict:
    before = snapshot_digests(snapshot(run))
    try:
        result, error = load(run, path, consensus).__dict__, None
    except CheckpointError as exc:
        result, error = None, str(exc)
    return {"error": error, "result": result, "changed": compare_digests(before, snapshot_digests(snapshot(run)))}


def _native_across_tp(config: SimConfig, native_dir: Path, consensus) -> dict:
    """A native checkpoint saved at TP 2 (megatron-core dist_checkpointing.save) warm-starts a TP 1
    run: its adapter equals, bit for bit, what megatron's own dist_checkpointing.load reshards into
    the same run; masters are the cast of it."""
    import torch
    from megatron.core import dist_checkpointing

    from miles_lora_ckpt.megatron.adapter_shards import adapter_params
    from miles_lora_ckpt_harness.bench.distckpt import model_sharded_state_dict

    tp2 = build_run(SimConfig.from_dict({**config.to_dict(), "tp": 2}))
    run_steps(tp2, 0, 1)
    saved = native_dir / "tp2" / "adapter" / "torch_dist"
    saved.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save({"model": model_sharded_state_dict(tp2)}, str(saved))
    teardown(tp2)
    run = build_run(config)
    with _Warnings() as logged:
        result = load(run, saved.parent, consensus)
    ours = {n: p.detach().clone() for n, p in adapter_params(run.model).items()}
    masters = _masters_match(run)
    with torch.no_grad():
        for p in adapter_params(run.model).values():
            p.zero_()
    dist_checkpointing.load({"model": model_sharded_state_dict(run)}, str(saved))  # megatron's own reshard
    theirs = adapter_params(run.model)
    out = {
        "result": result.__dict__,
        "logged": list(logged),
        "names": len(ours),
        "differ": [n for n in ours if not torch.equal(ours[n], theirs[n].detach())],
        "masters_match_adapter": masters,
    }
    teardown(run)
    return out


def _write_miles_native(run, path: Path, stacked: bool, extra: dict | None = None) -> list[str]:
    """A checkpoint laid out exactly as Miles' native LoRA (miles_plugins/lora, docs/incoming/nnames.md)
    writes the adapter of each layer's row-parallel `linear_proj`: a `lora_o_adapter` module on the
    block owning the linear, parameters `o_A` [rank, in] (TP-split on axis 1) and `o_B` [out, rank]
    (replicated), made ShardedTensors by megatron-core's make_sharded_tensors_for_checkpoint under
    the local layer prefix, that prefix then replaced as megatron's TransformerBlock replaces it
    (`stacked`: `layers.` with the global layer on a leading axis of num_layers, its default for
    homogeneous layers; else `layers.<global>.`); merged as Miles merges them (key|offset) and
    saved with dist_checkpointing.save beside Miles' common state. `extra`: more native parameters
    of that module kind, `{adapter attr: ({name: tensor}, {name: TP axis})}`. Returns the keys."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    config, chunk = run.config, run.model[0]
    layers = [m for _, m in chunk.named_modules() if hasattr(m, "linear_proj") and hasattr(m, "global_index")]
    sharded = {}
    for local, layer in enumerate(layers):
        g = layer.global_index
        modules = {
            "lora_o_adapter": (
                {"o_A": layer.linear_proj.lora_A.weight, "o_B": layer.linear_proj.lora_B.weight},
                {"o_A": 1},
            )
        }
        modules.update(extra or {})
        for attr, (params, axes) in modules.items():
            entries = make_sharded_tensors_for_checkpoint(
                params, f"layers.{local}.{attr}.", axes, [(0, g, config.num_layers)] if stacked else []
            )
            replace_prefix_for_sharding(entries, f"layers.{local}.", "layers." if stacked else f"layers.{g}.")
            sharded.update({f"{e.key}|{tuple(e.global_offset)}": e for e in entries.values()})
    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save({"model": sharded, "iteration": 1, "has_optimizer_state": False}, str(path))
    return sorted({e.key for e in sharded.values()})


def _native_names(config: SimConfig, native_dir: Path, consensus) -> dict:
    """Miles' native LoRA names and layouts (core.native_names) at TP 2: a run whose adapter sits on
    linear_proj trains a step; its adapter is written as Miles' native LoRA writes it (both key
    forms); scrambled, the run warm-starts from each and every adapter tensor is compared with the
    written one. Negative controls: without the mapping (native_sources giving nothing, the old
    behaviour) the same checkpoint is refused; a checkpoint that also holds a native split q/k/v
    adapter is refused naming its item. Nothing changes on a refusal."""
    import torch

    from miles_lora_ckpt.core import native_names
    from miles_lora_ckpt.core.dcp_metadata import read_metadata
    from miles_lora_ckpt.megatron.adapter_shards import adapter_params

    run = build_run(SimConfig.from_dict({**config.to_dict(), "tp": 2, "adapters": "proj"}))
    run_steps(run, 0, 1)
    expected = {n: p.detach().clone() for n, p in adapter_params(run.model).items()}
    base = native_dir / "names"
    out = {"expected": len(expected)}
    for form, stacked in (("stacked", True), ("per layer", False)):
        path = base / form.replace(" ", "-") / "torch_dist"
        keys = _write_miles_native(run, path, stacked)
        with torch.no_grad():
            for p in adapter_params(run.model).values():
                p.add_(1.0)
        result = load(run, path.parent, consensus)
        loaded = adapter_params(run.model)
        out[form] = {
            "keys": keys,
            "items": sorted(read_metadata(path / ".metadata").entries),
            "result": result.__dict__,
            "differ": [n for n in expected if not torch.equal(expected[n], loaded[n].detach())],
            "masters_match_adapter": _masters_match(run),
        }
    mapped = native_names.native_sources
    native_names.native_sources = lambda name: []  # the unmapped (old) behaviour
    try:
        out["unmapped"] = _refused(run, base / "stacked", consensus)
    finally:
        native_names.native_sources = mapped
    a, b = torch.ones(config.lora_rank, config.hidden), torch.ones(config.hidden // 2, config.lora_rank)
    split = {
        "lora_qkv_adapter": ({"q_A": a.to(run.config.torch_dtype), "q_B": b.to(run.config.torch_dtype)}, {"q_B": 0})
    }
    _write_miles_native(run, base / "split" / "torch_dist", True, split)
    out["split"] = _refused(run, base / "split", consensus)
    teardown(run)
    return out


def _masters_match(run) -> bool:
    """Every fp32 master shard equals float() of its (loaded) model parameter slice."""
    from miles_lora_ckpt.megatron.optimizer_children import leaf_children
    from miles_lora_ckpt.megatron.optimizer_children.distributed import main_and_state

    for leaf in leaf_children(run.optimizer):
        if leaf.is_stub:
            continue
        child = leaf.optimizer
        for model_param in child.model_param_group_index_map:
            master, _ = main_and_state(child, model_param)
            span = child._get_model_param_range_map(model_param)["param"]
            if not master.detach().view(-1).equal(model_param.detach().view(-1)[span.start : span.end].float()):
                return False
    return True


@pytest.fixture(scope="module")
def stock_dirs(tmp_path_factory):
    """One W=2 launch: a stock .pt adapter directory and a REAL stock native torch_dist checkpoint
    (megatron-core dist_checkpointing.save of the trained run's adapter, optimizer and scheduler),
    then a fresh run that warm-starts from the native one (adapter dir, then its torch_dist dir) and
    from the .pt one; then the refused native warm starts and a TP 2 native checkpoint into TP 1."""
    base = tmp_path_factory.mktemp("stock")
    payload = {"config": cfg(2), "dir": str(base / "legacy"), "native_dir": str(base / "native")}
    return base, run(2, "legacy_warm_start", payload)


def test_stock_miles_adapter_directory_warm_starts_the_adapter_only(stock_dirs):
    _, results = stock_dirs
    for r in results:
        result = r["result"]
        assert result["source"] == "legacy-miles" and result["loaded"] and result["iteration"] == 2
        assert r["same_adapter"] and r["masters_match_adapter"]
        assert not result["optimizer_restored"] and not result["scheduler_restored"]
        assert "NOT restored" in result["warnings"][0] and "optimizer moments" in result["warnings"][0]


def test_stock_native_torch_dist_checkpoint_warm_starts_the_adapter_weights_only(stock_dirs):
    """A stock Miles native (raw-mode) adapter checkpoint (the adapter dir or its torch_dist dir)
    warm-starts the adapter: every adapter tensor bit-identical to the saved run's, every fp32
    master the cast of it, moments and scheduler untouched, and a WARNING saying what is not restored."""
    base, results = stock_dirs
    torch_dist = base / "native" / "iter_0000002" / "adapter" / "torch_dist"
    assert (torch_dist / "metadata.json").is_file() and (torch_dist / ".metadata").is_file()
    assert list(torch_dist.glob("*.distcp"))
    # megatron-core 0.16 keeps the common state in a torch.save'd common.pt; 0.19 inside the DCP files
    assert (torch_dist / "common.pt").is_file() == version("megatron-core").startswith("0.16.")
    for r in results:
        for name in ("adapter dir", "torch_dist dir"):
            outcome = r["native"][name]
            result = outcome["result"]
            assert result["source"] == "native-dist" and result["loaded"] and result["adapter_restored"], outcome
            assert not result["optimizer_restored"] and not result["scheduler_restored"], outcome
            assert result["masters_refreshed"] and result["iteration"] is None, outcome
            assert outcome["same_adapter"] and outcome["masters_match_adapter"], outcome
            assert outcome["kept_moments"] > 0 and outcome["kept_scheduler"], outcome
            assert outcome["rest_unchanged"] == [], outcome  # moments, steps and scheduler as they were
            warning = result["warnings"][0]
            assert "NOT restored" in warning and "optimizer moments" in warning and "step counters" in warning
            assert "scheduler" in warning and str(torch_dist) in warning, warning
            assert any(warning in line for line in outcome["logged"]), outcome["logged"]


def test_native_warm_start_reshards_a_tp2_checkpoint_into_tp1(stock_dirs):
    """Saved at TP 2, loaded at TP 1: the adapter equals what megatron's own dist_checkpointing.load
    reshards into the same run, tensor by tensor; masters are the cast of it."""
    _, results = stock_dirs
    for r in results:
        outcome = r["native_tp2_into_tp1"]
        assert outcome["result"]["source"] == "native-dist" and outcome["result"]["adapter_restored"], outcome
        assert outcome["names"] > 0 and outcome["differ"] == [], outcome
        assert outcome["masters_match_adapter"], outcome
        assert any("NOT restored" in line for line in outcome["logged"]), outcome["logged"]


def test_a_checkpoint_named_as_miles_native_lora_writes_it_warm_starts_bit_exactly_at_tp2(stock_dirs):
    """Miles' native LoRA names (`<block>.lora_o_adapter.o_A` / `o_B`, the layers stacked on a
    leading axis or numbered in the key) and layouts (A split on axis 1 over TP 2, B replicated),
    written by megatron-core's dist_checkpointing.save: the run warm-starts from each form, every
    adapter tensor bit-identical to the written one, masters the cast of it. Without the mapping
    (the old behaviour) the same checkpoint is refused; a native split q/k/v adapter is refused
    naming its item. Nothing changes on a refusal; the same error on both ranks."""
    _, results = stock_dirs
    errors = set()
    for r in results:
        names = r["native_names"]
        assert names["expected"] == 4, names  # o_A and o_B of 2 layers on this rank
        stacked, per_layer = names["stacked"], names["per layer"]
        assert stacked["keys"] == ["layers.lora_o_adapter.o_A", "layers.lora_o_adapter.o_B"], stacked
        assert per_layer["keys"] == [f"layers.{g}.lora_o_adapter.o_{f}" for g in (0, 1) for f in "AB"], per_layer
        for outcome in (stacked, per_layer):
            assert set(outcome["keys"]) <= set(outcome["items"]), outcome
            assert outcome["result"]["source"] == "native-dist" and outcome["result"]["adapter_restored"], outcome
            assert outcome["differ"] == [] and outcome["masters_match_adapter"], outcome
        unmapped, split = names["unmapped"], names["split"]
        for outcome in (unmapped, split):
            assert outcome["result"] is None and outcome["changed"] is None, outcome
            assert "rank 0:" in outcome["error"] and "rank 1:" in outcome["error"], outcome["error"]
        assert "this model does not have" in unmapped["error"], unmapped  # the old behaviour: names differ
        assert "layers.lora_o_adapter.o_A" in unmapped["error"], unmapped
        assert "'layers.lora_qkv_adapter.q_A'" in split["error"] and "native split adapter" in split["error"], split
        errors.add(split["error"])
    assert len(errors) == 1, errors


def test_native_warm_start_refuses_a_missing_parameter_or_another_lora_rank_on_every_rank(stock_dirs):
    """A native checkpoint missing one adapter parameter, one of another LoRA rank, or one holding
    adapter weights the model lacks is refused with the same error on every rank, naming every rank,
    the parameter and (shape) both global shapes; nothing changes (every tensor compared before and
    after), also when the install fails on one rank after the other installed."""
    _, results = stock_dirs
    errors = {}
    for r in results:
        refusals = r["native_refusals"]
        missing, other, extra = refusals["missing"], refusals["lora rank 8"], refusals["dense only"]
        for outcome in (missing, other, extra):
            assert outcome["result"] is None and outcome["error"], outcome
            assert outcome["changed"] is None, outcome["changed"]
            assert "rank 0:" in outcome["error"] and "rank 1:" in outcome["error"], outcome["error"]
        assert "has no adapter parameter" in missing["error"] and repr(missing["dropped"]) in missing["error"], missing
        assert "global shape [4, " in other["error"] and "[8, " in other["error"], other["error"]
        failed = refusals["install fails on rank 1"]  # rank 0 installed, then rolled back
        assert failed["error"] and "InjectedFault" in failed["error"] and failed["changed"] is None, failed
        assert "adapter parameter(s) this model does not have" in extra["error"] and "experts" in extra["error"], extra
        errors.setdefault("missing", set()).add(missing["error"])
        errors.setdefault("extra", set()).add(extra["error"])
        errors.setdefault("other", set()).add(other["error"])
    assert all(len(e) == 1 for e in errors.values()), errors  # the same error on both ranks


def test_startup_refuses_a_launch_over_a_stock_native_checkpoint_in_load_or_save(stock_dirs, tmp_path):
    """The init hook (rank 0, agreed) refuses a --load/--save holding a stock native checkpoint and no
    plugin generation (a resume would need its optimizer state); --lora-adapter-path naming one is
    the deliberate weights-only warm start and passes."""
    from types import SimpleNamespace

    from miles_lora_ckpt.integration import resume
    from miles_lora_ckpt.integration.config import load_config

    base, _ = stock_dirs
    native_save = base / "native"
    adapter = native_save / "iter_0000002" / "adapter"
    config = load_config({})
    fresh = str(tmp_path / "fresh")
    launches = {
        "--load": dict(lora_adapter_path=None, save=fresh, load=str(native_save)),
        "--save": dict(lora_adapter_path=None, save=str(native_save), load=None),
    }
    for flag, values in launches.items():
        with pytest.raises(resume.ResumeRefused) as refused:
            resume.check_relaunch(config, SimpleNamespace(start_rollout_id=None, finetune=False, **values))
        message = str(refused.value)
        assert message.startswith(f"{flag}: ") and "stock Miles native LoRA checkpoint" in message, message
        assert str(adapter / "torch_dist") in message and "Remedy:" in message, message
        assert f"--lora-adapter-path {adapter}" in message, message
    warm = SimpleNamespace(
        start_rollout_id=None, finetune=False, lora_adapter_path=str(adapter), save=fresh, load=fresh
    )
    assert resume.check_relaunch(config, warm) == []
    # a Megatron base-model checkpoint (dist_checkpointing too, e.g. raw mode's --ref-load) is not one
    ref = tmp_path / "ref"
    shutil.copytree(adapter / "torch_dist", ref / "iter_0000000")
    assert resume.check_relaunch(config, SimpleNamespace(lora_adapter_path=None, save=fresh, load=str(ref))) == []


def test_dcp_metadata_reader_reads_megatrons_real_metadata_as_torch_does(stock_dirs):
    """The data-only reader (`core.dcp_metadata`) on the .metadata megatron-core wrote on this tier:
    every item, dtype, size, chunk and storage range equals what torch's own reader (which
    unpickles; here in the test only, as the reference) finds."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from miles_lora_ckpt.core.dcp_metadata import BytesEntry, read_metadata

    base, _ = stock_dirs
    for directory in (
        base / "native" / "iter_0000002" / "adapter" / "torch_dist",
        base / "native" / "tp2" / "adapter" / "torch_dist",
    ):
        ours = read_metadata(directory / ".metadata")
        theirs = FileSystemReader(str(directory)).read_metadata()
        assert sorted(ours.entries) == sorted(theirs.state_dict_metadata) and ours.entries
        for name, item in theirs.state_dict_metadata.items():
            mine = ours.entries[name]
            if isinstance(item, BytesStorageMetadata):
                assert isinstance(mine, BytesEntry), name
                continue
            assert f"torch.{mine.dtype}" == str(item.properties.dtype) and mine.size == tuple(item.size), name
            assert [(c.offsets, c.sizes) for c in mine.chunks] == [
                (tuple(c.offsets), tuple(c.sizes)) for c in item.chunks
            ]
        expected = {
            (i.fqn, None if i.offset is None else tuple(i.offset)): (s.relative_path, s.offset, s.length)
            for i, s in theirs.storage_data.items()
        }
        assert {k: (v.relative_path, v.offset, v.length) for k, v in ours.storage.items()} == expected
        assert ours.version == theirs.version
        if directory.parent.parent.name == "tp2":  # saved at TP 2: some adapter weights in two chunks
            assert any(len(e.chunks) == 2 for e in ours.entries.values() if not isinstance(e, BytesEntry))


def soak(payload: dict, ctx) -> dict:
    """One run saves and loads `cycles` times into one root (keep=2) through the production defaults
    (the process-wide consensus); threads, open descriptors and RSS of this process after save 1, and
    after every `every` cycles (issue 23 item 8: nothing may grow with the number of saves)."""
    run = build_run(SimConfig.from_dict(payload["config"]))
    run_steps(run, 0, 1)
    root = ctx.scratch_dir / "soak"
    samples = []
    started = time.monotonic()
    for cycle in range(1, payload["cycles"] + 1):
        save_lora_checkpoint(
            run.model, Args(), root, optimizer=run.optimizer, opt_param_scheduler=run.scheduler, iteration=cycle, keep=2
        )
        load_lora_checkpoint(run.model, root, optimizer=run.optimizer, opt_param_scheduler=run.scheduler)
        if cycle == 1 or cycle % payload["every"] == 0:
            gc.collect()
            samples.append({"cycle": cycle, **_process_resources(os.getpid())})
    teardown(run)
    return {"samples": samples, "seconds": round(time.monotonic() - started, 1)}


def _process_resources(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return {
        "objects": len(gc.get_objects()),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "rss_mib": round(rss_kib / 1024, 1),
    }


def _soak(cycles: int, every: int) -> list[dict]:
    payload = {"config": cfg(2), "cycles": cycles, "every": every}
    results = check_all(run_workers(2, "test_single_lora:soak", payload, sys_path=[TESTS], timeout_s=1800))
    return [r["samples"] for r in results]


def _assert_flat(per_rank: list[dict], rss_slack_mib: float) -> None:
    """Threads and descriptors never above the first sample's; Python objects and RSS bounded."""
    for rank, samples in enumerate(per_rank):
        first, warm, last = samples[0], samples[1], samples[-1]
        print(f"rank {rank} soak: save {first['cycle']}: {first}; save {last['cycle']}: {last}")
        assert all(s["threads"] <= first["threads"] for s in samples), (rank, samples)
        assert all(s["fds"] <= first["fds"] for s in samples), (rank, samples)
        assert last["objects"] <= warm["objects"] + 200, (rank, samples)
        assert last["rss_mib"] - warm["rss_mib"] <= rss_slack_mib, (rank, samples)


def test_soak_many_saves_and_loads_keep_threads_descriptors_and_memory_flat():
    """Issue 23 item 8, the production property (short CI version: 60 saves and loads in one process;
    `make test-long` runs 500)."""
    _assert_flat(_soak(60, 20), rss_slack_mib=16)


@pytest.mark.long
def test_soak_500_saves_and_loads_keep_threads_descriptors_and_memory_flat():
    _assert_flat(_soak(500, 50), rss_slack_mib=32)
