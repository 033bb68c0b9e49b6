"""The bench's `scale` section: how the protocol's cost grows with the state size and the world size.

For each world size W of --scale-worlds, one job of W real processes (gloo, no megatron) sweeps
every size S of --scale-sizes-mib. Each rank is a DP root holding S MiB of adapter- and
optimizer-like tensors, as in the `ratio` section. Each of --scale-repeats rounds runs a raw write
+ fsync of the same bytes and the protocol save, then a raw read and the protocol's verified load.
They run barrier to barrier on every rank, in an order rotated from round to round, with the page
cache dropped before every read. Per point it prints one line:

    SCALE W=<w> size=<s>MiB/root save/raw=<x> load/raw=<y> consensus save=<c>s load=<d>s
          manifest=<m>KiB peak save=<p>MiB load=<q>MiB ...

save/raw and load/raw: medians over rounds, measured side by side in the same job. consensus: rank
0's time inside agreement rounds (it includes waiting for the slowest rank). manifest: the
committed manifest's bytes. peak: the largest increase of any rank's peak RSS over its RSS just
before the save (or load), with freed heap returned to the OS first.

A point whose estimated memory or disk need exceeds what this host has free is skipped with a
`SCALE ... skipped` line naming what it needs. `bench --plot FILE.png` draws the curves with
matplotlib (the `plot` extra); without it the bench still runs and says so in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SCALE_PHASES = ("raw_save", "protocol_save", "raw_load", "protocol_load")
PROCESS_OVERHEAD_MIB = 400  # torch and the worker in one rank, beyond its tensors
MEMORY_SHARE = 0.8  # of MemAvailable a sweep point may plan to use


def add_arguments(bench) -> None:
    bench.add_argument(
        "--scale-worlds", default="2,4,8", help="world sizes of the SCALE section, comma-separated (default 2,4,8)"
    )
    bench.add_argument(
        "--scale-sizes-mib",
        default="64",
        help="MiB of state per DP root (every rank is one) of the SCALE section, comma-separated (default 64; "
        "the full sweep: 64,256,1024,2048 with --scale-worlds 2,4,8,16)",
    )
    bench.add_argument(
        "--scale-repeats", type=int, default=3, help="rounds per SCALE point; medians are reported (default 3)"
    )
    bench.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw the SCALE section's curves into FILE.png (needs matplotlib: the `plot` extra)",
    )


@dataclass(frozen=True)
class ScaleArgs:
    """The section's validated arguments."""

    worlds: tuple[int, ...]
    sizes_mib: tuple[int, ...]
    repeats: int


def parse_args(args) -> ScaleArgs | str:
    """The section's arguments from the parsed CLI `args`, or a one-line usage problem."""
    try:
        worlds = tuple(int(w) for w in args.scale_worlds.split(",") if w.strip())
        sizes = tuple(int(s) for s in args.scale_sizes_mib.split(",") if s.strip())
    except ValueError:
        return "--scale-worlds and --scale-sizes-mib take comma-separated whole numbers"
    if not worlds or min(worlds) < 1:
        return "--scale-worlds needs world sizes of at least 1"
    if not sizes or min(sizes) < 1:
        return "--scale-sizes-mib needs sizes of at least 1 MiB"
    if args.scale_repeats < 1:
        return "--scale-repeats must be at least 1"
    return ScaleArgs(worlds, sizes, args.scale_repeats)


