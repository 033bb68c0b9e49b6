"""A save's manifest, field by field, against the one recorded before the plan records were typed.

The records a save plans with (`RankPlan`, `SavedChild`) cross to JSON only at their boundary;
the manifest they produce must stay the same bytes. Every field one save's code decides is
compared: not its time, its generation id, or the digests that id reaches through the stamps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs_paths import TESTS

from miles_lora_ckpt_harness.sim.launch import check_all, run_workers
from miles_lora_ckpt_harness.sim.model import SimConfig

pytestmark = [pytest.mark.megatron, pytest.mark.multirank]

GOLDEN = Path(__file__).parent / "golden"
# Where each saved file's size follows from the code alone: the RNG JSON's does not.
_SIZED = (".safetensors",)


def golden_path() -> Path:
    """The recorded manifest (the same on megatron-core 0.16.1 and 0.19.2)."""
    return GOLDEN / "manifest_w2_mixed.json"


def stable(manifest: dict) -> dict:
    """The fields of `manifest` that the saving code decides, not the time or the generation id."""
    files = {}
    for relpath, record in sorted(manifest["files"].items()):
        kept = {k: v for k, v in record.items() if k not in ("digest", "bytes", "blocks")}
        if relpath.endswith(_SIZED):
            kept["bytes"] = record["bytes"]
        if "blocks" in record:
            kept["blocks"] = {k: v for k, v in record["blocks"].items() if k != "digests"}
        files[relpath] = kept
    fixed = ("format", "format_version", "iteration", "saver", "sequence", "topology", "metadata")
    return {**{k: manifest[k] for k in fixed}, "files": files}


def save_once(root: Path) -> dict:
    """Two ranks (DP 2, dense and expert adapters, bf16) train two steps and save once."""
    config = SimConfig(world_size=2, dtype="bf16", adapters="mixed").to_dict()
    payload = {"config": config, "root": str(root), "steps": 2}
    results = check_all(run_workers(2, "test_single_lora:train_and_save", payload, sys_path=[TESTS], timeout_s=400))
    return json.loads((Path(results[0]["paths"][0]) / "manifest.json").read_text())


def test_a_saved_manifest_is_field_for_field_the_recorded_one(tmp_path):
    path = golden_path()
    recorded = json.loads(path.read_text())
    saved = stable(save_once(tmp_path / "root"))
    assert sorted(saved) == sorted(recorded)
    for field in sorted(recorded):
        if field in ("metadata", "files"):
            assert sorted(saved[field]) == sorted(recorded[field]), field
            for key in sorted(recorded[field]):
                assert saved[field][key] == recorded[field][key], f"{field}.{key}"
        else:
            assert saved[field] == recorded[field], field
