"""The PEFT export's phases across real processes with a collective export (plain gloo, no megatron):
a raise at every phase on every rank of three, and a rank killed inside the collective export."""

from __future__ import annotations

import pytest
from jobs_paths import JOBS

from miles_lora_ckpt.core.faults import PEFT_PHASES
from miles_lora_ckpt.sim.launch import run_workers
from miles_lora_ckpt.tools.cli import main as cli

pytestmark = pytest.mark.multirank

SEEN_AS = {"peft-staging": "peft-setup", "peft-mid-write": "peft-write"}


def test_every_phase_on_every_rank_of_three_and_a_kill_inside_the_export(tmp_path):
    root = tmp_path / "exports"
    payload = {"root": str(root), "timeout_s": 20, "kill_rank": 2}
    results = run_workers(
        3, "peft_gloo_jobs:collective_matrix", payload, sys_path=[JOBS], megatron=False, timeout_s=200
    )
    assert results[2].exitcode == -9, results[2]
    survivors = [r.result for r in results[:2]]
    assert all(r.ok for r in results[:2]), [r.error for r in results]
    for index, case in enumerate(survivors[0]["cases"]):
        phase, failing = case["phase_armed"], case["failing"]
        for mine in (s["cases"][index] for s in survivors):
            assert mine["error"] == case["error"] and f"phase '{phase}' on rank {failing}" in mine["error"]
            assert mine["phase"] == SEEN_AS.get(phase, phase) and mine["ranks"] == [failing], (phase, failing)
            assert mine["removed"] == [] and mine["seconds"] < 20
            published = phase == "peft-publish" and failing != 0  # after the write was agreed everywhere
            assert bool(mine["added"]) == published, (phase, failing, mine["added"])
    assert len(survivors[0]["cases"]) == 3 * len(PEFT_PHASES)
    for survivor in survivors:  # the export's own collective saw the dead peer; no rank hung
        killed = survivor["killed"]
        assert killed["phase"] == "peft-export" and killed["seconds"] < 40, killed  # the timeout bounds it
    assert cli(["verify", str(root), "--all"]) == 0