def plot_available() -> bool:
    """Whether matplotlib can be imported (the `plot` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def fits(world: int, size_mib: int, *, mem_available: int, disk_free: int) -> str | None:
    """None when a point fits this host, else why not (one phrase).

    Each rank holds its tensors and, during the load, a verified copy of them; the disk holds the
    raw and the protocol files of one round."""
    memory = world * (2 * size_mib + PROCESS_OVERHEAD_MIB) * 2**20
    disk = 2 * world * size_mib * 2**20
    if memory > MEMORY_SHARE * mem_available:
        return (
            f"needs about {memory / 2**30:.1f} GiB of memory, more than {MEMORY_SHARE:.0%} of the "
            f"{mem_available / 2**30:.1f} GiB available"
        )
    if disk > disk_free:
        return f"needs {disk / 2**30:.1f} GiB of disk, {disk_free / 2**30:.1f} GiB free"
    return None


def mem_available_bytes() -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def run_section(args) -> list[dict]:
    """Run the sweep; print one line per point; return the points (also for `--json` and `--plot`)."""
    from miles_lora_ckpt_harness.sim.launch import check_all, run_workers

    scale = parse_args(args)
    assert isinstance(scale, ScaleArgs), scale  # run_bench checks the arguments first
    points: list[dict] = []
    for world in scale.worlds:
        base = Path(args.dir) / f"scale{world}" if args.dir else Path(tempfile.mkdtemp(prefix="mlc-bench-scale-"))
        base.mkdir(parents=True, exist_ok=True)
        sizes = []
        for size in scale.sizes_mib:
            why = fits(world, size, mem_available=mem_available_bytes(), disk_free=shutil.disk_usage(base).free)
            if why:
                print(f"SCALE W={world} size={size}MiB/root skipped: {why}")
            else:
                sizes.append(size)
        if not sizes:
            continue
        payload = {"dir": str(base), "sizes_mib": sizes, "repeats": scale.repeats}
        try:
            results = check_all(
                run_workers(
                    world, "miles_lora_ckpt_harness.bench.scale:scale_job", payload, timeout_s=3600, megatron=False
                )
            )
        finally:
            if not args.dir:
                shutil.rmtree(base, ignore_errors=True)
        for point in summarize(world, results):
            print(format_point(point))
            points.append(point)
    if getattr(args, "json", False):
        print(json.dumps({"scale": points}))
    return points


def summarize(world: int, results: list[dict]) -> list[dict]:
    """One point per size from every rank's job result: medians over rounds, peaks over ranks."""
    points = []
    for index, size in enumerate(results[0]["sizes_mib"]):
        per_rank = [r["points"][index] for r in results]
        root = per_rank[0]
        median = {phase: statistics.median(root["timings"][phase]) for phase in SCALE_PHASES}
        points.append(
            {
                "world": world,
                "size_mib": size,
                "seconds": median,
                "save_over_raw": median["protocol_save"] / median["raw_save"],
                "load_over_raw": median["protocol_load"] / median["raw_load"],
                "consensus_save_s": statistics.median(root["consensus"]["protocol_save"]),
                "consensus_load_s": statistics.median(root["consensus"]["protocol_load"]),
                "rounds_save": root["rounds"]["protocol_save"],
                "rounds_load": root["rounds"]["protocol_load"],
                "manifest_bytes": root["manifest_bytes"],
                "peak_save_bytes": max(r["peak"]["protocol_save"] for r in per_rank),
                "peak_load_bytes": max(r["peak"]["protocol_load"] for r in per_rank),
                "repeats": len(root["timings"]["protocol_save"]),
            }
        )
    return points


def format_point(point: dict) -> str:
    """The point's `SCALE` line."""
    size = point["size_mib"]
    seconds = point["seconds"]
    return (
        f"SCALE W={point['world']} size={size}MiB/root save/raw={point['save_over_raw']:.2f} "
        f"load/raw={point['load_over_raw']:.2f} consensus save={point['consensus_save_s']:.3f}s "
        f"load={point['consensus_load_s']:.3f}s manifest={point['manifest_bytes'] / 1024:.1f}KiB "
        f"peak save={point['peak_save_bytes'] / 2**20:.0f}MiB load={point['peak_load_bytes'] / 2**20:.0f}MiB "
        f"({point['peak_save_bytes'] / 2**20 / size:.2f} and {point['peak_load_bytes'] / 2**20 / size:.2f} of a root's "
        f"state; save {seconds['protocol_save']:.3f}s raw {seconds['raw_save']:.3f}s, load "
        f"{seconds['protocol_load']:.3f}s raw {seconds['raw_load']:.3f}s, median of {point['repeats']})"
    )


