"""Operator tools on a real save root: inspect, ls, gc, and retention rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from miles_lora_ckpt.core import lease
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.layout import LEASE, TRACKER, Topology
from miles_lora_ckpt.core.protocol import save_generation
from miles_lora_ckpt.core.retention import prune
from miles_lora_ckpt.tools.cli import main as cli


def save(root, iteration, keep=None):
    def write(writer):
        writer.write_tensors("a.safetensors", {"w": torch.full((4,), float(iteration))})

    return save_generation(
        Consensus.single_process(),
        root,
        iteration=iteration,
        saver="test",
        topology=Topology(world=1, tp=1),
        write_files=write,
        metadata={"note": "hello"},
        keep=keep,
    )


def test_inspect_json_has_the_documented_keys(tmp_path, capsys):
    gen = save(tmp_path, 3)
    assert cli(["inspect", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == str(gen.resolve())
    assert info["iteration"] == 3 and info["generation"] == gen.name.split("-")[-1]
    assert info["topology"]["tp"] == 1 and set(info["topology"]) >= {
        "world",
        "tp",
        "pp",
        "ep",
        "etp",
        "dp",
        "cp",
        "vpp",
    }
    assert set(info["files"]) == {"a.safetensors"} and info["files"]["a.safetensors"]["digest"].startswith("xxh3_128:")
    assert info["metadata"] == {"note": "hello"}


def test_ls_shows_states_and_tracker(tmp_path, capsys):
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    damaged = save(tmp_path, 3)
    (tmp_path / ".staging-00000000000000aa").mkdir()  # after the last save: a save would reclaim it
    (damaged / "a.safetensors").unlink()
    assert cli(["ls", str(tmp_path), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    states = {row["name"]: row["state"] for row in listing["entries"]}
    assert states[newest.name] == "intact" and states[damaged.name] == "damaged"
    assert states[".staging-00000000000000aa"] == "staging"
    assert listing["tracker"] == damaged.name and listing["content_checked"] is True
    assert [row["sequence"] for row in listing["entries"][:3]] == [3, 2, 1]
    assert listing["lease"]["live"] and f"pid {os.getpid()}" in listing["lease"]["description"]
    assert cli(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "<- tracker" in out and "writer lease: held by host" in out
    assert cli(["ls", str(tmp_path), "--fast", "--json"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["content_checked"] is False and fast["entries"][1]["state"] == "committed"
    assert cli(["ls", str(tmp_path), "--fast"]) == 0
    assert "content NOT checked (--fast)" in capsys.readouterr().out


def test_save_keep_prunes_old_generations_and_staging(tmp_path):
    for iteration in range(1, 6):
        save(tmp_path, iteration, keep=2)
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith("gen-"))
    assert [int(n.split("-")[1]) for n in names] == [4, 5]
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == [LEASE]


def test_gc_never_removes_the_tracked_generation_and_honours_dry_run(tmp_path, capsys):
    gens = [save(tmp_path, i) for i in range(1, 5)]
    tracker = json.loads((tmp_path / TRACKER).read_text())
    # point the tracker at an old generation (e.g. an operator rolled back)
    tracker["generation_dir"] = gens[0].name
    (tmp_path / TRACKER).write_text(json.dumps(tracker))
    staging = tmp_path / ".staging-00000000000000bb"
    staging.mkdir()
    assert cli(["gc", str(tmp_path), "--keep", "1", "--dry-run", "--staging-min-age", "0"]) == 0
    out = capsys.readouterr().out
    assert "would remove 2 directories" in out  # the staging directory: this process holds a live lease
    assert "staging director(ies) left alone" in out
    assert len(os.listdir(tmp_path)) == 7
    assert cli(["gc", str(tmp_path), "--keep", "1", "--staging-min-age", "3600"]) == 0
    left = sorted(os.listdir(tmp_path))
    assert gens[0].name in left and gens[3].name in left and staging.name in left
    assert gens[1].name not in left and gens[2].name not in left
    lease.release(tmp_path)  # no live writer any more: old staging directories may go
    assert prune(tmp_path, keep=1, staging_min_age_s=3600).removed == []
    os.utime(staging, (time.time() - 7200, time.time() - 7200))
    assert prune(tmp_path, keep=1, staging_min_age_s=3600).removed == [staging]


def test_cli_exit_codes(tmp_path, capsys):
    assert cli(["verify", str(tmp_path / "missing")]) == 2
    (tmp_path / "plain").mkdir()
    assert cli(["verify", str(tmp_path / "plain")]) == 2
    assert cli(["verify"]) == 2
    assert cli(["gc", str(tmp_path), "--keep", "0"]) == 2
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "adapter_megatron_rank0.pt").write_bytes(b"x")
    assert cli(["verify", str(legacy)]) == 2
    assert "legacy Miles adapter directory" in capsys.readouterr().err


def test_console_script_help_and_version():
    out = subprocess.run(
        [sys.executable, "-m", "miles_lora_ckpt", "--help"], capture_output=True, text=True, check=True
    )
    for command in ("verify", "inspect", "ls", "gc", "bench", "demo"):
        assert f"\n    {command} " in out.stdout, command
    version = subprocess.run([sys.executable, "-m", "miles_lora_ckpt", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("miles-lora-ckpt ")


def test_a_run_restarted_from_an_older_generation_resumes_from_its_newest_commit(tmp_path, capsys):
    save(tmp_path, 10)
    restarted = save(tmp_path, 6)  # an operator resumed from iteration 5 and saved again
    assert cli(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(restarted.resolve())
    assert json.loads((tmp_path / TRACKER).read_text())["generation_dir"] == restarted.name


def test_retention_never_removes_a_generation_whose_order_is_unknown(tmp_path, capsys):
    """A directory named like a generation but without a readable manifest sorts as the oldest, yet
    may be the newest: gc, keep=N at save time and the Python API leave it alone and report it."""
    save(tmp_path, 1)
    save(tmp_path, 2)
    forged = tmp_path / "gen-999999999-00000000000000aa"  # no manifest at all
    forged.mkdir()
    (forged / "adapter.safetensors").write_bytes(b"precious bytes")
    torn = save(tmp_path, 3)
    (torn / "manifest.json").unlink()  # the newest commit, its manifest lost
    report = prune(tmp_path, keep=1, dry_run=True)
    assert sorted(report.unordered) == sorted([forged.name, torn.name]) and len(report.kept) == 1
    assert not any(p.name in (forged.name, torn.name) for p in report.remove)
    assert any(forged.name in n and "cannot be ordered" in n and "manifest.json: missing" in n for n in report.notes)

    assert cli(["gc", str(tmp_path), "--keep", "1"]) == 0
    out = capsys.readouterr().out
    assert forged.exists() and torn.exists() and (forged / "adapter.safetensors").read_bytes() == b"precious bytes"
    assert f"left alone {forged} (its manifest cannot be read: order unknown)" in out
    assert f"NOTE damaged generation {torn.name} cannot be ordered (manifest.json: missing)" in out
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("gen-")) == sorted(
        [forged.name, torn.name, report.kept[0]]
    )

    save(tmp_path, 4, keep=1)  # save-time retention: the same rule
    assert forged.exists() and torn.exists()

    assert cli(["ls", str(tmp_path), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in listing["entries"]}
    assert rows[forged.name]["order_known"] is False and rows[torn.name]["order_known"] is False
    assert all(row["order_known"] for name, row in rows.items() if name not in (forged.name, torn.name))
    assert any(torn.name in w and "gc and retention never remove it" in w for w in listing["warnings"])


def test_a_fallback_past_a_generation_whose_manifest_is_damaged_names_it_and_why(tmp_path, caplog):
    from miles_lora_ckpt.core.protocol import open_generation

    older = save(tmp_path, 1)
    newest = save(tmp_path, 2)
    (newest / "manifest.json").write_bytes(b"\xff\xfe{}")  # damaged: the loader cannot order it
    opened = open_generation(Consensus.single_process(), tmp_path, lambda manifest: ["a.safetensors"])
    assert opened.path == older
    named = [
        w for w in opened.warnings if newest.name in w and "manifest.json: manifest starts with a byte order mark" in w
    ]
    assert named, opened.warnings
    assert named[0] in caplog.text
