"""Worker functions for the real Megatron-Bridge 0.6.2 tests (the Bridge tier only).

Every run is built by `sim.bridge_model` (the real AutoBridge, provider and LoRA; megatron's real
DistributedOptimizer) and exported by the plugin through `BridgeSource(real AutoBridge)`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from miles_lora_ckpt.core import faults, safetensors_write
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import LEASE
from miles_lora_ckpt.savers.peft_export import FAULT_PHASES, BridgeSource, LoraSpec, PeftExport, export_peft
from miles_lora_ckpt.savers.single_lora import load_lora_checkpoint, save_lora_checkpoint
from miles_lora_ckpt_harness.sim import bridge_model as bm
from miles_lora_ckpt_harness.sim.snapshot import snapshot, snapshot_digests
from miles_lora_ckpt_harness.sim.train import teardown

INPUT_IDS = [[3, 17, 42, 99, 5, 64, 1, 127], [8, 8, 120, 33, 71, 2, 0, 55]]


class Args:
    """The Miles args the single-LoRA saver records."""

    def __init__(self, config: bm.BridgeRunConfig):
        self.lora_rank = config.lora_rank
        self.lora_alpha = config.lora_alpha


def lora_spec(config: bm.BridgeRunConfig, hf: str) -> LoraSpec:
    return LoraSpec(r=config.lora_rank, alpha=config.lora_alpha, base_model_name_or_path=hf)


def _close(run: bm.BridgeRun) -> None:
    run.model.clear()
    run.optimizer = run.scheduler = None
    teardown()


def _save_tensors_rank0(path: Path, tensors: dict, rank: int, metadata: dict | None = None) -> None:
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        safetensors_write.save_tensors(path, {k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)


def _exported(bridge, model) -> tuple[list[str], dict]:
    """Every rank iterates the (collective) export fully: names in order, and the tensors."""
    names, tensors = [], {}
    for item in bridge.export_adapter_weights(model, cpu=True, show_progress=False):
        names.append(item[0])
        tensors[item[0]] = item[1].detach().clone()
    return names, tensors


def export_story(payload: dict, ctx) -> dict:
    """Per case (family x layout): build, train, logits, export by the plugin (standalone and inside
    a checkpoint generation), Bridge's own `save_hf_adapter`, and the double's export next to the
    real one on the same model."""
    from miles_lora_ckpt_harness.bridge_double.export import AutoBridgeDouble

    consensus = Consensus.for_world(timeout_s=120)
    scratch = Path(payload["scratch"])
    bm.setup()
    out: dict = {"shims": shim_facts(), "startup": startup_with_the_real_bridge(payload["hf"]["qwen2"]), "cases": {}}
    ids = torch.tensor(INPUT_IDS)
    for case in payload["cases"]:
        config = bm.BridgeRunConfig.from_dict(case["config"])
        hf = payload["hf"][config.family]
        where = scratch / case["name"]
        run = bm.build_bridge_run(config, hf)
        losses = [bm.bridge_train_step(run, step) for step in range(payload["steps"])]
        _save_tensors_rank0(where / "megatron-logits.safetensors", {"logits": bm.megatron_logits(run, ids)}, ctx.rank)
        spec = lora_spec(config, hf)
        export_dir = export_peft(
            run.model,
            where / "exports",
            source=BridgeSource(run.bridge),
            lora=spec,
            iteration=payload["steps"],
            consensus=consensus,
        )
        generation = save_lora_checkpoint(
            run.model,
            Args(config),
            where / "ckpt",
            optimizer=run.optimizer,
            opt_param_scheduler=run.scheduler,
            iteration=payload["steps"],
            consensus=consensus,
            peft=PeftExport(source=BridgeSource(run.bridge), lora=spec),
        )
        run.bridge.save_hf_adapter(
            run.model, where / "bridge-own", run.lora, base_model_name_or_path=hf, show_progress=False
        )
        real_names, real = _exported(run.bridge, run.model)
        double = AutoBridgeDouble(json.loads((Path(hf) / "config.json").read_text()))
        double_names, doubled = _exported(double, run.model)
        _save_tensors_rank0(where / "real-export.safetensors", real, ctx.rank)
        _save_tensors_rank0(where / "double-export.safetensors", doubled, ctx.rank)
        if case["name"] == payload["sabotage_case"]:
            out["sabotaged"] = _sabotaged_double_exports(double, run.model, where, ctx.rank)
            plain = _save(run, where / "plain", payload["steps"], consensus, None)
            out["failures"] = failure_scenarios(run, where, hf, consensus, ctx) | {"plain": str(plain)}
        out["cases"][case["name"]] = {
            "losses": losses,
            "export": str(export_dir),
            "ckpt": str(generation),
            "bridge_own": str(where / "bridge-own"),
            "real_names": real_names,
            "double_names": double_names,
            "adapter_params": sorted(n for n, _ in run.named_parameters() if ".adapter." in n),
        }
        _close(run)
    out["resume"] = resume_story(payload["resume"], consensus)
    return out


def shim_facts() -> dict:
    """What the Bridge shims left behind in this worker, and how the plugin binds the real export."""
    import importlib
    import inspect
    import sys

    import megatron.bridge
    from megatron.bridge import AutoBridge

    from miles_lora_ckpt.megatron import bridge_export as bx
    from miles_lora_ckpt_harness.sim import bridge_shims

    try:
        importlib.import_module("transformer_engine")
        import_te = "imported"
    except ImportError as exc:
        import_te = f"{type(exc).__name__}: {exc}"
    have_te = {m: sys.modules[m].HAVE_TE for m in ("megatron.bridge.peft.utils", "megatron.bridge.peft.module_matcher")}
    mcore = {m: sys.modules[m].HAVE_TE for m in ("megatron.core.models.gpt.gpt_layer_specs",)}
    export = AutoBridge.export_adapter_weights
    source = BridgeSource(AutoBridge.__new__(AutoBridge))
    source.prepare()
    return {
        "version": megatron.bridge.__version__,
        "is_double": getattr(megatron.bridge, "IS_TEST_DOUBLE", False),
        "te_in_sys_modules": bridge_shims.fake_te_present(),
        "import_te": import_te,
        "lora_layers_te": sys.modules[bridge_shims.LORA_LAYERS].te.__doc__,
        "have_te": dict(sorted(have_te.items())),
        "mcore_have_te": mcore,
        "export_params": list(inspect.signature(export).parameters),
        "export_kwargs": source._kwargs,
        "slot_export_error": bx.slot_export_error(),
        "slot_problem": bx.slot_export_problem(),
    }


def startup_with_the_real_bridge(hf: str) -> dict:
    """The init hook's `integration.peft.prepare` with the real 0.6.2 installed: a single-LoRA run
    with export.peft builds the real AutoBridge from --hf-checkpoint; a multi-LoRA (v2) run that
    exports slots is refused, naming the Bridge version and the remedy."""
    from argparse import Namespace
    from contextlib import contextmanager
    from types import ModuleType

    from miles_lora_ckpt.integration import peft
    from miles_lora_ckpt.integration.config import load_config
    from miles_lora_ckpt.integration.shapes import SHAPES_BY_NAME
    from miles_lora_ckpt.integration.startup import UnsupportedConfiguration

    @contextmanager
    def patch_megatron_model(model):  # what Miles' context manager is to the plugin
        yield

    miles = ModuleType("miles.utils.megatron_bridge_utils")
    miles.patch_megatron_model = patch_megatron_model

    def import_module(name: str):
        if name != miles.__name__:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return miles

    args = Namespace(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, hf_checkpoint=hf, save_hf=None)
    config, shape = load_config({"MILES_LORA_CKPT_PEFT_EXPORT": "1"}), SHAPES_BY_NAME["lora-package-2026-09"]
    single = peft.prepare(args, config, shape, lora=True, import_module=import_module)
    try:
        peft.prepare(args, config, shape, lora=True, multi_lora="v2", import_module=import_module)
        refused = None
    except UnsupportedConfiguration as exc:
        refused = str(exc)
    return {
        "single_bridge": f"{type(single.source.bridge).__module__}.{type(single.source.bridge).__name__}",
        "single_kwargs": single.source._kwargs,
        "multi_refused": refused,
    }


def _sabotaged_double_exports(double, model, where: Path, rank: int) -> dict:
    """Negative controls: the double with its k/v names swapped, then yielding each module's tensors
    in reversed order (lora_B before lora_A, v before k before q)."""
    from miles_lora_ckpt_harness.bridge_double import export as double_export

    split, to_hf = double_export._split_qkv, double_export._to_hf

    def swapped_kv(lora_b, mcfg):
        parts = split(lora_b, mcfg)
        return {"q_proj": parts["q_proj"], "k_proj": parts["v_proj"], "v_proj": parts["k_proj"]}

    def reversed_within_module(*args):
        return reversed(list(to_hf(*args)))

    out = {}
    for label, name, patch in (
        ("swapped_kv", "_split_qkv", swapped_kv),
        ("reversed", "_to_hf", reversed_within_module),
    ):
        setattr(double_export, name, patch)
        try:
            names, values = _exported(double, model)
        finally:
            double_export._split_qkv, double_export._to_hf = split, to_hf
        _save_tensors_rank0(where / f"double-{label.replace('_', '-')}-export.safetensors", values, rank)
        out[label] = names
    return out


def crash_mid_export(payload: dict, ctx) -> dict:
    """Train 2 steps, commit a checkpoint generation (with peft/) and an export; train a third step,
    then rank 0 SIGKILLs itself mid-write of the next export (after its first file)."""
    consensus = Consensus.for_world(timeout_s=payload["timeout_s"])
    config = bm.BridgeRunConfig.from_dict(payload["config"])
    hf = payload["hf"]
    run = bm.build_bridge_run(config, hf)
    for step in range(2):
        bm.bridge_train_step(run, step)
    spec = lora_spec(config, hf)
    save_lora_checkpoint(
        run.model,
        Args(config),
        payload["ckpt"],
        optimizer=run.optimizer,
        opt_param_scheduler=run.scheduler,
        iteration=2,
        consensus=consensus,
        peft=PeftExport(source=BridgeSource(run.bridge), lora=spec),
    )
    first = export_peft(
        run.model, payload["exports"], source=BridgeSource(run.bridge), lora=spec, iteration=2, consensus=consensus
    )
    bm.bridge_train_step(run, 2)
    if ctx.rank == 0:
        faults.arm("mid-write", 0, "kill")
    try:
        export_peft(
            run.model, payload["exports"], source=BridgeSource(run.bridge), lora=spec, iteration=3, consensus=consensus
        )
    except CheckpointError as exc:
        return {"first": str(first), "error": str(exc)}
    return {"first": str(first), "error": None}


def resume_story(payload: dict, consensus) -> dict:
    """Resume from the committed generation (iteration 2) and train to `steps`, then an uninterrupted
    run to `steps`; digests of both (bit-exact comparison in the test). The resumed run then exports
    again into the export root the crash left behind."""
    config = bm.BridgeRunConfig.from_dict(payload["config"])
    hf, steps = payload["hf"], payload["steps"]
    resumed = bm.build_bridge_run(config, hf)
    result = load_lora_checkpoint(
        resumed.model,
        payload["ckpt"],
        optimizer=resumed.optimizer,
        opt_param_scheduler=resumed.scheduler,
        consensus=consensus,
    )
    resumed_losses = [bm.bridge_train_step(resumed, step) for step in range(result.iteration, steps)]
    resumed_digests = snapshot_digests(snapshot(resumed))
    retry = export_peft(
        resumed.model,
        payload["exports"],
        source=BridgeSource(resumed.bridge),
        lora=lora_spec(config, hf),
        iteration=steps,
        consensus=consensus,
    )
    _close(resumed)
    reference = bm.build_bridge_run(config, hf)
    reference_losses = [bm.bridge_train_step(reference, step) for step in range(steps)]
    reference_digests = snapshot_digests(snapshot(reference))
    _close(reference)
    dist.barrier()
    return {
        "iteration": result.iteration,
        "resumed_losses": resumed_losses,
        "reference_losses": reference_losses,
        "resumed": resumed_digests,
        "reference": reference_digests,
        "retry": str(retry),
    }


# --------------------------------------------------------------------------- the fault matrix


def _save(run: bm.BridgeRun, root: Path, iteration: int, consensus, peft: PeftExport | None) -> str:
    return str(
        save_lora_checkpoint(
            run.model,
            Args(run.config),
            root,
            optimizer=run.optimizer,
            opt_param_scheduler=run.scheduler,
            iteration=iteration,
            consensus=consensus,
            peft=peft,
        )
    )


def _listing(root: Path) -> dict:
    """The root's entries and mtimes, without the writer lease (its holder renews it in the background)."""
    dist.barrier()  # the coordinator removes a failed attempt's staging after the last collective
    if not root.exists():
        return {}
    return {p.name: p.lstat().st_mtime_ns for p in sorted(root.iterdir()) if not p.name.startswith(LEASE)}


