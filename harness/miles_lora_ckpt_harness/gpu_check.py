"""`make gpu-check`: the GPU path, checked in a few minutes on one GPU (skips in one line without CUDA).

    python -m miles_lora_ckpt_harness.gpu_check [--device auto|cuda|cpu] [--world-size N] [--size-mib S]
                                              [--repeats R] [--dir DIR] [--json]

W processes (one per GPU; `--world-size`, default every visible GPU) join NCCL as the default
process group, as a Megatron run does; the plugin's consensus runs on its own gloo group
(`Consensus.for_world`). Each rank holds --size-mib MiB of adapter- and optimizer-like tensors on
its GPU (the bench's mix: bf16 and fp32), changed by one step on the device. Three checks:

    bitexact   the protocol's save of the CUDA tensors, then its verified load: every loaded byte
               equals the device tensor's (no tolerance); the ranks' mismatch counts are summed
               with an NCCL all-reduce on the default group
    hostcopy   the asynchronous save's snapshot copy (`async_save.HostCopier`): every copy lands
               in pinned host memory through one side stream per device, keeps the snapshot's bits
               when training writes the tensors right after, and its device-to-host rate
    stall      a training step (matmuls on the device) timed while an asynchronous save runs: our
               snapshot and background protocol save, against torch DCP's `async_save` (its own
               staging, a gloo group for its collectives) in the same run; the stall is the time
               the call blocks plus the time the steps run slower until the save is done

Prints `GPUCHECK ...` lines, then `GPUCHECK RESULT: ok` (exit 0) or `GPUCHECK RESULT: FAILED <checks>`
(exit 1). `--device cpu` runs the same checks over gloo on CPU: a dry run of the logic, not of the
GPU path (no pinned memory, no stream; its timings mean nothing). On one GPU the world is one
process: its consensus group exists but its rounds are local.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SKIP_LINE = "GPUCHECK skipped: no CUDA device here (torch.cuda.is_available() is False); --device cpu runs the dry run"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m miles_lora_ckpt_harness.gpu_check",
        description="check the GPU path: bit-exact save and load on CUDA (NCCL default group, gloo consensus), "
        "the async save's pinned side-stream copy, and a training step's stall against DCP's async_save",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto (default): cuda when available, else skip in one line; cpu: the dry run over gloo",
    )
    parser.add_argument(
        "--world-size", type=int, default=0, help="processes, one per GPU (default: every visible GPU; 2 on cpu)"
    )
    parser.add_argument("--size-mib", type=int, default=256, help="MiB of state per rank (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the stall check; medians (default 3)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder, removed after)")
    parser.add_argument("--json", action="store_true", help="also print every rank's measurements as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 when every check passed (or CUDA is absent under auto), 1 when one failed, 2 on usage."""
    args = build_parser().parse_args(argv)
    import torch

    device = args.device
    if device == "auto":
        if not torch.cuda.is_available():
            print(SKIP_LINE)
            return 0
        device = "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: --device cuda, but torch sees no CUDA device")
        return 2
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    world = args.world_size or (gpus if device == "cuda" else 2)
    if world < 1 or args.size_mib < 1 or args.repeats < 1:
        print("gpu-check: --world-size, --size-mib and --repeats must be at least 1")
        return 2
    if device == "cuda" and world > gpus:
        print(f"gpu-check: --world-size {world} needs {world} GPUs (one per rank for NCCL), {gpus} visible")
        return 2
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="mlc-gpu-check-"))
    base.mkdir(parents=True, exist_ok=True)
    spec = {"device": device, "size_mib": args.size_mib, "repeats": args.repeats, "dir": str(base)}
    try:
        results = launch(world, spec, base)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    failed = [r for r in results if "error" in r]
    if failed:
        for r in failed:
            print(f"GPUCHECK rank {r['rank']} failed: {r['error']}")
        print("GPUCHECK RESULT: FAILED (a rank failed)")
        return 1
    lines, problems = report(results)
    print("\n".join(lines))
    if args.json:
        print(json.dumps(results))
    print(f"GPUCHECK RESULT: FAILED ({', '.join(problems)})" if problems else "GPUCHECK RESULT: ok")
    return 1 if problems else 0


