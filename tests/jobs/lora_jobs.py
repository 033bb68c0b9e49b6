"""Worker functions for single-LoRA save/resume tests (real megatron DistributedOptimizer on CPU).

These runs depend on the CPU harness's three megatron fallback-path fixes (no TE/Apex here):
`step` not copied from dp-zero payloads, per-parameter `step` after load_state_dict, and step 0
for an empty DP shard; see miles_lora_ckpt/sim/cpu_intercepts.py.
"""

from __future__ import annotations

from pathlib import Path

from miles_lora_ckpt.consensus import Consensus
from miles_lora_ckpt.errors import CheckpointError
from miles_lora_ckpt.sim.model import SimConfig
from miles_lora_ckpt.sim.snapshot import compare_digests, snapshot, snapshot_digests
from miles_lora_ckpt.sim.train import build_run, teardown, train_step
from miles_lora_ckpt.single_lora import load_lora_checkpoint, save_lora_checkpoint


class Args:
    """The few Miles args the saver reads."""

    lora_rank = 4
    lora_alpha = 4.0
    no_save_optim = False


def run_steps(run, start: int, stop: int) -> list[float]:
    return [train_step(run, step) for step in range(start, stop)]


def reference(config: SimConfig, steps: int) -> tuple[list[float], dict]:
    run = build_run(config)
    losses = run_steps(run, 0, steps)
    digests = snapshot_digests(snapshot(run))
    teardown(run)
    return losses, digests


def save_then_resume(config: SimConfig, steps: int, save_at: int, root: Path, consensus: Consensus) -> dict:
    run = build_run(config)
    first = run_steps(run, 0, save_at)
    save_lora_checkpoint(run.model, Args(), root, optimizer=run.optimizer, opt_param_scheduler=run.scheduler,
                         iteration=save_at, consensus=consensus)
    run_steps(run, save_at, save_at + 1)  # the interrupted run goes on a little before it dies
    teardown(run)
    resumed = build_run(config)
    result = load_lora_checkpoint(resumed.model, root, optimizer=resumed.optimizer,
                                  opt_param_scheduler=resumed.scheduler, consensus=consensus)
    rest = run_steps(resumed, result.iteration, steps)
    digests = snapshot_digests(snapshot(resumed))
    teardown(resumed)
    return {"losses": first + rest, "digests": digests, "result": result.__dict__}


def resume_matrix(payload: dict, ctx) -> dict:
    """For each config: uninterrupted reference vs save at k, crash, resume; first mismatch per config."""
    consensus = Consensus.for_world(timeout_s=120)
    out = {}
    for index, config_dict in enumerate(payload["configs"]):
        config = SimConfig.from_dict(config_dict)
        name = f"{config.dtype}/{config.adapters}/w{config.world_size}"
        ref_losses, ref_digests = reference(config, payload["steps"])
        root = ctx.scratch_dir / f"case{index}"
        got = save_then_resume(config, payload["steps"], payload["save_at"], root, consensus)
        out[name] = {
            "loss_mismatch": None if got["losses"] == ref_losses else [ref_losses, got["losses"]],
            "first_difference": compare_digests(ref_digests, got["digests"]),
            "tensors_compared": len(ref_digests),
            "names": sorted(ref_digests),
            "result": got["result"],
        }
    return out


def try_load(payload: dict, ctx) -> dict:
    """Load `payload['path']` into a fresh run; report the error and whether anything changed."""
    consensus = Consensus.for_world(timeout_s=60)
    run = build_run(SimConfig.from_dict(payload["config"]))
    run_steps(run, 0, payload.get("pre_steps", 0))
    before = snapshot_digests(snapshot(run))
    try:
        result = load_lora_checkpoint(run.model, payload["path"], optimizer=run.optimizer,
                                      opt_param_scheduler=run.scheduler, consensus=consensus)
        error = None
    except CheckpointError as exc:
        result, error = None, str(exc)
    after = snapshot_digests(snapshot(run))
    return {"error": error, "unchanged": compare_digests(before, after) is None,
            "result": result.__dict__ if result else None}
