"""`save_generation`'s hooks for savers with a collective step of their own (one process, no megatron):
`produce` between the prepare and write agreements (or, with `write_produced`, after the write),
`link_latest`, the `after-prepare` fault phase,
and the removal of a failed attempt's staging directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from miles_lora_ckpt.core import faults, lease
from miles_lora_ckpt.core.consensus import Consensus, Outcome, attempt
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import LATEST, LEASE, MANIFEST, TRACKER, Topology, is_staging_dir_name
from miles_lora_ckpt.core.protocol import save_generation
from miles_lora_ckpt.tools.cli import main as cli


def save(root: Path, iteration: int, **kwargs) -> Path:
    kwargs.setdefault("write_files", lambda writer: writer.write_json("x.json", {"iteration": iteration}))
    return save_generation(
        Consensus.single_process(), root, iteration=iteration, saver="test", topology=Topology(), **kwargs
    )


def entries(root: Path) -> dict[str, int]:
    """The root's entries and their mtimes, without the writer lease (renewed in the background)."""
    return {p.name: p.lstat().st_mtime_ns for p in sorted(root.iterdir()) if not p.name.startswith(LEASE)}


def staging(root: Path) -> list[str]:
    return [n for n in os.listdir(root) if is_staging_dir_name(n)]


def test_produce_runs_between_prepare_and_write_and_adds_metadata(tmp_path):
    root, seen = tmp_path / "root", []

    def produce(consensus):
        seen.append(("produce", staging(root), lease.holds(root)))
        made = attempt(lambda: {"tensors": 3})
        consensus.agree("my-export", made)  # the caller agrees its own steps
        return {"export": made.value}

    def write(writer):
        seen.append(("write", staging(root), writer.generation))
        writer.write_json("made.json", {"ok": True})

    gen = save(root, 5, produce=produce, write_files=write, metadata={"mine": 1})
    (name, during, held), (second, _, generation) = seen
    assert name == "produce" and len(during) == 1 and held  # the staging directory exists, the lease is ours
    assert second == "write" and during[0].endswith(generation)
    manifest = json.loads((gen / MANIFEST).read_text())
    assert manifest["metadata"] == {"mine": 1, "export": {"tensors": 3}} and manifest["sequence"] == 1
    assert sorted(manifest["files"]) == ["made.json"] and staging(root) == []
    assert cli(["verify", str(root)]) == 0


def test_with_write_produced_produce_runs_after_the_write_and_its_files_are_committed_too(tmp_path):
    root, seen = tmp_path / "root", []

    def produce(consensus):
        (attempt_dir,) = staging(root)
        seen.append(sorted(os.listdir(root / attempt_dir)))  # the write phase's files are staged already
        return {"export": 1}

    def write_produced(writer):
        writer.write_json("produced.json", {"ok": True})

    write = lambda writer: writer.write_json("shard.json", {})  # noqa: E731
    gen = save(root, 3, produce=produce, write_files=write, write_produced=write_produced)
    assert seen == [["shard.json"]]
    manifest = json.loads((gen / MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["produced.json", "shard.json"] and manifest["metadata"] == {"export": 1}
    assert cli(["verify", str(root)]) == 0
    # a file written in both phases is refused, and the attempt leaves nothing
    before = entries(root)
    twice = lambda writer: writer.write_json("shard.json", {})  # noqa: E731
    with pytest.raises(CheckpointError, match=r"(?s)phase 'write-produced'.*written in both write phases"):
        save(root, 4, produce=produce, write_files=write, write_produced=twice)
    assert entries(root) == before


def test_a_failed_produce_step_fails_the_save_and_removes_its_staging(tmp_path):
    root = tmp_path / "root"
    first = save(root, 1)
    before = entries(root)

    def produce(consensus):
        consensus.agree("my-export", Outcome(ok=False, error="ValueError: nothing to export"))

    with pytest.raises(CheckpointError, match="(?s)phase 'my-export'.*nothing to export"):
        save(root, 2, produce=produce)
    assert entries(root) == before  # no staging, nothing new, the tracker untouched
    assert json.loads((root / TRACKER).read_text())["generation_dir"] == first.name
    # a metadata key given twice is refused at commit, and leaves nothing either
    with pytest.raises(CheckpointError, match="(?s)phase 'commit'.*given both by the caller and by its produce step"):
        save(root, 3, produce=lambda consensus: {"mine": 2}, metadata={"mine": 1})
    assert entries(root) == before


def test_link_latest_follows_every_publish_and_a_non_link_is_refused_at_prepare(tmp_path):
    root = tmp_path / "root"
    first = save(root, 1, link_latest=True)
    assert os.readlink(root / LATEST) == first.name  # relative: the root can move
    second = save(root, 2, link_latest=True, keep=1)
    assert os.readlink(root / LATEST) == second.name and not first.exists()
    assert cli(["verify", str(root / LATEST)]) == 0 and cli(["verify", str(root)]) == 0
    (root / LATEST).unlink()
    (root / LATEST).mkdir()  # not ours: never replaced
    before = entries(root)
    with pytest.raises(CheckpointError, match="(?s)phase 'prepare'.*latest is not a symlink"):
        save(root, 3, link_latest=True)
    assert entries(root) == before
    assert save(root, 3).exists()  # a save that does not link `latest` does not care


@pytest.mark.parametrize("phase", [*faults.PREPARE_PHASES, "mid-write", "before-publish"])
def test_a_fault_after_the_staging_exists_removes_it(phase, tmp_path):
    root = tmp_path / "root"
    first = save(root, 1, link_latest=True)
    before = entries(root)
    faults.arm(phase, 0)
    try:
        with pytest.raises(CheckpointError, match=f"injected fault at phase '{phase}' on rank 0"):
            save(root, 2, link_latest=True)
    finally:
        faults.disarm()
    assert entries(root) == before and os.readlink(root / LATEST) == first.name
    assert "after-prepare" in faults.PHASES and "after-prepare" not in faults.SAVE_PHASES