def launch(world: int, spec: dict, base: Path, timeout_s: float = 1200) -> list[dict]:
    """Run `world` worker processes (this module with --worker) and return their JSON results by rank."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (base / "spec.json").write_text(json.dumps(spec))
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        log = open(base / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, "-m", "miles_lora_ckpt_harness.gpu_check", "--worker", str(base)], env=env, stdout=log, stderr=subprocess.STDOUT), log))  # fmt: skip
    _wait(procs, base, timeout_s)
    results = []
    for rank, (proc, log) in enumerate(procs):
        log.close()
        path = base / f"result{rank}.json"
        if proc.returncode == 0 and path.exists():
            results.append(json.loads(path.read_text()))
        else:
            tail = (base / f"rank{rank}.log").read_text()[-2000:]
            results.append({"rank": rank, "error": f"exit code {proc.returncode}; output ends:\n{tail}"})
    return results


def _wait(procs: list, base: Path, timeout_s: float, grace_s: float = 30.0) -> None:
    """Wait for every rank; once one failed (or at the timeout), the others get `grace_s`, then are killed.

    A rank that failed leaves its peers in a collective until their group's timeout: never wait that long."""
    deadline = time.monotonic() + timeout_s
    while any(proc.poll() is None for proc, _ in procs) and time.monotonic() < deadline:
        if any(_failed(rank, proc, base) for rank, (proc, _) in enumerate(procs)):
            deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.2)
    for proc, _ in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _failed(rank: int, proc, base: Path) -> bool:
    if proc.poll() is not None and proc.returncode != 0:
        return True
    path = base / f"result{rank}.json"
    return path.exists() and '"error"' in path.read_text()


def report(results: list[dict]) -> tuple[list[str], list[str]]:
    """The `GPUCHECK` lines for every rank's results, and the names of the checks that failed."""
    root = results[0]
    problems = []
    mismatched = sum(r["bitexact"]["mismatched_tensors"] for r in results)
    if mismatched or root["bitexact"]["all_reduced_mismatches"] != mismatched:
        problems.append("bitexact")
    copies = [r["hostcopy"] for r in results]
    cuda = root["device"].startswith("cuda")
    if not all(c["kept_bits"] for c in copies) or (cuda and not all(c["pinned"] and c["streams"] == 1 for c in copies)):
        problems.append("hostcopy")
    ours, dcp = (statistics.median(max(r["stall"][k][i] for r in results) for i in range(root["repeats"])) for k in ("ours", "dcp"))  # fmt: skip
    blocked = {k: statistics.median(max(r["stall"][f"{k}_blocked"][i] for r in results) for i in range(root["repeats"])) for k in ("ours", "dcp")}  # fmt: skip
    mib = root["size_mib"]
    lines = [
        f"GPUCHECK device={root['device']} ({root['device_name']}) world={len(results)} "
        f"default_group={root['default_backend']} consensus_group={root['consensus_backend']} {mib}MiB/rank",
        f"GPUCHECK bitexact save+load: {'ok' if 'bitexact' not in problems else 'MISMATCH'} "
        f"({root['bitexact']['tensors']} tensors per rank, {mismatched} mismatched over every rank, "
        f"{root['default_backend']} all-reduce {root['bitexact']['all_reduced_mismatches']}; save {root['bitexact']['save_s']:.3f}s, load "
        f"{root['bitexact']['load_s']:.3f}s on rank 0)",
        f"GPUCHECK hostcopy: {'ok' if 'hostcopy' not in problems else 'FAILED'} (pinned "
        f"{'yes' if all(c['pinned'] for c in copies) else 'no'}, side streams {root['hostcopy']['streams']}, "
        f"bits kept while training wrote: {'yes' if all(c['kept_bits'] for c in copies) else 'NO'}, "
        f"{mib / root['hostcopy']['seconds']:.0f} MiB/s into host memory on rank 0)",
        f"GPUCHECK stall ours/dcp={stall_ratio(ours, dcp):.2f} (ours {ours:.3f}s: blocked {blocked['ours']:.3f}s; "
        f"dcp async_save {dcp:.3f}s: blocked {blocked['dcp']:.3f}s; training step {root['step_s']:.4f}s; "
        f"slowest rank, median of {root['repeats']})",
    ]
    return lines, problems


