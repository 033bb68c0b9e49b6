"""The PEFT export's phases across real processes with a collective export (plain gloo, no megatron):
a raise at every phase on every rank of three, and a rank killed inside the collective export.

Stays in tier 1 on a synthetic collective exporter (no Bridge, no double): it is the megatron-free
guard that runs without the Bridge tier, at W=3. The same matrix and the kill inside the export run
on the real Megatron-Bridge 0.6.2's collective export in tests/test_bridge_real.py (W=2, TP=2)."""

from __future__ import annotations

import pytest
from jobs_paths import JOBS

from miles_lora_ckpt.core.layout import LATEST, TRACKER
from miles_lora_ckpt.savers.peft_export import FAULT_PHASES
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


def test_every_phase_on_every_rank_of_three_and_a_kill_inside_the_export(tmp_path):
    root = tmp_path / "exports"
    payload = {"root": str(root), "timeout_s": 20, "kill_rank": 2}
    results = run_workers(
        3, "peft_gloo_jobs:collective_matrix", payload, sys_path=[JOBS], megatron=False, timeout_s=200
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
