"""Worker functions for single-LoRA save/resume tests (real megatron DistributedOptimizer on CPU).

These runs depend on the CPU harness's three megatron fallback-path fixes (no TE/Apex here):
`step` not copied from dp-zero payloads, per-parameter `step` after load_state_dict, and step 0
for an empty DP shard; see harness/miles_lora_ckpt_harness/sim/cpu_intercepts.py.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

from miles_lora_ckpt.core import faults
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.savers.single_lora import load_lora_checkpoint, save_lora_checkpoint
from miles_lora_ckpt_harness.sim.model import SimConfig
from miles_lora_ckpt_harness.sim.snapshot import compare_digests, snapshot, snapshot_digests
from miles_lora_ckpt_harness.sim.train import build_run, teardown, train_step


class Args:
    """The few Miles args the saver reads."""

    lora_rank = 4
    lora_alpha = 4.0
    no_save_optim = False


def run_steps(run, start: int, stop: int) -> list[float]:
    return [train_step(run, step) for step in range(start, stop)]


def save(run, root, iteration: int, consensus: Consensus, args=None) -> str:
    return save_lora_checkpoint(
        run.model,
        args or Args(),
        root,
        optimizer=run.optimizer,
        opt_param_scheduler=run.scheduler,
        iteration=iteration,
        consensus=consensus,
    )


def load(run, path, consensus: Consensus, **kwargs):
    return load_lora_checkpoint(
        run.model, path, optimizer=run.optimizer, opt_param_scheduler=run.scheduler, consensus=consensus, **kwargs
    )


def reference(config: SimConfig, steps: int) -> tuple[list[float], dict]:
    run = build_run(config)
    losses = run_steps(run, 0, steps)
    digests = snapshot_digests(snapshot(run))
    teardown(run)
    return losses, digests


def save_then_resume(
    config: SimConfig,
    steps: int,
    save_at: int,
    root: Path,
    consensus: Consensus,
    load_optim: bool = True,
    load_rng: bool = True,
) -> dict:
    run = build_run(config)
    first = run_steps(run, 0, save_at)
    save(run, root, save_at, consensus)
    run_steps(run, save_at, save_at + 1)  # the interrupted run goes on a little before it dies
    teardown(run)
    resumed = build_run(config)
    result = load(resumed, root, consensus, load_optim=load_optim, load_rng=load_rng)
    rest = run_steps(resumed, result.iteration, steps)
    digests = snapshot_digests(snapshot(resumed))
    children = child_classes(resumed)
    local = local_param_counts(resumed)
    teardown(resumed)
    return {
        "losses": first + rest,
        "digests": digests,
        "result": result.__dict__,
        "children": children,
        "local_params": local,
    }


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


def case_name(config: SimConfig) -> str:
    """adam/bf16/mixed/w2-tp2-cp2 plus whatever optimizer options differ from the defaults."""
    axes = (("tp", config.tp), ("pp", config.pp), ("vpp", config.vpp), ("ep", config.ep), ("cp", config.cp))
    layout = f"w{config.world_size}" + "".join(f"-{axis}{size}" for axis, size in axes if size > 1)
    options = [f"scalar-{config.muon_scalar}"] if config.optimizer == "muon" else []
    options += [] if config.distributed is None else ["distributed" if config.distributed else "non-distributed"]
    options += ["layer-wise"] if config.layer_wise else []
    options += [f"slots{config.slots}"] if config.slots > 1 else []
    options += ["bias"] if config.adapter_bias else []
    options += [f"dropout{config.lora_dropout}"] if config.lora_dropout else []
    return "/".join([config.optimizer, *options, config.dtype, config.adapters, layout])


def local_param_counts(run) -> list[int]:
    """How many parameters each non-stub leaf child steps on this rank (0: empty groups, not a stub)."""
    from miles_lora_ckpt.megatron.optimizer_children import leaf_children

    return [
        sum(len(g["params"]) for g in c.optimizer.optimizer.param_groups)
        for c in leaf_children(run.optimizer)
        if not c.is_stub
    ]


def child_classes(run) -> list[str]:
    """`class(inner optimizer)` of every non-stub leaf child: what the case really exercised."""
    from miles_lora_ckpt.megatron.optimizer_children import leaf_children

    return [
        f"{c.class_name}({type(c.optimizer.optimizer).__module__}.{type(c.optimizer.optimizer).__name__}){'@layer-wise' if c.layer_wise else ''}"
        for c in leaf_children(run.optimizer)
        if not c.is_stub
    ]


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


def _failing_install(real, fail: bool, rank: int):
    def install(*args):
        real(*args)
        if fail:
            raise RuntimeError(f"injected failure after install on rank {rank}")

    return install


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

    from miles_lora_ckpt.core import checked_reads
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
    """What stock Miles' native (raw-mode) LoRA save writes (contract §10.6): ONE megatron-core
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