def stall_ratio(ours: float, dcp: float) -> float:
    """Our stall over DCP's; both floored at 1 ms so that a stall too small to measure reads as 1 ms."""
    return max(ours, 1e-3) / max(dcp, 1e-3)


def stall(blocked_s: float, step_times: list[float], baseline_s: float) -> float:
    """What a save cost training: the time its call blocked, plus how much longer the steps run while
    it was in flight took than the baseline step (never below zero in all)."""
    return blocked_s + max(0.0, sum(step_times) - baseline_s * len(step_times))


def mismatches(expected: dict, loaded: dict) -> list[str]:
    """The names whose loaded tensor differs from the expected one in dtype, shape or any bit."""
    import torch

    wrong = []
    for name, tensor in expected.items():
        other = loaded.get(name)
        if other is None or other.dtype != tensor.dtype or tuple(other.shape) != tuple(tensor.shape):
            wrong.append(name)
            continue
        a = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        b = other.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(a, b):
            wrong.append(name)
    return sorted(wrong + [n for n in loaded if n not in expected])


# =========================================================================== worker side


def worker(base: Path) -> int:
    """One rank: join the groups, run the three checks, write result<rank>.json."""
    import torch
    import torch.distributed as dist

    spec = json.loads((base / "spec.json").read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)  # the dry run's ranks share the host's cores
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}))
    try:
        result = run_checks(spec, rank, world, device, base)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which prints it
        import traceback

        result = {"rank": rank, "error": "".join(traceback.format_exception(exc))[-3000:]}
    finally:
        dist.destroy_process_group()
    (base / f"result{rank}.json").write_text(json.dumps(result))
    return 0


def run_checks(spec: dict, rank: int, world: int, device, base: Path) -> dict:
    """The three checks on this rank; JSON-able results."""
    import torch
    import torch.distributed as dist

    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt_harness.bench.steps import bench_tensors

    consensus = Consensus.for_world(timeout_s=600)  # the plugin's own gloo group
    dcp_group = dist.new_group(backend="gloo")  # DCP's async_save collectives, off the NCCL group
    tensors = {n: t.to(device) for n, t in bench_tensors(rank, spec["size_mib"] * world, world).items()}
    for t in tensors.values():
        t.mul_(0.5).add_(0.25)  # one step on the device: the saved state is the device's
    result = {
        "rank": rank,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU dry run",
        "default_backend": dist.get_backend(),
        "consensus_backend": dist.get_backend(consensus.group) if consensus.group is not None else "none",
        "size_mib": spec["size_mib"],
        "repeats": spec["repeats"],
    }
    result["bitexact"] = _bitexact(consensus, tensors, base / "bitexact", device)
    result["hostcopy"] = _hostcopy(tensors, device)
    result.update(_stall(consensus, dcp_group, tensors, base / "stall", device, spec["repeats"]))
    return result


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bitexact(consensus, tensors: dict, root: Path, device) -> dict:
    import torch
    import torch.distributed as dist

    from miles_lora_ckpt.core.layout import Topology
    from miles_lora_ckpt.core.protocol import open_generation, save_generation

    name = f"rank{consensus.rank:05d}.safetensors"
    _sync(device)
    started = time.perf_counter()
    save_generation(
        consensus,
        root,
        iteration=1,
        saver="gpu-check",
        topology=Topology(world=consensus.world_size, dp=consensus.world_size),
        write_files=lambda writer: writer.write_tensors(name, tensors),
    )
    saved = time.perf_counter()
    loaded = {
        n: t.to(device) for n, t in open_generation(consensus, root, lambda manifest: [name]).tensors(name).items()
    }
    _sync(device)
    done = time.perf_counter()
    wrong = mismatches(tensors, loaded)
    count = torch.tensor([len(wrong)], dtype=torch.int64, device=device)
    dist.all_reduce(count)  # on the default group: NCCL on a GPU, while the consensus used gloo
    return {
        "tensors": len(tensors),
        "mismatched_tensors": len(wrong),
        "mismatched": wrong[:5],
        "all_reduced_mismatches": int(count.item()),
        "save_s": saved - started,
        "load_s": done - saved,
    }


