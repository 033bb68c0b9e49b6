"""The asynchronous single-LoRA save (`savers.single_lora.async_save`) through the real megatron-core
DistributedOptimizer on CPU over gloo: one spawned job (tests/jobs/async_jobs.py) runs every case.

A generation saved asynchronously while training went on holds the state at the snapshot, bit for
bit (every tensor, counter and scheduler field compared with the uninterrupted run); a second save
waits for the first to commit; a failure in one rank's background write raises the same error on
every rank and leaves the previous generation the newest; a SIGKILL during a background write
leaves the previous generation loadable.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs_paths import JOBS

from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.layout import TRACKER
from miles_lora_ckpt.core.protocol import open_generation
from miles_lora_ckpt.sim.launch import run_workers
from miles_lora_ckpt.sim.model import SimConfig
from miles_lora_ckpt.tools.cli import main as cli

pytestmark = [pytest.mark.megatron, pytest.mark.multirank]


def test_async_save_snapshot_wait_fault_and_kill(tmp_path):
    root = tmp_path / "root"
    config = SimConfig(world_size=2, dtype="bf16", adapters="mixed").to_dict()
    results = run_workers(
        2,
        "async_jobs:async_saves",
        {"config": config, "root": str(root), "timeout_s": 30},
        sys_path=[JOBS],
        scratch_dir=tmp_path / "scratch",
        timeout_s=400,
    )
    # the last case: rank 1 SIGKILLed itself in the background write; rank 0 got an error, no hang
    assert results[1].exitcode == -9, results[1]
    assert results[0].ok, results[0].error
    killed = results[0].result["killed_peer"]
    assert "phase 'write'" in killed and "a peer died or timed out" in killed, killed

    reports = [json.loads((tmp_path / "scratch" / f"report{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        # the first save was still held while training went on, and the second save waited for it
        assert report["first_done_after_training"] is False, rank
        assert report["first_done_when_second_returned"] is True, rank
        assert report["control_state_changed"] is not None  # training changed the state after the snapshot
        # the generation holds the state at the snapshot, and the resumed run continues identically
        assert report["resumed_iteration"] == 2
        assert report["at_snapshot"] is None, (rank, report["at_snapshot"])
        assert report["losses_match"] is True
        assert report["continued"] is None, (rank, report["continued"])
        # failed background writes: loud, on every rank, the newest generation untouched
        for key in ("fault_at_wait", "fault_at_next_save"):
            assert "rank 1" in report[key] and "injected fault at phase 'mid-write'" in report[key], report[key]
        assert report["saver_wait_after_seen"] is None and report["saver_usable_after"] is None
        assert report["latest_iteration"] == 4 and report["latest_path"] == report["second"]
        assert report["latest"] is None, (rank, report["latest"])
    assert reports[0]["fault_at_wait"] == reports[1]["fault_at_wait"]  # the same error on every rank
    assert reports[0]["fault_at_next_save"] == reports[1]["fault_at_next_save"]
    assert reports[0]["second"] == reports[1]["second"] and Path(reports[0]["second"]).name.startswith("gen-")

    # after the kill, the root's newest committed generation is still the step-4 one, and verifies
    assert json.loads((root / TRACKER).read_text())["generation_dir"] == Path(reports[0]["second"]).name
    assert cli(["verify", str(root)]) == 0
    opened = open_generation(Consensus.single_process(), root, lambda m: ["training_state.json"])
    assert opened.manifest.iteration == 4
