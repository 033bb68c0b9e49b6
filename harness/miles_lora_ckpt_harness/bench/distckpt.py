"""The bench's `distckpt` section: the plugin against megatron-core's `dist_checkpointing`.

For W in --distckpt-worlds (2,4), W real processes (gloo) run megatron's DistributedOptimizer on a
bf16 LoRA whose one bucket is about --distckpt-bucket-mib MiB of fp32, after one training step.
Each of --repeats rounds runs these on the same storage (--dir, or a temporary folder), barrier to
barrier on every rank, in an order rotated from round to round:

    ours save     `save_lora_checkpoint` (adapter, fp32 masters, moments, steps, scheduler)
    dc save       `megatron.core.dist_checkpointing.save` of the same state: the trainable
                  parameters' `ShardedTensor`s (global name, shape and offsets as megatron's
                  modules give them) and `optimizer.sharded_state_dict(model_sharded_state_dict,
                  metadata={"distrib_optim_sharding_type": "fully_reshardable"})` (what Miles'
                  native-LoRA branch adopts), plus the scheduler; torch_dist backend, saves spread
                  over the ranks (`FullyParallelSaveStrategyWrapper`, Megatron-LM's default)
    ours load     `load_lora_checkpoint` of that save into the same run (verify, read, install)
    dc load       `dist_checkpointing.load` (default strategy) + the optimizer's, the model's and the
                  scheduler's `load_state_dict` (what Megatron-LM's load does with it)

Before each load the files' pages are dropped from the page cache (posix_fadvise DONTNEED). Then
the run is rebuilt at TP 2 (DP W/2), loads the last TP 1 save of ours and saves it again at TP 2,
untimed. Each of --repeats rounds then loads the TP 1 save (a resharding load) and the TP 2 save (a
same-layout load), in an order rotated from round to round.

It prints, from the medians over rounds of the slowest rank's times,
`DISTCKPT W=<w> save/ours=<x> load/ours=<y>`: dist_checkpointing's time over ours. It prints
`RESHARD W=<w> load/same=<z>`: our resharding load's time over our same-layout load at TP 2, which
is what changing the layout costs; it is also printed over the TP 1 same-layout load. Each rank's
bytes read (`rchar` of /proc/self/io) and median process CPU seconds of both loads come with them,
being less sensitive than wall time to other work on the machine.

With --distckpt-profile DIR, rank 0 runs our loads under cProfile (the timed figures then include
the profiler's overhead) and writes `DIR/W{w}-same.prof` (the same-layout loads) and
`DIR/W{w}-reshard.prof` (the resharding loads) and `DIR/W{w}-tp2.prof` (the same-layout loads at TP
2), readable with `python -m pstats`.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
PHASES = ("ours_save", "dc_save", "ours_load", "dc_load")


def add_arguments(bench) -> None:
    """The `distckpt` section's flags of `miles-lora-ckpt bench`."""
    bench.add_argument(
        "--distckpt-worlds", default="2,4", help="world sizes of the DISTCKPT section (default 2,4; even numbers)"
    )
    bench.add_argument(
        "--distckpt-bucket-mib",
        type=float,
        default=64,
        help="fp32 MiB of the DISTCKPT section's LoRA bucket (default 64)",
    )
    bench.add_argument(
        "--distckpt-profile",
        default=None,
        metavar="DIR",
        help="profile rank 0's loads of the DISTCKPT section with cProfile into DIR/W<w>-same.prof, "
        "DIR/W<w>-reshard.prof and DIR/W<w>-tp2.prof (the figures then include the profiler's overhead)",
    )


def check_args(args) -> str | None:
    """A usage problem of the section's flags, or None."""
    try:
        worlds = [int(w) for w in args.distckpt_worlds.split(",") if w.strip()]
    except ValueError:
        worlds = []
    if not worlds or any(w < 2 or w % 2 for w in worlds):
        return f"--distckpt-worlds must list even world sizes >= 2 (the resharding load runs at TP 2), got {args.distckpt_worlds!r}"
    if not args.distckpt_bucket_mib > 0:
        return f"--distckpt-bucket-mib must be positive, got {args.distckpt_bucket_mib}"
    return None


