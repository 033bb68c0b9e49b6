"""The bench's timed steps and worker-side helpers, shared by its sections (`command`, `scale`)
and the GPU check: each rank's tensors, a consensus that times its rounds, the raw, protocol,
torch.save and DCP saves and loads, and the peak RSS counters of /proc."""

from __future__ import annotations

import os
import time
from pathlib import Path


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


class TimedConsensus:
    """A consensus that records, for each agreement, the local work before it and the round itself."""

    @classmethod
    def wrap(cls, consensus):
        from miles_lora_ckpt.core.consensus import Consensus

        class Timed(Consensus):
            def start(self) -> None:
                self.rounds: list[tuple[str, float, float]] = []
                self._mark = time.perf_counter()

            def agree(self, phase, outcome):
                entered = time.perf_counter()
                try:
                    return super().agree(phase, outcome)
                finally:
                    done = time.perf_counter()
                    self.rounds.append((phase, entered - self._mark, done - entered))
                    self._mark = done

        timed = Timed(consensus.group, rank=consensus.rank, world_size=consensus.world_size)
        timed.start()
        return timed


def clear_peak_rss() -> None:
    """Reset this process's peak RSS (VmHWM) to its RSS now."""
    with open("/proc/self/clear_refs", "w") as handle:  # "5": reset the peak RSS (VmHWM) to now
        handle.write("5")


def rss_kib(field: str) -> int:
    """`field` of /proc/self/status (VmRSS, VmHWM), in KiB; raises RuntimeError if absent."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def as_bytes(tensor):
    """The tensor's bytes as a memoryview, without a copy (a CPU tensor)."""
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def fsync_file(path: Path) -> None:
    """fsync one file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(path: Path) -> None:
    """Drop the file's pages from the page cache, so that its next read comes from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_save(work: Path, rank: int, chunks) -> None:
    """The physical limit: write `chunks` to one file, fsync it and its directory."""
    from miles_lora_ckpt.core.atomic_files import fsync_dir

    (work / "raw").mkdir(parents=True, exist_ok=True)
    path = work / "raw" / f"rank{rank}.bin"
    with open(path, "wb", buffering=0) as handle:
        for chunk in chunks:
            handle.write(chunk)
        os.fsync(handle.fileno())
    fsync_dir(path.parent)


def raw_load(work: Path, rank: int) -> None:
    """Read `raw_save`'s file back whole, its page cache dropped first."""
    path = work / "raw" / f"rank{rank}.bin"
    drop_cache(path)
    buf = bytearray(path.stat().st_size)
    with open(path, "rb", buffering=0) as handle:
        handle.readinto(buf)


def protocol_save(consensus, work: Path, rank: int, tensors: dict) -> None:
    """Collective. One generation of every rank's tensors through `save_generation`."""
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


def protocol_load(consensus, work: Path, rank: int) -> None:
    """Collective. Open the newest generation and map this rank's file, every byte verified (page cache dropped first)."""
    from miles_lora_ckpt.core.protocol import open_generation

    root = work / "protocol"
    for entry in os.scandir(root):  # this rank's file in each generation (one here), found by name
        file = Path(entry.path) / f"rank{rank:05d}.safetensors"
        if entry.name.startswith("gen-") and file.exists():
            drop_cache(file)
    opened = open_generation(consensus, root, lambda manifest: [f"rank{rank:05d}.safetensors"])
    opened.tensors(f"rank{rank:05d}.safetensors")


def torch_save(work: Path, rank: int, tensors: dict) -> None:
    """One `torch.save` file per rank, as Miles writes today, plus fsync (the same durability)."""
    import torch

    (work / "torch").mkdir(parents=True, exist_ok=True)
    path = work / "torch" / f"rank{rank}.pt"
    torch.save(tensors, path)
    fsync_file(path)


def dcp_save(work: Path, rank: int, tensors: dict) -> None:
    """Collective. torch.distributed.checkpoint.save of every rank's tensors."""
    import torch.distributed.checkpoint as dcp

    state = {f"rank{rank}.{name}": tensor for name, tensor in tensors.items()}
    dcp.save(state, checkpoint_id=str(work / "dcp"))
