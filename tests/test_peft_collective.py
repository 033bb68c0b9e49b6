"""The PEFT export's phases across real processes with a collective export (plain gloo, no megatron):
a raise at every phase on every rank of three, and a rank killed inside the collective export.

Stays in tier 1 on a synthetic collective exporter (no Bridge, no double): it is the megatron-free
guard that runs without the Bridge tier, at W=3. The same matrix and the kill inside the export run
on the real Megatron-Bridge 0.6.2's collective export in tests/test_bridge_real.py (W=2, TP=2)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from jobs_paths import TESTS

from miles_lora_ckpt.core import faults
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import LATEST, LEASE, TRACKER
from miles_lora_ckpt.savers.peft_export import FAULT_PHASES, BridgeSource, LoraSpec, export_peft
from miles_lora_ckpt.tools.cli import main as cli
from miles_lora_ckpt_harness.sim.launch import run_workers

pytestmark = pytest.mark.multirank

# the phase every rank's CheckpointError names, for a fault armed at each phase of the export
SEEN_AS = {
    "peft-setup": "peft-setup",
    "after-prepare": "prepare",
    "peft-export": "peft-export",
    "before-write": "write",
    "mid-write": "write",
    "after-write": "write",
    "after-consensus": "commit",
    "mid-manifest": "commit",
    "before-publish": "commit",
    "after-publish": "publish",
}


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


def test_every_phase_on_every_rank_of_three_and_a_kill_inside_the_export(tmp_path):
    root = tmp_path / "exports"
    payload = {"root": str(root), "timeout_s": 20, "kill_rank": 2}
    results = run_workers(
        3, "test_peft_collective:collective_matrix", payload, sys_path=[TESTS], megatron=False, timeout_s=200
    )
    assert results[2].exitcode == -9, results[2]
    survivors = [r.result for r in results[:2]]
    assert all(r.ok for r in results[:2]), [r.error for r in results]
    assert sorted(SEEN_AS) == sorted(FAULT_PHASES)
    for index, case in enumerate(survivors[0]["cases"]):
        phase, failing = case["phase_armed"], case["failing"]
        for mine in (s["cases"][index] for s in survivors):
            assert mine["error"] == case["error"] and f"phase '{phase}' on rank {failing}" in mine["error"]
            assert mine["phase"] == SEEN_AS[phase] and mine["ranks"] == [failing], (phase, failing)
            assert mine["removed"] == [] and mine["seconds"] < 20
            if phase == "after-publish":  # the coordinator had published: complete, and named by latest
                assert len(mine["added"]) == 1 and mine["latest"] == mine["added"][0], (phase, failing, mine)
                assert mine["touched"] == [LATEST, TRACKER], (phase, failing, mine)
            else:  # no staging left behind, nothing new, the tracker and latest untouched
                assert mine["added"] == mine["touched"] == [], (phase, failing, mine)
    assert len(survivors[0]["cases"]) == 3 * len(FAULT_PHASES)
    for survivor in survivors:  # the export's own collective saw the dead peer; no rank hung
        killed = survivor["killed"]
        assert killed["phase"] == "peft-export" and killed["seconds"] < 40, killed  # the timeout bounds it
    assert cli(["verify", str(root), "--all"]) == 0