def run_section(args) -> None:
    """Run the section for each world size and print its DISTCKPT and RESHARD lines."""
    from miles_lora_ckpt_harness.sim.launch import check_all, run_workers

    for world in [int(w) for w in args.distckpt_worlds.split(",") if w.strip()]:
        base = Path(args.dir) / f"distckpt{world}" if args.dir else Path(tempfile.mkdtemp(prefix="mlc-bench-dc-"))
        base.mkdir(parents=True, exist_ok=True)
        payload = {"dir": str(base), "bucket_mib": args.distckpt_bucket_mib, "repeats": max(1, args.repeats)}
        profile = getattr(args, "distckpt_profile", None)
        if profile:
            Path(profile).mkdir(parents=True, exist_ok=True)
            payload["profile"] = str(Path(profile).resolve() / f"W{world}")
        try:
            results = check_all(
                run_workers(world, "miles_lora_ckpt_harness.bench.distckpt:distckpt_job", payload, timeout_s=1800)
            )
        finally:
            if not args.dir:
                shutil.rmtree(base, ignore_errors=True)
        rounds = len(results[0]["ours_save"])
        keys = (*PHASES, "reshard_load", "tp2_load")
        slowest = {k: [max(r[k][i] for r in results) for i in range(rounds)] for k in keys}
        med = {k: statistics.median(v) for k, v in slowest.items()}
        print(
            f"DISTCKPT W={world} save/ours={med['dc_save'] / med['ours_save']:.2f} "
            f"load/ours={med['dc_load'] / med['ours_load']:.2f} (ours save {med['ours_save']:.3f}s load "
            f"{med['ours_load']:.3f}s; dist_checkpointing fully_reshardable save {med['dc_save']:.3f}s load "
            f"{med['dc_load']:.3f}s), a LoRA of {results[0]['lora_fp32_mib']:.0f} MiB fp32, median of {rounds}"
        )
        print(
            f"RESHARD W={world} load/same={med['reshard_load'] / med['tp2_load']:.2f} (TP 1 DP {world} saved, "
            f"loaded at TP 2 DP {world // 2}: {med['reshard_load']:.3f}s; saved and loaded at TP 2 DP {world // 2}: "
            f"{med['tp2_load']:.3f}s; MiB read per rank {_mib(results, 'reshard_load')} and "
            f"{_mib(results, 'tp2_load')}; process CPU per rank {_cpu(results, 'reshard_load')}s and "
            f"{_cpu(results, 'tp2_load')}s; {med['reshard_load'] / med['ours_load']:.2f} over the load at TP 1 DP "
            f"{world} above)"
        )


def _mib(results: list[dict], key: str) -> str:
    """Each rank's median MiB read by `key`'s loads, `/`-separated in rank order ("?" where unknown)."""
    return "/".join(
        f"{statistics.median(r['read'][key]) / 2**20:.0f}" if r["read"][key] and None not in r["read"][key] else "?"
        for r in results
    )


def _read_bytes() -> int | None:
    """This process's bytes read so far (`rchar` of /proc/self/io: every read and pread, page cache
    hits included), or None where the kernel gives no such file."""
    try:
        with open("/proc/self/io") as io:
            for line in io:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _cpu(results: list[dict], key: str) -> str:
    """Each rank's median process CPU seconds of `key`'s loads, `/`-separated in rank order."""
    return "/".join(f"{statistics.median(r['cpu'][key]):.3f}" for r in results)


# =========================================================================== worker side


def _config(world: int, bucket_mib: float, tp: int):
    """The MEM section's LoRA shape (`sim.train.build_bucket_run`) at tensor-parallel size `tp`."""
    import math

    from miles_lora_ckpt_harness.sim.model import SimConfig

    hidden, rank = 1024, 128
    layers = max(1, math.ceil(bucket_mib * 2**20 / 4 / (10 * hidden * rank)))
    return SimConfig(
        world_size=world,
        tp=tp,
        dtype="bf16",
        adapters="dense",
        distributed=True,
        num_layers=layers,
        hidden=hidden,
        ffn_hidden=4 * hidden,
        lora_rank=rank,
    )


