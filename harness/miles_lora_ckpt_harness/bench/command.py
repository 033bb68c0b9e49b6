"""`miles-lora-ckpt bench`: the protocol against the physical limit and its peers, side by side.

W real processes (gloo) each hold S/W MiB of adapter- and optimizer-like tensors. Each repeat runs,
interleaved (in an order rotated from repeat to repeat) and barrier to barrier on every rank:

    raw save    plain write + fsync of the same bytes (the physical limit)
    protocol    save_generation: stage, digest, fsync, agree, manifest, atomic publish
    torch.save  one pickle file per rank as Miles writes today, plus fsync (same durability)
    dcp         torch.distributed.checkpoint.save of the same tensors
    raw load    plain read of the raw files
    load        open_generation: resolve, verify every byte (digest, headers, finiteness), map tensors

Before each read the files' pages are dropped from the page cache (posix_fadvise DONTNEED), for
raw and protocol reads alike. Prints medians and the line
`RATIO save/raw=<x> load/raw=<y> save/torch_save=<z> save/dcp=<w>`.

More sections (`--sections`; default ratio,mem,scale,async, `distckpt` on request):

    mem     W=--mem-world (4) real processes with megatron's DistributedOptimizer (the sim harness,
            a LoRA whose one bucket is about --mem-bucket-mib MiB of fp32): after a training step,
            the DP root's peak RSS increase during a single-LoRA save, and during a load into a
            fresh run (a relaunch: LoRA B zero, the optimizer never stepped) and into the live run
            that saved, over the largest bucket's fp32 bytes:
            `MEM peak_rss_increase/largest_bucket=<save> (save) ...`,
            `MEM load peak_rss_increase/largest_bucket=<load> ..., a relaunch ...: the optimizer's own
            moments <m>, the load's own <load - m> ...` (the moments are what the optimizer holds
            anyway from its first step on; a fresh one allocates them when the load installs them)
            and `MEM load peak_rss_increase/largest_bucket=<live> ..., a load into a live optimizer ...`
    scale   how the cost grows (`scale`): at each world size of --scale-worlds (2,4,8) and each
            state size per DP root of --scale-sizes-mib (64), save and load time over raw I/O side
            by side, consensus time, manifest size and peak memory:
            `SCALE W=<w> size=<s>MiB/root save/raw=<x> load/raw=<y> consensus ... manifest ... peak ...`;
            `--plot FILE.png` draws the curves (matplotlib, the `plot` extra)
    async   the time an asynchronous save blocks training over a synchronous save's (`async_save`):
            `ASYNC blocked/sync=<x> (blocked <b>s, sync <s>s, async commit <c>s) ...`
    distckpt  the same LoRA run's state (DistributedOptimizer, W = each of --distckpt-worlds) saved
            and loaded by the plugin and by megatron-core's dist_checkpointing with the
            `fully_reshardable` optimizer format (`distckpt`), and a resharding load (TP 1 ->
            2) against a same-layout one: `DISTCKPT W=<w> save/ours=<x> load/ours=<y> ...` and
            `RESHARD W=<w> load/same=<z> ...`
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from miles_lora_ckpt_harness.bench import async_save, distckpt, scale
from miles_lora_ckpt_harness.bench import steps as timed

PHASES = ("raw_save", "protocol_save", "torch_save", "dcp_save", "raw_load", "protocol_load")


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="time protocol save/load against raw I/O, torch.save and DCP")
    bench.add_argument("--size-mib", type=int, default=256, help="total tensor bytes over all ranks, MiB (default 256)")
    bench.add_argument("--world-size", type=int, default=2, help="worker processes (default 2)")
    bench.add_argument("--repeats", type=int, default=8, help="interleaved repeats; medians are reported (default 8)")
    bench.add_argument("--dir", default=None, help="where to write (default: a temporary folder, removed after)")
    bench.add_argument("--json", action="store_true", help="print the medians as JSON before the RATIO line")
    bench.add_argument(
        "--sections",
        default="ratio,mem,scale,async",
        help="which of ratio, mem, scale, async, distckpt to run (default: ratio,mem,scale,async; distckpt takes about ten minutes more here)",
    )
    bench.add_argument("--mem-world", type=int, default=4, help="processes of the MEM section (default 4)")
    bench.add_argument(
        "--mem-bucket-mib", type=int, default=64, help="fp32 MiB of the MEM section's LoRA bucket (default 64)"
    )
    scale.add_arguments(bench)
    async_save.add_arguments(bench)
    distckpt.add_arguments(bench)
    bench.set_defaults(handler=run_bench)


def run_bench(args) -> int:
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = sections - {"ratio", "mem", "scale", "async", "distckpt"}
    if unknown:
        print(f"bench: unknown sections {sorted(unknown)} (known: ratio, mem, scale, async, distckpt)")
        return 2
    if "distckpt" in sections and (problem := distckpt.check_args(args)):
        print(f"bench: {problem}")
        return 2
    if "scale" in sections and isinstance(problem := scale.parse_args(args), str):
        print(f"bench: {problem}")
        return 2
    if args.plot and "scale" not in sections:
        print("bench: --plot draws the scale section's curves: add scale to --sections")
        return 2
    if args.plot and not scale.plot_available():
        print("bench: --plot needs matplotlib (pip install 'miles-lora-ckpt[plot]'): the bench runs, no plot is drawn")
    if "ratio" in sections:
        _ratio_section(args)
    if "mem" in sections:
        _mem_section(args)
    if "scale" in sections:
        points = scale.run_section(args)
        if args.plot and scale.plot_available():
            scale.plot(points, args.plot)
            print(f"bench: the scale section's curves are in {args.plot}")
    if "async" in sections:
        async_save.run_section(args)
    if "distckpt" in sections:
        distckpt.run_section(args)
    return 0


def _ratio_section(args) -> None:
    from miles_lora_ckpt_harness.sim.launch import check_all, run_workers

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="mlc-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    payload = {"dir": str(base), "size_mib": args.size_mib, "repeats": args.repeats}
    try:
        results = run_workers(
            args.world_size, "miles_lora_ckpt_harness.bench.command:bench_job", payload, timeout_s=1800, megatron=False
        )
        timings = check_all(results)[0]["timings"]
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    medians = {phase: statistics.median(timings[phase]) for phase in PHASES}
    size = args.size_mib
    print(f"bench: {size} MiB over {args.world_size} ranks, {args.repeats} repeats, in {base}")
    print(f"{'phase':<15} {'median s':>9} {'MiB/s':>9}")
    for phase in PHASES:
        print(f"{phase:<15} {medians[phase]:>9.3f} {size / medians[phase]:>9.0f}")
    if args.json:
        print(json.dumps({"size_mib": size, "world_size": args.world_size, "medians_s": medians}))
    ratio = medians["protocol_save"] / medians["raw_save"]
    print(
        f"RATIO save/raw={ratio:.2f} load/raw={medians['protocol_load'] / medians['raw_load']:.2f} "
        f"save/torch_save={medians['protocol_save'] / medians['torch_save']:.2f} "
        f"save/dcp={medians['protocol_save'] / medians['dcp_save']:.2f}"
    )


def _mem_section(args) -> None:
    from miles_lora_ckpt_harness.sim.launch import check_all, run_workers

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="mlc-bench-mem-"))
    payload = {"dir": str(base / "mem"), "bucket_mib": args.mem_bucket_mib}
    try:
        results = check_all(
            run_workers(args.mem_world, "miles_lora_ckpt_harness.bench.command:mem_job", payload, timeout_s=1800)
        )
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    root = results[0]
    bucket = root["largest_bucket_bytes"]
    load = root["load_peak_increase"]
    moments = root["load_new_state_bytes"]
    print(
        f"MEM peak_rss_increase/largest_bucket={root['save_peak_increase'] / bucket:.2f} (save) "
        f"on the DP root at W={args.mem_world}, largest bucket {bucket / 2**20:.1f} MiB fp32, "
        f"{root['buckets']} bucket(s), {root['keys']} state keys"
    )
    print(
        f"MEM load peak_rss_increase/largest_bucket={load / bucket:.2f} on the DP root at W={args.mem_world}, "
        "a relaunch (a fresh run, LoRA B zero as PEFT initialises it, its optimizer never stepped): "
        f"the optimizer's own moments (allocated to receive them) {moments / bucket:.2f}, the load's own "
        f"{(load - moments) / bucket:.2f} (the adapter, {root['load_adapter_bytes'] / bucket:.2f}, read, then "
        "swapped with the parameters as their undo record, its zero pages given back; the masters' shard "
        "verified at open and written in place, remade from the parameters on undo; the moments verified "
        "at open a block at a time and read again into the buffers that become the state)"
    )
    live = root["live_load_peak_increase"]
    print(
        f"MEM load peak_rss_increase/largest_bucket={live / bucket:.2f} on the DP root at W={args.mem_world}, "
        "a load into a live optimizer (the run that saved, stepped: a slot swap's case): the adapter swapped "
        "with the parameters as their undo record; its shard of the saved state, masters and moments, "
        "verified at open and kept until installed, where those buffers become the state; the old masters "
        "and moments kept, not copied, on undo"
    )


# =========================================================================== worker side


def bench_job(payload: dict, ctx) -> dict:
    import torch.distributed as dist

    from miles_lora_ckpt.core.consensus import Consensus

    base = Path(payload["dir"])
    consensus = timed.TimedConsensus.wrap(Consensus.for_world(timeout_s=600))
    tensors = timed.bench_tensors(ctx.rank, payload["size_mib"], ctx.world_size)
    raw_bytes = [timed.as_bytes(t) for t in tensors.values()]
    selected = payload.get("phases", PHASES)
    timings = {phase: [] for phase in PHASES}
    rounds: dict[str, list] = {}
    for repeat in range(payload["repeats"]):
        work = base / f"r{repeat}"
        steps = {
            "raw_save": lambda w=work: timed.raw_save(w, ctx.rank, raw_bytes),
            "protocol_save": lambda w=work: timed.protocol_save(consensus, w, ctx.rank, tensors),
            "torch_save": lambda w=work: timed.torch_save(w, ctx.rank, tensors),
            "dcp_save": lambda w=work: timed.dcp_save(w, ctx.rank, tensors),
            "raw_load": lambda w=work: timed.raw_load(w, ctx.rank),
            "protocol_load": lambda w=work: timed.protocol_load(consensus, w, ctx.rank),
        }
        # rotate the order of the saves (and of the loads) each repeat: no phase always runs
        # right after another's deletions or writeback
        saves, loads = list(steps)[:4], list(steps)[4:]
        order = saves[repeat % 4 :] + saves[: repeat % 4] + loads[repeat % 2 :] + loads[: repeat % 2]
        for phase in [p for p in order if p in selected]:
            step = steps[phase]
            dist.barrier()
            started = time.perf_counter()
            consensus.start()
            step()
            dist.barrier()
            timings[phase].append(time.perf_counter() - started)
            rounds[phase] = consensus.rounds
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    return {"timings": timings, "rounds": rounds}


# --------------------------------------------------------------------------- MEM


def _peak_increase(step) -> int:
    """Bytes by which the peak RSS during `step()` exceeds the RSS just before it."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap goes back to the OS: no reuse flatters the peak
    timed.clear_peak_rss()
    before = timed.rss_kib("VmRSS")
    step()
    return (timed.rss_kib("VmHWM") - before) * 1024


