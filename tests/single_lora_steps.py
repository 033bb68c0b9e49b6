"""What the single-LoRA rank jobs share: train the harness run, save, load, and resume against an
uninterrupted run (used by the jobs in test_single_lora, test_reshard, test_optimizer_children and
test_async_save)."""

from __future__ import annotations

from pathlib import Path

from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.savers.single_lora import load_lora_checkpoint, save_lora_checkpoint
from miles_lora_ckpt_harness.sim.model import SimConfig
from miles_lora_ckpt_harness.sim.snapshot import snapshot, snapshot_digests
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


def _failing_install(real, fail: bool, rank: int):
    def install(*args):
        real(*args)
        if fail:
            raise RuntimeError(f"injected failure after install on rank {rank}")

    return install