def _hostcopy(tensors: dict, device) -> dict:
    from miles_lora_ckpt.savers.single_lora.async_save import HostCopier

    reference = {n: t.clone() for n, t in tensors.items()}
    _sync(device)
    copier = HostCopier()
    started = time.perf_counter()
    copies = {n: copier.copy(n, t) for n, t in tensors.items()}
    copier.finish()
    seconds = time.perf_counter() - started
    for t in tensors.values():
        t.add_(1)  # training writes right after the snapshot returned
    _sync(device)
    kept = not mismatches(reference, copies)
    for n, t in tensors.items():
        t.copy_(reference[n])
    return {
        "pinned": all(c.is_pinned() for c in copies.values()) if device.type == "cuda" else False,
        "streams": len(copier.streams),
        "device_bytes": copier.device_bytes,
        "kept_bits": kept,
        "seconds": seconds,
    }


def _stall(consensus, dcp_group, tensors: dict, root: Path, device, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from miles_lora_ckpt.core.layout import Topology
    from miles_lora_ckpt.core.protocol import save_generation
    from miles_lora_ckpt.savers.single_lora.async_save import HostCopier

    side = 4096 if device.type == "cuda" else 256
    weight = torch.randn(side, side, device=device)
    activations = torch.randn(side, side, device=device)

    def step() -> float:
        started = time.perf_counter()
        out = activations
        for _ in range(8):
            out = torch.tanh(out @ weight) * 0.5
        _sync(device)
        return time.perf_counter() - started

    for _ in range(3):
        step()  # warm up kernels and allocator
    baseline = statistics.median(step() for _ in range(10))
    name = f"rank{consensus.rank:05d}.safetensors"

    def ours(iteration: int):
        copier = HostCopier()
        snapshot = {n: copier.copy(n, t) for n, t in tensors.items()}
        copier.finish()
        outcome: dict = {}

        def write() -> None:
            try:
                save_generation(
                    consensus,
                    root / "ours",
                    iteration=iteration,
                    saver="gpu-check",
                    topology=Topology(world=consensus.world_size, dp=consensus.world_size),
                    write_files=lambda writer: writer.write_tensors(name, snapshot),
                )
            except BaseException as exc:  # noqa: BLE001 - re-raised by the waiter
                outcome["error"] = exc

        thread = threading.Thread(target=write)
        thread.start()

        def done() -> bool:
            if thread.is_alive():
                return False
            if "error" in outcome:
                raise outcome["error"]
            return True

        return done

    def torch_dcp(iteration: int):
        state = {f"rank{consensus.rank}.{n}": t for n, t in tensors.items()}
        response = dcp.async_save(state, checkpoint_id=str(root / f"dcp{iteration}"), process_group=dcp_group)
        future = getattr(response, "upload_completion", response)  # a Future, or a response holding one

        def done() -> bool:
            if not future.done():
                return False
            future.result()  # raises the save's error
            return True

        return done

    times: dict[str, list[float]] = {"ours": [], "dcp": [], "ours_blocked": [], "dcp_blocked": []}
    for repeat in range(repeats):
        order = (("ours", ours), ("dcp", torch_dcp))
        for key, start in order if repeat % 2 == 0 else order[::-1]:
            dist.barrier()
            _sync(device)
            started = time.perf_counter()
            done = start(repeat)
            blocked = time.perf_counter() - started
            steps = []
            while not done():
                steps.append(step())
            times[key].append(stall(blocked, steps, baseline))
            times[f"{key}_blocked"].append(blocked)
    dist.barrier()
    return {"stall": times, "step_s": baseline}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker(Path(sys.argv[2])))
    sys.exit(main())
