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
raw and protocol reads alike. Prints medians and one closing line
`RATIO save/raw=<x> load/raw=<y> save/torch_save=<z> save/dcp=<w>`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

PHASES = ("raw_save", "protocol_save", "torch_save", "dcp_save", "raw_load", "protocol_load")


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="time protocol save/load against raw I/O, torch.save and DCP")
    bench.add_argument("--size-mib", type=int, default=256, help="total tensor bytes over all ranks, MiB (default 256)")
    bench.add_argument("--world-size", type=int, default=2, help="worker processes (default 2)")
    bench.add_argument("--repeats", type=int, default=8, help="interleaved repeats; medians are reported (default 8)")
    bench.add_argument("--dir", default=None, help="where to write (default: a temporary folder, removed after)")
    bench.add_argument("--json", action="store_true", help="print the medians as JSON before the RATIO line")
    bench.set_defaults(handler=run_bench)


def run_bench(args) -> int:
    from miles_lora_ckpt.sim.launch import check_all, run_workers

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="mlc-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    payload = {"dir": str(base), "size_mib": args.size_mib, "repeats": args.repeats}
    try:
        results = run_workers(
            args.world_size, "miles_lora_ckpt.tools.bench:bench_job", payload, timeout_s=1800, megatron=False
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
    return 0


# =========================================================================== worker side


def bench_tensors(rank: int, size_mib: int, world: int) -> dict:
    """This rank's share: a bf16 adapter part (1/4) and fp32 optimizer-like parts (3/4)."""
    import torch

    share = size_mib * 2**20 // world
    gen = torch.Generator().manual_seed(rank)
    adapter = torch.randn(share // 4 // 2, generator=gen).to(torch.bfloat16)
    tensors = {f"adapter.chunk{i}": t.clone() for i, t in enumerate(adapter.chunk(4))}
    for key in ("param", "exp_avg", "exp_avg_sq"):
        tensors[f"optimizer.{key}"] = torch.randn(share // 4 // 4, generator=gen)
    return tensors


def bench_job(payload: dict, ctx) -> dict:
    import torch.distributed as dist

    from miles_lora_ckpt.core.consensus import Consensus

    base = Path(payload["dir"])
    consensus = Consensus.for_world(timeout_s=600)
    tensors = bench_tensors(ctx.rank, payload["size_mib"], ctx.world_size)
    raw_bytes = [_as_bytes(t) for t in tensors.values()]
    timings = {phase: [] for phase in PHASES}
    for repeat in range(payload["repeats"]):
        work = base / f"r{repeat}"
        steps = {
            "raw_save": lambda w=work: _raw_save(w, ctx.rank, raw_bytes),
            "protocol_save": lambda w=work: _protocol_save(consensus, w, ctx.rank, tensors),
            "torch_save": lambda w=work: _torch_save(w, ctx.rank, tensors),
            "dcp_save": lambda w=work: _dcp_save(w, ctx.rank, tensors),
            "raw_load": lambda w=work: _raw_load(w, ctx.rank),
            "protocol_load": lambda w=work: _protocol_load(consensus, w, ctx.rank),
        }
        # rotate the order of the saves (and of the loads) each repeat: no phase always runs
        # right after another's deletions or writeback
        saves, loads = list(steps)[:4], list(steps)[4:]
        order = saves[repeat % 4 :] + saves[: repeat % 4] + loads[repeat % 2 :] + loads[: repeat % 2]
        for phase in order:
            step = steps[phase]
            dist.barrier()
            started = time.perf_counter()
            step()
            dist.barrier()
            timings[phase].append(time.perf_counter() - started)
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    return {"timings": timings}


def _as_bytes(tensor):
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _raw_save(work: Path, rank: int, chunks) -> None:
    from miles_lora_ckpt.core.storage import fsync_dir

    (work / "raw").mkdir(parents=True, exist_ok=True)
    path = work / "raw" / f"rank{rank}.bin"
    with open(path, "wb", buffering=0) as handle:
        for chunk in chunks:
            handle.write(chunk)
        os.fsync(handle.fileno())
    fsync_dir(path.parent)


def _raw_load(work: Path, rank: int) -> None:
    path = work / "raw" / f"rank{rank}.bin"
    _drop_cache(path)
    buf = bytearray(path.stat().st_size)
    with open(path, "rb", buffering=0) as handle:
        handle.readinto(buf)


def _protocol_save(consensus, work: Path, rank: int, tensors: dict) -> None:
    from miles_lora_ckpt.core.layout import Topology
    from miles_lora_ckpt.core.protocol import save_generation

    save_generation(
        consensus,
        work / "protocol",
        iteration=1,
        saver="bench",
        topology=Topology(world=consensus.world_size, dp=consensus.world_size),
        write_files=lambda writer: writer.write_tensors(f"rank{rank:05d}.safetensors", tensors),
    )


def _protocol_load(consensus, work: Path, rank: int) -> None:
    from miles_lora_ckpt.core.protocol import open_generation

    root = work / "protocol"
    for gen in root.glob("gen-*"):
        for file in gen.glob("*.safetensors"):
            if file.name == f"rank{rank:05d}.safetensors":
                _drop_cache(file)
    opened = open_generation(consensus, root, lambda manifest: [f"rank{rank:05d}.safetensors"])
    opened.tensors(f"rank{rank:05d}.safetensors")


def _torch_save(work: Path, rank: int, tensors: dict) -> None:
    import torch

    (work / "torch").mkdir(parents=True, exist_ok=True)
    path = work / "torch" / f"rank{rank}.pt"
    torch.save(tensors, path)
    _fsync_file(path)


def _dcp_save(work: Path, rank: int, tensors: dict) -> None:
    import torch.distributed.checkpoint as dcp

    state = {f"rank{rank}.{name}": tensor for name, tensor in tensors.items()}
    dcp.save(state, checkpoint_id=str(work / "dcp"))
