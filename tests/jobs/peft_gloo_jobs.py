"""Worker functions for PEFT export tests that need no megatron (plain gloo workers start in ~1 s)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from miles_lora_ckpt.core import faults
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import LEASE
from miles_lora_ckpt.savers.peft_export import FAULT_PHASES, BridgeSource, LoraSpec, export_peft
from miles_lora_ckpt_harness import bridge_double


class CollectiveBridge:
    """Yields HF-named adapter weights with an all-gather over the world before each item, like
    Bridge's TP/PP gathers: a rank that stopped iterating would leave its peers in the collective."""

    def __init__(self, layers: int = 2, hidden: int = 8, rank: int = 2):
        self.layers, self.hidden, self.r = layers, hidden, rank

    def export_adapter_weights(self, model, cpu=True, show_progress=True):
        gen = torch.Generator().manual_seed(5)
        for layer in range(self.layers):
            for module in ("self_attn.q_proj", "self_attn.o_proj"):
                for factor, shape in (("lora_A", (self.r, self.hidden)), ("lora_B", (self.hidden, self.r))):
                    mine = torch.randn(shape, generator=gen)
                    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
                    dist.all_gather(gathered, mine)
                    yield f"model.layers.{layer}.{module}.{factor}.weight", gathered[0]


def _export(root, iteration, consensus):
    source = BridgeSource(CollectiveBridge())
    lora = LoraSpec(r=2, alpha=4.0)
    return export_peft(None, root, source=source, lora=lora, iteration=iteration, consensus=consensus)


def _listing(root: Path) -> dict:
    """The root's entries and mtimes, without the writer lease (its holder renews it in the background)."""
    dist.barrier()  # the coordinator removes a failed attempt's staging after the last collective
    return {p.name: p.lstat().st_mtime_ns for p in sorted(root.iterdir()) if not p.name.startswith(LEASE)}


def collective_matrix(payload: dict, ctx) -> dict:
    """A good export; then a raise at every phase an export passes (FAULT_PHASES) on every rank; last,
    one rank SIGKILLs itself inside the collective export (the others must fail, not hang)."""
    consensus = Consensus.for_world(timeout_s=payload["timeout_s"])
    root = Path(payload["root"])
    _export(root, 1, consensus)
    cases = []
    for phase in FAULT_PHASES:
        for failing in range(ctx.world_size):
            before = _listing(root)
            if ctx.rank == failing:
                faults.arm(phase, failing, "raise")
            cases.append(_timed(_export, root, 2, consensus) | {"phase_armed": phase, "failing": failing})
            faults.disarm()
            after = _listing(root)
            cases[-1]["added"] = sorted(set(after) - set(before))
            cases[-1]["removed"] = sorted(set(before) - set(after))
            cases[-1]["touched"] = sorted(n for n in set(before) & set(after) if before[n] != after[n])
            cases[-1]["latest"] = os.readlink(root / "latest")  # after-publish: the new export, complete
    if ctx.rank == payload["kill_rank"]:
        faults.arm("peft-export", ctx.rank, "kill")
    killed = _timed(_export, root, 3, consensus)
    return {"cases": cases, "killed": killed}


def _timed(fn, *args) -> dict:
    started = time.monotonic()
    try:
        fn(*args)
        return {"error": None, "seconds": time.monotonic() - started}
    except CheckpointError as exc:
        return {"error": str(exc), "phase": exc.phase, "ranks": exc.failed_ranks, "seconds": time.monotonic() - started}


def double_isolation(payload: dict, ctx) -> dict:
    """Inside a (megatron-free) harness worker: the double installs, names itself, uninstalls."""
    import importlib

    out = {}
    for variant in payload["variants"]:
        before = importlib.util.find_spec("megatron.bridge") is not None
        auto_bridge = bridge_double.install(variant=variant)
        mb = importlib.import_module("megatron.bridge")
        peft_bridge = importlib.import_module("megatron.bridge.models.conversion.peft_bridge")
        seen = {
            "spec_before": before,
            "class": mb.AutoBridge.__name__,
            "is_double": getattr(mb, "IS_TEST_DOUBLE", False),
            "doc": mb.__doc__,
            "helpers": peft_bridge.__name__,
            "same": auto_bridge is mb.AutoBridge,
        }
        bridge_double.install(variant=variant, peft_helpers=False)
        seen["without_helpers"] = _importable("megatron.bridge.models.conversion.peft_bridge")
        bridge_double.uninstall()
        seen["after_uninstall"] = _importable("megatron.bridge")
        out[variant] = seen
    return out


def _importable(name: str) -> str:
    import importlib

    try:
        importlib.import_module(name)
        return "importable"
    except ImportError:
        return "gone"