def _attempt(fn, *args) -> dict:
    started = time.monotonic()
    try:
        fn(*args)
        return {"error": None, "seconds": time.monotonic() - started}
    except CheckpointError as exc:
        return {"error": str(exc), "phase": exc.phase, "ranks": exc.failed_ranks, "seconds": time.monotonic() - started}


class DroppingBridge:
    """The real AutoBridge whose export loses `dropped` names on `ranks` (all when None): it still
    iterates the real, collective export fully, so the peers' gathers stay matched. A sabotage for
    the partial / inconsistent refusals, not a double: every yielded item is the real Bridge's."""

    def __init__(self, bridge, dropped: list[str], ranks: list[int] | None = None):
        self.bridge, self.dropped, self.ranks = bridge, set(dropped), ranks

    def export_adapter_weights(self, model, cpu=True, show_progress=True, exclude_adapter_base_prefixes=None):
        drop = self.ranks is None or dist.get_rank() in self.ranks
        kwargs = {"cpu": cpu, "show_progress": show_progress}
        if exclude_adapter_base_prefixes is not None:
            kwargs["exclude_adapter_base_prefixes"] = exclude_adapter_base_prefixes
        for item in self.bridge.export_adapter_weights(model, **kwargs):
            if not (drop and item[0] in self.dropped):
                yield item