def plot(points: list[dict], path: str | os.PathLike) -> None:
    """Draw the sweep's curves into `path` (a PNG). Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({p["world"] for p in points})
    sizes = sorted({p["size_mib"] for p in points})
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5), dpi=80)
    by_world = {w: sorted((p for p in points if p["world"] == w), key=lambda p: p["size_mib"]) for w in worlds}
    by_size = {s: sorted((p for p in points if p["size_mib"] == s), key=lambda p: p["world"]) for s in sizes}
    ratios, consensus, manifest, peak = axes.flat
    for index, (world, row) in enumerate(by_world.items()):
        x, color = [p["size_mib"] for p in row], f"C{index}"  # one colour per world: save solid, load dashed
        ratios.plot(x, [p["save_over_raw"] for p in row], "o-", color=color, label=f"save W={world}")
        ratios.plot(x, [p["load_over_raw"] for p in row], "s--", color=color, label=f"load W={world}")
        peak.plot(x, [p["peak_save_bytes"] / 2**20 / p["size_mib"] for p in row], "o-", color=color, label=f"save W={world}")  # fmt: skip
        peak.plot(x, [p["peak_load_bytes"] / 2**20 / p["size_mib"] for p in row], "s--", color=color, label=f"load W={world}")  # fmt: skip
    for size, row in by_size.items():
        x = [p["world"] for p in row]
        consensus.plot(x, [p["consensus_save_s"] + p["consensus_load_s"] for p in row], "o-", label=f"{size} MiB/root")
        manifest.plot(x, [p["manifest_bytes"] / 1024 for p in row], "o-", label=f"{size} MiB/root")
    ratios.set(title="time over raw I/O", xlabel="MiB per DP root", ylabel="ratio")
    ratios.axhline(1.0, color="grey", lw=0.8)
    peak.set(title="peak RSS increase over the root's state", xlabel="MiB per DP root")
    consensus.set(title="consensus rounds, save + load (rank 0)", xlabel="world size", ylabel="s")
    manifest.set(title="manifest size", xlabel="world size", ylabel="KiB")
    for ax, ticks in ((ratios, sizes), (peak, sizes), (consensus, worlds), (manifest, worlds)):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
    for ax in axes.flat:
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# =========================================================================== worker side


def scale_job(payload: dict, ctx) -> dict:
    """Worker: every size of the sweep at this world size, each phase timed barrier to barrier."""
    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt_harness.bench import steps as timed

    consensus = timed.TimedConsensus.wrap(Consensus.for_world(timeout_s=1800))
    points = [
        _measure_size(consensus, Path(payload["dir"]), size, payload["repeats"], ctx) for size in payload["sizes_mib"]
    ]
    return {"sizes_mib": payload["sizes_mib"], "points": points}


def _measure_size(consensus, base: Path, size: int, repeats: int, ctx) -> dict:
    """One point: `repeats` rounds of the four phases with `size` MiB on this rank (dropped after)."""
    import torch.distributed as dist

    from miles_lora_ckpt.core.layout import MANIFEST
    from miles_lora_ckpt_harness.bench import steps as timed

    tensors = timed.bench_tensors(ctx.rank, size * ctx.world_size, ctx.world_size)
    raw_bytes = [timed.as_bytes(t) for t in tensors.values()]
    timings: dict[str, list[float]] = {phase: [] for phase in SCALE_PHASES}
    agreeing: dict[str, list[float]] = {"protocol_save": [], "protocol_load": []}
    rounds: dict[str, int] = {}
    peak = {"protocol_save": 0, "protocol_load": 0}
    manifest_bytes = 0
    for repeat in range(repeats):
        work = base / f"s{size}r{repeat}"
        steps = {
            "raw_save": lambda w=work: timed.raw_save(w, ctx.rank, raw_bytes),
            "protocol_save": lambda w=work: timed.protocol_save(consensus, w, ctx.rank, tensors),
            "raw_load": lambda w=work: timed.raw_load(w, ctx.rank),
            "protocol_load": lambda w=work: timed.protocol_load(consensus, w, ctx.rank),
        }
        # the raw and protocol steps alternate which goes first: neither always follows the
        # other's writeback or deletions
        saves, loads = list(SCALE_PHASES[:2]), list(SCALE_PHASES[2:])
        order = saves + loads if repeat % 2 == 0 else saves[::-1] + loads[::-1]
        for phase in order:
            before = _reset_peak()
            dist.barrier()
            started = time.perf_counter()
            consensus.start()
            steps[phase]()
            dist.barrier()
            timings[phase].append(time.perf_counter() - started)
            if phase in agreeing:
                agreeing[phase].append(sum(agree for _, _, agree in consensus.rounds))
                rounds[phase] = len(consensus.rounds)
                peak[phase] = max(peak[phase], (timed.rss_kib("VmHWM") - before) * 1024)
        if ctx.rank == 0:
            manifest_bytes = next((work / "protocol").glob(f"gen-*/{MANIFEST}")).stat().st_size
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    return {"timings": timings, "consensus": agreeing, "rounds": rounds, "peak": peak, "manifest_bytes": manifest_bytes}


def _reset_peak() -> int:
    """Return freed heap to the OS, reset the peak RSS to now; the RSS now, KiB."""
    import ctypes
    import gc

    from miles_lora_ckpt_harness.bench import steps as timed

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    timed.clear_peak_rss()
    return timed.rss_kib("VmRSS")