# ------------------------------------------------------------------ two writers that really overlap


def _mark(scratch: Path, event: str, rank: int) -> None:
    (scratch / f"{event}.r{rank}").touch()


def _await(scratch: Path, event: str, ranks: int, timeout_s: float) -> None:
    """Wait until ranks 0..ranks-1 of a run marked `event` (a file barrier between two runs)."""
    deadline = time.monotonic() + timeout_s
    while not all((scratch / f"{event}.r{r}").exists() for r in range(ranks)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {event} of {ranks} rank(s)")
        time.sleep(0.02)


def overlapping_writer(payload: dict, ctx) -> dict:
    """One of two whole training runs on one root that save at the same moments.

    Both runs train `steps` steps, then meet at a file barrier and both save, `saves` times. The
    `leader`'s save holds still right after its prepare (the lease taken, its staging directory
    made: a fault hook) until every rank of the other run finished its own save attempt, so the two
    saves overlap by construction; the other run's save starts only once the leader's is in flight.
    Afterwards the leader loads each generation it committed into a fresh run and compares every
    tensor, counter and scheduler field with the run at the moment it saved.
    """
    scratch, name, other = Path(payload["scratch"]), payload["name"], payload["other"]
    others, timeout_s, leader = payload["other_world"], payload["wait_s"], payload["leader"]
    consensus = Consensus.for_world(timeout_s=120)
    config = SimConfig.from_dict(payload["config"])
    current = {"save": None}
    if leader:
        real_point = faults.point

        def held_point(phase: str, rank: int) -> None:
            if phase == "after-prepare" and rank == 0 and current["save"] is not None:
                _mark(scratch, f"in-save-{name}-{current['save']}", 0)
                _await(scratch, f"done-{other}-{current['save']}", others, timeout_s)
            real_point(phase, rank)

        faults.point = held_point
    run = build_run(config)
    outcomes, at_save = [], {}
    for k in range(payload["saves"]):
        run_steps(run, k * payload["steps"], (k + 1) * payload["steps"])
        _mark(scratch, f"arrived-{name}-{k}", ctx.rank)
        _await(scratch, f"arrived-{other}-{k}", others, timeout_s)  # both runs at the same save point
        if not leader:
            _await(scratch, f"in-save-{other}-{k}", 1, timeout_s)  # the leader's save is in flight
        current["save"] = k
        iteration = (k + 1) * payload["steps"]
        staging_seen = sorted(n for n in os.listdir(payload["root"]) if n.startswith(".staging-"))
        try:
            path = save(run, payload["root"], iteration, consensus)
            at_save[path] = snapshot_digests(snapshot(run))
            outcomes.append({"saved": Path(path).name})
        except CheckpointError as exc:
            outcomes.append({"refused": str(exc), "phase": exc.phase, "staging_seen": staging_seen})
        current["save"] = None
        _mark(scratch, f"done-{name}-{k}", ctx.rank)
    _mark(scratch, f"finished-{name}", ctx.rank)
    _await(scratch, f"finished-{other}", others, timeout_s)
    loaded = {}
    if at_save:
        teardown(run)
        for path, digests in at_save.items():
            fresh = build_run(config)
            result = load(fresh, path, consensus)
            loaded[Path(path).name] = {
                "iteration": result.iteration,
                "first_difference": compare_digests(digests, snapshot_digests(snapshot(fresh))),
                "tensors": len(digests),
            }
            teardown(fresh)
    else:
        teardown(run)
    return {"pid": os.getpid(), "outcomes": outcomes, "loaded": loaded}