def failure_scenarios(run: bm.BridgeRun, where: Path, hf: str, consensus, ctx) -> dict:
    """The export's fault matrix on the real Bridge: a raise at every phase (`FAULT_PHASES`) on every
    rank, into the root that already holds this case's export (a raise at `peft-export` happens inside
    the real Bridge's collective export, whose TP gathers the other rank is in); a failing export
    inside a checkpoint save; a partial export (a module lost on every rank) and an inconsistent one
    (lost on rank 1 only)."""
    spec = lora_spec(run.config, hf)

    def export(root, iteration, bridge=None):
        source = BridgeSource(bridge or run.bridge)
        return export_peft(run.model, root, source=source, lora=spec, iteration=iteration, consensus=consensus)

    root = where / "exports"
    matrix = []
    for phase in FAULT_PHASES:
        for failing in range(ctx.world_size):
            before, latest = _listing(root), os.readlink(root / "latest")
            if ctx.rank == failing:
                faults.arm(phase, failing, "raise")
            outcome = _attempt(export, root, 99)
            faults.disarm()
            after = _listing(root)
            outcome |= {
                "phase_armed": phase,
                "failing": failing,
                "latest_moved": os.readlink(root / "latest") != latest,
            }
            outcome |= {"added": sorted(set(after) - set(before)), "removed": sorted(set(before) - set(after))}
            outcome |= {"touched": sorted(n for n in set(before) & set(after) if before[n] != after[n])}
            matrix.append(outcome)
    ckpt = where / "ckpt"
    before = _listing(ckpt)
    if ctx.rank == 1:
        faults.arm("peft-export", 1, "raise")
    in_generation = _attempt(_save, run, ckpt, 100, consensus, PeftExport(source=BridgeSource(run.bridge), lora=spec))
    faults.disarm()
    in_generation["unchanged"] = _listing(ckpt) == before
    dropped = ["model.layers.1.mlp.down_proj.lora_A.weight", "model.layers.1.mlp.down_proj.lora_B.weight"]
    before = _listing(root)
    partial = _attempt(export, root, 101, DroppingBridge(run.bridge, dropped))
    inconsistent = _attempt(export, root, 102, DroppingBridge(run.bridge, dropped[1:], ranks=[1]))
    refused_unchanged = _listing(root) == before
    return {
        "matrix": matrix,
        "in_generation": in_generation,
        "partial": partial,
        "inconsistent": inconsistent,
        "refused_unchanged": refused_unchanged,
    }


def kill_inside_export(payload: dict, ctx) -> dict:
    """A committed export; then rank `kill_rank` SIGKILLs itself inside the real Bridge's collective
    export (at its first yielded weight, while the peers are in its TP gathers): the survivor must
    fail with a clear error within the timeout, never hang, and publish nothing."""
    consensus = Consensus.for_world(timeout_s=payload["timeout_s"])
    config = bm.BridgeRunConfig.from_dict(payload["config"])
    hf, root = payload["hf"], Path(payload["root"])
    run = bm.build_bridge_run(config, hf)
    bm.bridge_train_step(run, 0)
    spec = lora_spec(config, hf)
    first = export_peft(run.model, root, source=BridgeSource(run.bridge), lora=spec, iteration=1, consensus=consensus)
    bm.bridge_train_step(run, 1)
    if ctx.rank == payload["kill_rank"]:
        faults.arm("peft-export", ctx.rank, "kill")
    outcome = _attempt(
        lambda: export_peft(
            run.model, root, source=BridgeSource(run.bridge), lora=spec, iteration=2, consensus=consensus
        )
    )
    return outcome | {"first": str(first)}
