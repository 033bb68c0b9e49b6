"""The bench's `async` section: how long an asynchronous save blocks training, against a synchronous save.

W=--async-world (2) real processes run megatron's DistributedOptimizer on a LoRA whose one bucket
is about --async-bucket-mib MiB of fp32, after one training step. Each of --repeats rounds runs
these, barrier to barrier on every rank, in an order rotated from round to round:

    sync     `save_lora_checkpoint` of the state, until it returns (committed)
    async    `AsyncSaver.save` of the same state, until it returns (the snapshot: training is
             blocked this long), then `wait()` until it committed

Prints, from the medians over rounds of the slowest rank's times,
`ASYNC blocked/sync=<x> (blocked <b>s, sync <s>s, async commit <c>s) ...`: the fraction of a
synchronous save's time that training is blocked by an asynchronous one.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path


def add_arguments(bench) -> None:
    bench.add_argument("--async-world", type=int, default=2, help="processes of the ASYNC section (default 2)")
    bench.add_argument(
        "--async-bucket-mib", type=int, default=64, help="fp32 MiB of the ASYNC section's LoRA bucket (default 64)"
    )


def run_section(args) -> None:
    from miles_lora_ckpt_harness.sim.launch import check_all, run_workers

    base = Path(args.dir) / "async" if args.dir else Path(tempfile.mkdtemp(prefix="mlc-bench-async-"))
    payload = {"dir": str(base), "bucket_mib": args.async_bucket_mib, "repeats": max(1, min(args.repeats, 5))}
    try:
        results = check_all(
            run_workers(args.async_world, "miles_lora_ckpt_harness.bench.async_save:async_job", payload, timeout_s=1800)
        )
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    rounds = len(results[0]["sync"])
    slowest = {k: [max(r[k][i] for r in results) for i in range(rounds)] for k in ("sync", "blocked", "commit")}
    sync, blocked, commit = (statistics.median(slowest[k]) for k in ("sync", "blocked", "commit"))
    print(
        f"ASYNC blocked/sync={blocked / sync:.2f} (blocked {blocked:.3f}s, sync {sync:.3f}s, async commit "
        f"{commit:.3f}s) at W={args.async_world}, a LoRA of {results[0]['lora_fp32_mib']:.0f} MiB fp32 (masters and "
        f"2 moments sharded over DP), median of {rounds}"
    )


def async_job(payload: dict, ctx) -> dict:
    """Worker: alternate synchronous and asynchronous saves of the same trained state."""
    import time

    import torch.distributed as dist

    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt.savers.single_lora import save_lora_checkpoint
    from miles_lora_ckpt.savers.single_lora.async_save import AsyncSaver
    from miles_lora_ckpt_harness.sim.train import build_bucket_run, teardown

    run, args = build_bucket_run(ctx.world_size, payload["bucket_mib"])  # as the MEM section's
    consensus = Consensus.for_world(timeout_s=1200)
    saver = AsyncSaver(timeout_s=1200)
    root = Path(payload["dir"])
    kwargs = {"optimizer": run.optimizer, "opt_param_scheduler": run.scheduler, "keep": 2}
    times: dict[str, list[float]] = {"sync": [], "blocked": [], "commit": []}

    def sync(iteration: int) -> None:
        started = time.perf_counter()
        save_lora_checkpoint(run.model, args, root, iteration=iteration, consensus=consensus, **kwargs)
        times["sync"].append(time.perf_counter() - started)

    def asynchronous(iteration: int) -> None:
        started = time.perf_counter()
        pending = saver.save(run.model, args, root, iteration=iteration, **kwargs)
        times["blocked"].append(time.perf_counter() - started)
        pending.wait()
        times["commit"].append(time.perf_counter() - started)

    for index in range(payload["repeats"]):
        order = (sync, asynchronous) if index % 2 == 0 else (asynchronous, sync)
        for offset, step in enumerate(order):
            dist.barrier()
            step(2 * index + offset + 1)
    lora = sum(p.numel() for c in run.model for n, p in c.named_parameters() if "lora_" in n)
    teardown(run)
    return {**times, "lora_fp32_mib": lora * 4 / 2**20}