def model_sharded_state_dict(run) -> dict:
    """`{global name: ShardedTensor}` of every trainable parameter, with megatron's own global shape
    and offsets (`megatron.param_blocks`).

    The data is the parameter itself: dist_checkpointing loads into it, and the optimizer's
    fully_reshardable state finds its parameters by it. DP replicas, and TP replicas of a replicated
    factor, are marked as such, so each element is written once."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from miles_lora_ckpt.core.global_layout import Block
    from miles_lora_ckpt.megatron import adapter_shards, param_blocks

    blocks = {n: Block.from_dict(b, n) for n, b in param_blocks.describe(run.model).items() if b is not None}
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    out = {}
    for name, param in adapter_shards.adapter_params(run.model).items():
        block = blocks[name]
        whole = tuple(block.global_shape) == tuple(param.shape)
        out[block.name] = ShardedTensor(
            key=block.name,
            data=param,
            dtype=param.dtype,
            local_shape=tuple(param.shape),
            global_shape=tuple(block.global_shape),
            global_offset=tuple(block.offset),
            axis_fragmentations=tuple(g // s for g, s in zip(block.global_shape, param.shape, strict=True)),
            replica_id=(tp_rank if whole else 0, 0, dp_rank),
        )
    assert dist.is_initialized()
    return out


def _dc_state(run, loading: bool) -> dict:
    model = model_sharded_state_dict(run)
    optimizer = run.optimizer.sharded_state_dict(model, is_loading=loading, metadata=SHARDING)
    return {"model": model, "optimizer": optimizer, "opt_param_scheduler": run.scheduler.state_dict()}


def _dc_save(run, path: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    path.mkdir(parents=True, exist_ok=True)
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy())
    dist_checkpointing.save(_dc_state(run, loading=False), str(path), sharded_strategy=strategy)


def _dc_load(run, path: Path) -> None:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_dc_state(run, loading=True), str(path))
    # the model's ShardedTensors were loaded into the parameters themselves (their `data`)
    run.optimizer.load_state_dict(loaded["optimizer"])
    # megatron's OptimizerParamScheduler.load_state_dict steps by the saved count: Megatron-LM calls
    # it on a fresh scheduler (num_steps 0), which this run's is made to be
    run.scheduler.num_steps = 0
    run.scheduler.load_state_dict(loaded["opt_param_scheduler"])


def _drop_cache(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def distckpt_job(payload: dict, ctx) -> dict:
    """Worker: the four phases, rotated, `repeats` times at TP 1; then resharding loads at TP 2."""
    import torch.distributed as dist

    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt.savers.single_lora import load_lora_checkpoint, save_lora_checkpoint
    from miles_lora_ckpt_harness.sim.snapshot import compare_digests, snapshot, snapshot_digests
    from miles_lora_ckpt_harness.sim.train import build_run, teardown, train_step

    base = Path(payload["dir"])
    world = ctx.world_size
    consensus = Consensus.for_world(timeout_s=1200)
    timed = (*PHASES, "reshard_load", "tp2_load")
    times: dict[str, list[float]] = {k: [] for k in timed}
    cpus: dict[str, list[float]] = {k: [] for k in timed}  # this process's CPU seconds
    reads: dict[str, list] = {k: [] for k in timed}  # this process's bytes read (None: unknown)

    class _Args:
        lora_rank = 128
        lora_alpha = 128.0
        no_save_optim = False

    profiles: dict = {}

    def profiled(what: str, fn, *args, **kwargs):
        """`fn(*args, **kwargs)`, under rank 0's cProfile of `what` when --distckpt-profile is given."""
        if not payload.get("profile") or ctx.rank != 0:
            return fn(*args, **kwargs)
        import cProfile

        profiler = profiles.setdefault(what, cProfile.Profile())
        return profiler.runcall(fn, *args, **kwargs)

    run = build_run(_config(world, payload["bucket_mib"], tp=1))
    train_step(run, 0)
    before = snapshot_digests(snapshot(run))
    ours_root = base / "ours"
    kwargs = {"optimizer": run.optimizer, "opt_param_scheduler": run.scheduler, "consensus": consensus}
    steps = {
        "ours_save": lambda i: save_lora_checkpoint(run.model, _Args(), ours_root, iteration=i + 1, keep=2, **kwargs),
        "dc_save": lambda i: _dc_save(run, base / f"dc{i}"),
        "ours_load": lambda i: profiled("same", load_lora_checkpoint, run.model, ours_root, **kwargs),
        "dc_load": lambda i: _dc_load(run, base / f"dc{i}"),
    }
    for index in range(payload["repeats"]):
        saves, loads = list(PHASES[:2]), list(PHASES[2:])
        order = saves[index % 2 :] + saves[: index % 2] + loads[index % 2 :] + loads[: index % 2]
        for phase in order:
            if phase.endswith("load") and ctx.rank == 0:
                _drop_cache(base)
            dist.barrier()
            started, cpu = time.perf_counter(), time.process_time()
            steps[phase](index)
            cpus[phase].append(time.process_time() - cpu)
            dist.barrier()
            times[phase].append(time.perf_counter() - started)
        dist.barrier()
        if ctx.rank == 0 and index < payload["repeats"] - 1:
            shutil.rmtree(base / f"dc{index}", ignore_errors=True)
    # each load restores the state saved, every tensor and counter: a training step away from it,
    # then the load (untimed), then the same digests as before the saves
    for name, load in (("dist_checkpointing", steps["dc_load"]), ("ours", steps["ours_load"])):
        train_step(run, 1)
        load(payload["repeats"] - 1)
        changed = compare_digests(before, snapshot_digests(snapshot(run)))
        if changed is not None:
            raise RuntimeError(f"{name}'s load did not restore the state saved: {changed} differs")
    lora = sum(p.numel() for c in run.model for n, p in c.named_parameters() if "lora_" in n)
    teardown(run)

    resharded = build_run(_config(world, payload["bucket_mib"], tp=2))
    tp2_kwargs = {"optimizer": resharded.optimizer, "opt_param_scheduler": resharded.scheduler, "consensus": consensus}
    tp2_root = base / "ours-tp2"
    load_lora_checkpoint(resharded.model, ours_root, **tp2_kwargs)  # untimed: the state to save at TP 2
    save_lora_checkpoint(resharded.model, _Args(), tp2_root, iteration=payload["repeats"], keep=2, **tp2_kwargs)
    loads = {"reshard_load": ("reshard", ours_root), "tp2_load": ("tp2", tp2_root)}
    for index in range(payload["repeats"]):
        order = list(loads)[index % 2 :] + list(loads)[: index % 2]
        for phase in order:
            what, root = loads[phase]
            if ctx.rank == 0:
                _drop_cache(base)
            dist.barrier()
            started, cpu, read = time.perf_counter(), time.process_time(), _read_bytes()
            result = profiled(what, load_lora_checkpoint, resharded.model, root, **tp2_kwargs)
            cpus[phase].append(time.process_time() - cpu)
            after = _read_bytes()
            reads[phase].append(after - read if None not in (read, after) else None)
            dist.barrier()
            times[phase].append(time.perf_counter() - started)
            if not result.optimizer_restored:
                raise RuntimeError(f"the {what} load did not restore the optimizer")
    teardown(resharded)
    for what, profiler in profiles.items():
        profiler.dump_stats(f"{payload['profile']}-{what}.prof")
    _stop_dc_writer_manager()
    return {**times, "cpu": cpus, "read": reads, "lora_fp32_mib": lora * 4 / 2**20}


def _stop_dc_writer_manager() -> None:
    """Shut down the `multiprocessing` manager process megatron's `FileSystemWriterAsync` starts for
    its results queue (`filesystem_async._get_write_results_queue`, once per process, never shut
    down): a harness worker leaves through `os._exit`, which skips the manager's finalizer, so the
    manager (a spawned Python of ~300 MiB) would outlive the bench."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = getattr(filesystem_async, "_results_queue", None)
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        manager.shutdown()
    filesystem_async._results_queue = None
