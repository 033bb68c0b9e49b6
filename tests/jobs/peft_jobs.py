"""Worker functions for the PEFT export tests: the Qwen2-shaped megatron model trained with the real
DistributedOptimizer, exported through the Bridge double (installed as `megatron.bridge` in these
workers only)."""

from __future__ import annotations

import time
from pathlib import Path

from miles_lora_ckpt.core import faults, safetensors_write
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import LEASE
from miles_lora_ckpt.savers.peft_export import BridgeSource, LoraSpec, PeftExport, export_peft
from miles_lora_ckpt.savers.single_lora import save_lora_checkpoint
from miles_lora_ckpt_harness import bridge_double
from miles_lora_ckpt_harness.sim.train import build_run, config_from_dict, teardown, train_step


class Args:
    """The Miles args the single-LoRA saver records."""

    def __init__(self, config):
        self.lora_rank = config.lora_rank
        self.lora_alpha = config.lora_alpha


def lora(config, hf: str) -> LoraSpec:
    return LoraSpec(r=config.lora_rank, alpha=config.lora_alpha, base_model_name_or_path=hf)


def source(hf: str, variant: str = "nvidia", peft_helpers: bool = True) -> BridgeSource:
    # the double: 0.6.2 cannot export this harness model (our LoRA), nor yield the fork's 3-item tuples
    auto_bridge = bridge_double.install(variant=variant, peft_helpers=peft_helpers)
    return BridgeSource(auto_bridge.from_hf_pretrained(hf))


def export(run, root, hf, iteration, consensus, src=None) -> str:
    src = src or source(hf)
    return str(
        export_peft(run.model, root, source=src, lora=lora(run.config, hf), iteration=iteration, consensus=consensus)
    )


def listing(root: Path) -> dict:
    """The root's entries and mtimes, without the writer lease (its holder renews it in the background)."""
    import torch.distributed as dist

    dist.barrier()  # the coordinator removes a failed attempt's staging after the last collective
    if not root.exists():
        return {}
    return {p.name: p.lstat().st_mtime_ns for p in sorted(root.iterdir()) if not p.name.startswith(LEASE)}


def attempt(fn, *args, **kwargs) -> dict:
    started = time.monotonic()
    try:
        fn(*args, **kwargs)
        return {"error": None, "seconds": time.monotonic() - started}
    except CheckpointError as exc:
        return {"error": str(exc), "phase": exc.phase, "ranks": exc.failed_ranks, "seconds": time.monotonic() - started}


def dump_megatron_adapter(run, path: Path, rank: int) -> None:
    """This rank's raw adapter shards (the fp64 reference is computed from these, independently)."""
    from megatron.core import parallel_state as mpu

    tensors = {}
    for name, param in run.inner_model.named_parameters():
        if ".adapter." in name:
            tensors[name] = param.detach().clone()
    meta = {"tp": str(mpu.get_tensor_model_parallel_rank()), "pp": str(mpu.get_pipeline_model_parallel_rank())}
    path.mkdir(parents=True, exist_ok=True)
    safetensors_write.save_tensors(path / f"rank{rank}.safetensors", tensors, metadata=meta)


def crash_mid_write(payload: dict, ctx) -> dict:
    """A good export, then one where rank 0 SIGKILLs itself after writing the weights file (the
    protocol's mid-write: after a rank's first file)."""
    consensus = Consensus.for_world(timeout_s=payload["timeout_s"])
    run = build_run(config_from_dict(payload["config"]))
    train_step(run, 0)
    root, hf = Path(payload["root"]), payload["hf"]
    export(run, root, hf, 1, consensus)
    if ctx.rank == 0:
        faults.arm("mid-write", 0, "kill")
    train_step(run, 1)
    return attempt(export, run, root, hf, 2, consensus)


def export_story(payload: dict, ctx) -> dict:
    """Per case: train, dump the raw shards, export standalone (NVIDIA shape with Bridge's helpers, then
    the fork's shape with ours), save checkpoints with and without peft/; the TP=2 case then runs
    every failure scenario, the other retries the crashed export of `crash_mid_write`."""
    consensus = Consensus.for_world(timeout_s=60)
    hf, scratch = payload["hf"], Path(payload["scratch"])
    out: dict = {"cases": {}}
    for case in payload["cases"]:
        config = config_from_dict(case["config"])
        run = build_run(config)
        for step in range(payload["steps"]):
            train_step(run, step)
        where = scratch / case["name"]
        dump_megatron_adapter(run, where / "mshards", ctx.rank)
        result = {
            "export": export(run, where / "exports", hf, payload["steps"], consensus),
            "fork": export(run, where / "exports-fork", hf, payload["steps"], consensus, source(hf, "fork", False)),
        }
        peft = PeftExport(source=source(hf), lora=lora(config, hf))
        result["ckpt"] = save(run, where / "ckpt", payload["steps"], consensus, peft)
        result["plain"] = save(run, where / "plain", payload["steps"], consensus, None)
        if case.get("retry_root"):
            result["retry"] = export(run, case["retry_root"], hf, 3, consensus)
        if case.get("failures"):
            result["failures"] = failure_scenarios(run, config, where, hf, consensus, ctx)
        out["cases"][case["name"]] = result
        teardown(run)
    return out


def save(run, root, iteration, consensus, peft) -> str:
    return save_lora_checkpoint(
        run.model,
        Args(run.config),
        root,
        optimizer=run.optimizer,
        opt_param_scheduler=run.scheduler,
        iteration=iteration,
        consensus=consensus,
        peft=peft,
    )


def failure_scenarios(run, config, where: Path, hf: str, consensus, ctx) -> dict:
    """What stays on this harness model: a model without adapters is refused on every rank at
    `peft-plan`, from the model's parameters, before any Bridge call. (The fault matrix, the failing
    export inside a checkpoint save, partial and rank-inconsistent exports run on the real Bridge:
    tests/test_bridge_real.py.)"""
    empty_root = where / "empty-export"
    empty = attempt(export, _model_without_adapters(config), empty_root, hf, 1, consensus)
    empty["root_exists"] = empty_root.exists()
    return {"empty": empty}


class _Run:
    def __init__(self, model, config):
        self.model, self.config = model, config


def _model_without_adapters(config) -> _Run:
    from dataclasses import replace

    from miles_lora_ckpt_harness.sim.qwen2_model import SimQwen2Model

    bare = replace(config, adapters="none")
    return _Run([SimQwen2Model(bare.transformer_config(), bare)], bare)