def mem_job(payload: dict, ctx) -> dict:
    """The MEM section: a LoRA with one large DistributedOptimizer bucket, saved and loaded."""
    import torch

    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt.megatron.optimizer_children import leaf_children
    from miles_lora_ckpt.savers.single_lora import load_lora_checkpoint, save_lora_checkpoint
    from miles_lora_ckpt_harness.sim.train import build_bucket_run, build_run, teardown

    run, args = build_bucket_run(ctx.world_size, payload["bucket_mib"])
    consensus = Consensus.for_world(timeout_s=1200)
    root = Path(payload["dir"])
    save = lambda: save_lora_checkpoint(  # noqa: E731
        run.model,
        args,
        root,
        optimizer=run.optimizer,
        opt_param_scheduler=run.scheduler,
        iteration=1,
        consensus=consensus,
    )
    save_increase = _peak_increase(save)
    buckets = [
        bucket.grad_data.numel() * 4
        for child in leaf_children(run.optimizer)
        if not child.is_stub
        for buffer in child.optimizer.buffers
        for bucket in buffer.buckets
    ]
    keys = len(next(s for s in run.optimizer.chained_optimizers[0].optimizer.state.values() if s)) - 1
    live = lambda: load_lora_checkpoint(  # noqa: E731
        run.model, root, optimizer=run.optimizer, opt_param_scheduler=run.scheduler, consensus=consensus
    )
    live_increase = _peak_increase(live)  # into the optimizer that saved: live, stepped
    teardown(run)
    fresh = build_run(run.config)
    # a relaunch: the sim's LoRA B starts small but not zero (so that adapters matter at step 0 in
    # tests); PEFT and megatron-bridge initialise it to zero, the masters are made from it
    with torch.no_grad():
        for chunk in fresh.model:
            for name, param in chunk.named_parameters():
                if "lora_B" in name:
                    param.zero_()
    for child in leaf_children(fresh.optimizer):
        if not child.is_stub:
            child.optimizer.reload_model_params()
    load = lambda: load_lora_checkpoint(  # noqa: E731
        fresh.model, root, optimizer=fresh.optimizer, opt_param_scheduler=fresh.scheduler, consensus=consensus
    )
    load_increase = _peak_increase(load)
    # what the load adds beyond optimizer state: the adapter it reads (dropped once applied) and
    # the undo record's copy of it; and the moments the optimizer itself allocates to receive
    adapter_bytes = sum(
        p.numel() * p.element_size() for c in fresh.model for n, p in c.named_parameters() if "lora_" in n
    )
    state_bytes = sum(
        t.numel() * t.element_size()
        for child in leaf_children(fresh.optimizer)
        if not child.is_stub
        for state in child.optimizer.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    teardown(fresh)
    return {
        "save_peak_increase": save_increase,
        "load_peak_increase": load_increase,
        "live_load_peak_increase": live_increase,
        "load_adapter_bytes": adapter_bytes,
        "load_new_state_bytes": state_bytes,
        "largest_bucket_bytes": max(buckets),
        "buckets": len(buckets),
        "keys": keys,
    }
