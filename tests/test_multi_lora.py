"""Multi-LoRA per-slot checkpoints (savers/multi_lora), the harness side.

Unit tests (one process, no megatron): reader links published with a generation and swapped
atomically, the same step saved twice, stray / malformed / half-written entries never chosen and
never crashing the scan, retention removing links, the operator tools on slot roots, the demo's
schedule. Multi-rank (real megatron, gloo): one W=4 job (the stale-shard scenario: an EP=4 slot save fails
inside its PEFT export after its shards are staged, then EP=1), one W=2 job (fault injection at every save and load phase on every rank, the empty-shard
guard, a slot generation resumed into another slot index bit for bit, a slot saved with its PEFT export), and `demo --slots 2` killed mid-save and resumed
bit-exact per slot (with a negative control).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from jobs_paths import JOBS

from miles_lora_ckpt.core import faults
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import MANIFEST, TRACKER, Topology
from miles_lora_ckpt.core.protocol import save_generation
from miles_lora_ckpt.savers.multi_lora import (
    SLOT_SAVER,
    check_reader_name,
    latest_slot_step,
    reader_links,
    v1_step_name,
)
from miles_lora_ckpt.tools.cli import main as cli

# --------------------------------------------------------------------------- one process


def slot_save(root: Path, step: int, links=(), **kwargs) -> Path:
    """A slot generation as the protocol writes it (the files are not the point here)."""
    return save_generation(
        Consensus.single_process(),
        root,
        iteration=step,
        saver=SLOT_SAVER,
        topology=Topology(),
        write_files=lambda writer: writer.write_json("x.json", {"step": step}),
        metadata={"slot": {"index": 1, "step": step, "params": []}},
        links=links,
        **kwargs,
    )


def test_reader_links_follow_every_publish_and_the_same_step_twice_replaces_it(tmp_path):
    root = tmp_path / "checkpoints"
    first = slot_save(root, 2, links=["step_2"])
    assert os.readlink(root / "step_2") == first.name  # relative: the root can move
    again = slot_save(root, 2, links=["step_2"])  # the retire save of the same step
    assert again != first and os.readlink(root / "step_2") == again.name
    assert (root / "step_2").is_dir() and (root / "step_2" / MANIFEST).is_file()  # what Miles v1's scan sees
    assert reader_links(root) == {"step_2": again.name}
    assert latest_slot_step(root, consensus=Consensus.single_process()) == 2
    assert json.loads((root / TRACKER).read_text())["generation_dir"] == again.name
    slot_save(root, 4, links=["step_4", "tag-final"], keep=1)  # a v2 name beside the v1 one; retention
    assert reader_links(root) == {"step_4": os.readlink(root / "step_4"), "tag-final": os.readlink(root / "step_4")}
    assert not (root / first.name).exists() and not (root / again.name).exists()  # pruned, with its link
    assert cli(["verify", str(root / "step_4")]) == 0 and cli(["verify", str(root)]) == 0


def test_no_moment_without_a_link_a_failed_publish_leaves_the_old_one(tmp_path):
    root = tmp_path / "checkpoints"
    first = slot_save(root, 2, links=["step_2"])
    faults.arm("before-publish", 0, "raise")
    try:
        with pytest.raises(CheckpointError, match="before-publish"):
            slot_save(root, 2, links=["step_2"])
    finally:
        faults.disarm()
    assert (
        os.readlink(root / "step_2") == first.name and [n for n in os.listdir(root) if n.startswith(".staging")] == []
    )


def test_link_names_are_checked_and_a_real_directory_is_never_replaced(tmp_path):
    root = tmp_path / "checkpoints"
    for bad in ("gen-000000001-0123456789abcdef", ".staging-x", "a/b", "latest_generation.json", "", ".hidden"):
        with pytest.raises(ValueError):
            slot_save(root, 1, links=[bad])
        with pytest.raises(ValueError):
            check_reader_name(bad)
    assert v1_step_name(7) == "step_7" and check_reader_name("my_adapter-v2") == "my_adapter-v2"
    (root / "step_3").mkdir(parents=True)  # a stock Miles step_3 directory: never replaced by a link
    with pytest.raises(CheckpointError, match="not a symlink"):
        slot_save(root, 3, links=["step_3"])
    assert (root / "step_3").is_dir() and not (root / "step_3").is_symlink()


def test_stray_malformed_and_half_written_entries_never_crash_the_scan_and_are_never_chosen(tmp_path):
    root = tmp_path / "checkpoints"
    good = slot_save(root, 2, links=["step_2"])
    (root / "step_foo").mkdir()  # Miles v1's int(name.split("_")[1]) would raise here
    (root / "step_12_x").mkdir()
    (root / "step_9").mkdir()
    (root / "step_9" / "adapter_megatron_tp0_pp0.pt").write_bytes(b"junk")
    half = root / "gen-000000009-00000000000000aa"  # half-written: no manifest
    (half / "adapter").mkdir(parents=True)
    (half / "adapter" / "dense_tp000_pp000.safetensors").write_bytes(b"partial")
    torn = root / "gen-000000008-00000000000000bb"
    torn.mkdir()
    (torn / MANIFEST).write_text('{"format": "miles-lora-ckpt", "truncated')
    (root / ".staging-00000000000000cc").mkdir()
    (root / ".staging-00000000000000cc" / "x.json").write_text("{}")
    (root / "gen-garbage").mkdir()
    (root / "gen-000000010-00000000000000dd").write_text("a file named like a generation")
    os.symlink("gen-000000099-00000000000000ee", root / "step_99")  # dangling
    os.symlink("/etc", root / "step_5")  # pointing out of the root: not a reader link
    consensus = Consensus.single_process()
    assert latest_slot_step(root, consensus=consensus) == 2
    assert reader_links(root) == {"step_2": good.name, "step_99": "gen-000000099-00000000000000ee"}
    assert cli(["ls", str(root)]) == 0 and cli(["verify", str(root)]) == 0
    assert cli(["verify", str(root / "step_2")]) == 0
    assert cli(["gc", str(root), "--keep", "1", "--staging-min-age", "0"]) == 0
    assert not os.path.lexists(root / "step_99") and os.readlink(root / "step_2") == good.name  # dangling link gone
    assert latest_slot_step(root, consensus=consensus) == 2


def test_tools_understand_a_directory_of_slot_roots(tmp_path, capsys):
    save_dir = tmp_path / "adapters"
    a = slot_save(save_dir / "alpha" / "checkpoints", 3, links=["step_3"])
    slot_save(save_dir / "beta" / "checkpoints", 4, links=["step_4"])
    capsys.readouterr()
    assert cli(["ls", str(save_dir / "alpha" / "checkpoints")]) == 0
    out = capsys.readouterr().out
    assert f"{a.name}  [slot 1]  <- step_3  <- tracker" in out
    assert cli(["verify", str(save_dir)]) == 0
    out = capsys.readouterr().out
    assert "== " + str(save_dir / "alpha" / "checkpoints") in out and out.count("\nOK ") + out.startswith("OK ") == 2
    assert cli(["ls", "--json", str(save_dir / "beta" / "checkpoints")]) == 0
    rows = json.loads(capsys.readouterr().out)["entries"]
    assert rows[0]["links"] == ["step_4"] and rows[0]["slot"] == 1
    assert cli(["inspect", str(save_dir / "alpha" / "checkpoints" / "step_3")]) == 0
    assert "saver multi-lora-slot" in capsys.readouterr().out
    (save_dir / "beta" / "checkpoints" / a.name).mkdir()  # damage: an empty generation directory
    assert cli(["verify", "--all", str(save_dir)]) == 1  # the worst root wins
    assert cli(["gc", str(save_dir), "--keep", "1", "--dry-run"]) == 0


def test_the_demo_schedule_retires_and_re_registers_the_last_slot():
    from miles_lora_ckpt_harness.demo.slots import cadence, plan_schedule

    events = plan_schedule(2, 8, 2)
    marks = [e for e in events if e[0] != "train"]
    assert marks == [
        ["save", 1, 2],
        ["retire", 1, 2],  # the same step saved twice
        ["save", 0, 3],
        ["register", 1, 2],
        ["save", 1, 4],
        ["save", 0, 6],
        ["save", 1, 6],
    ]
    for slot in (0, 1):  # every slot trains each of its steps exactly once, in order
        assert [e[2] for e in events if e[0] == "train" and e[1] == slot] == list(range(8))
    assert cadence(0, 2, 2) != cadence(1, 2, 2)


# --------------------------------------------------------------------------- multi-rank (megatron)

megatron = [pytest.mark.megatron, pytest.mark.multirank]
CONFIG = {"world_size": 2, "slots": 2, "adapters": "mixed", "distributed": False}


def run_suite(world: int, payload: dict) -> list[dict]:
    from miles_lora_ckpt_harness.sim.launch import check_all, run_workers

    results = run_workers(world, "multi_lora_jobs:suite", payload, sys_path=[JOBS], timeout_s=500)
    return check_all(results)


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    from miles_lora_ckpt.core.faults import LOAD_PHASES, PREPARE_PHASES, SAVE_PHASES
    from miles_lora_ckpt_harness.sim.hf_base import build_tiny_qwen2
    from miles_lora_ckpt_harness.sim.qwen2_model import Qwen2SimConfig

    base = tmp_path_factory.mktemp("multi_lora_w2")
    build_tiny_qwen2(base / "hf-base", Qwen2SimConfig().hf_config_kwargs())
    payload = {
        "faults": {
            "root": str(base / "faults"),
            "config": CONFIG,
            "save_phases": list(PREPARE_PHASES + SAVE_PHASES),
            "load_phases": list(LOAD_PHASES),
        },
        "guards": {"root": str(base / "guards"), "config": CONFIG},
        "retire": {"root": str(base / "retire"), "config": CONFIG},
        "peft": {
            "root": str(base / "peft"),
            "config": {"model": "qwen2", "world_size": 2},
            "hf_base": str(base / "hf-base"),
        },
    }
    return run_suite(2, payload)


@pytest.mark.megatron
@pytest.mark.multirank
def test_stale_shards_of_a_failed_ep4_attempt_are_never_promoted_nor_read(tmp_path):
    ep4 = {**CONFIG, "world_size": 4, "ep": 4}
    results = run_suite(
        4, {"stale_shards": {"root": str(tmp_path / "slot"), "ep4": ep4, "ep1": {**CONFIG, "world_size": 4}}}
    )
    for rank, result in enumerate(results):
        r = result["stale_shards"]
        assert r == results[0]["stale_shards"], rank  # every rank saw the same
        assert "'peft-export' on rank 3" in r["failed"]  # failed inside the export ...
        # ... after every rank's shards of that attempt were staged: the export saw them on disk
        seen = results[rank]["stale_shards"]["staged_during_export"]
        assert (
            "adapter/expert_pp000_ep003_etp000.safetensors" in seen and "adapter/dense_tp000_pp000.safetensors" in seen
        )
        assert not any("adapter_model" in f for f in seen)  # the PEFT files were never written
        # the failed EP=4 attempt left its shards behind (its coordinator never cleaned up)
        assert len(r["stale_staging"]) == 1 and "adapter/expert_pp000_ep003_etp000.safetensors" in r["stale_files"]
        # EP=1 saved the same step: a new attempt directory, only EP=1 shards published
        assert not any("_ep001" in f or "_ep002" in f or "_ep003" in f for f in r["published_files"]), r[
            "published_files"
        ]
        assert "adapter/expert_pp000_ep000_etp000.safetensors" in r["published_files"]
        assert (
            r["links"]["step_4"] == r["published"] and r["miles_v1_scan"] == ["step_2", "step_4"] and r["latest"] == 4
        )
        # a later EP=4 load refuses the EP=1 generation on every rank, changing nothing
        assert "ep: 1 -> 4 (expert parallel)" in r["ep4_load"] and "rank(s) [0, 1, 2, 3]" in r["ep4_load"]
        assert r["ep4_changed"] is None
        assert r["ep4_step2"] == [True, 2, True]  # the EP=4 generation by its name: restored ...
        assert r["ep4_step2_differs"][0] > 0 and r["ep4_step2_differs"][1] == []  # ... bit for bit
        # the published step 4 holds the EP=1 run's values: an EP=1 load restores them bit for bit
        assert r["ep1_reload"] == [True, 4, r["published"]] and r["ep1_reload_differs"][1] == []
        assert r["ep1_reload_differs"][0] > 0  # slot 1's adapter, masters, moments, steps, scheduler compared


@pytest.mark.megatron
@pytest.mark.multirank
def test_faults_at_every_save_phase_on_every_rank_keep_the_previous_generation(w2):
    saves = w2[0]["faults"]["save"]
    assert len(saves) == 8 * 2
    for case, r in saves.items():
        phase, rank = case.split("@")
        assert all(res["faults"]["save"][case]["error"] == r["error"] for res in w2), case  # the same everywhere
        assert r["error"] and f"'{phase}' on rank {rank}" in r["error"], case
        assert r["previous_linked"] and r["previous_exists"] and r["staging"] == [], case
        if phase == "after-publish":  # already published when the fault fired: the new one is complete
            assert r["step_3"] is not None and r["latest"] == 3, case
        else:
            assert r["step_3"] is None and r["latest"] == 2, case


@pytest.mark.megatron
@pytest.mark.multirank
def test_a_failed_load_changes_neither_the_slot_nor_its_co_tenant(w2):
    for rank, result in enumerate(w2):
        loads = result["faults"]["load"]
        assert len(loads) == 2 * 2
        for case, r in loads.items():
            phase, failing = case.split("@")
            assert r["error"] == w2[0]["faults"]["load"][case]["error"] and f"'{phase}' on rank {failing}" in r["error"]
            assert r["changed"] is None, (rank, case, r["changed"])
        good = result["faults"]["good_load"]
        assert good["iteration"] == 2 and good["changed"]  # the slot moved back to step 2 ...
        assert set(good["slot_of"]) == {1}, good  # ... and nothing of slot 0 changed


@pytest.mark.megatron
@pytest.mark.multirank
def test_the_empty_shard_guard_refuses_on_every_rank(w2):
    for result in w2:
        g = result["guards"]
        for case in g:
            if case not in ("missing", "remap"):
                assert g[case]["error"] == w2[0]["guards"][case]["error"] and g[case]["changed"] is None, case
        assert "empty slot shard" in g["save_empty"]["error"] and "rank(s) [0, 1]" in g["save_empty"]["error"]
        assert "incomplete slot shard" in g["save_partial"]["error"] and "linear_proj" in g["save_partial"]["error"]
        assert not any(n.startswith(("gen-", "step_")) for n in g["save_partial"]["entries"])  # nothing written
        assert (
            "adapter names differ: missing" in g["load_partial"]["error"]
            and "linear_proj" in g["load_partial"]["error"]
        )
        assert "does not cover every parameter of the slot" in g["load_uncovered"]["error"]
        assert "holds slot 1, not slot 0" in g["load_other_slot"]["error"]
        assert "empty slot shard" in g["load_empty"]["error"]
        assert "saver 'multi-lora-slot', not 'single-lora'" in g["single_loads_slot"]["error"]
        assert "saver 'single-lora', not 'multi-lora-slot'" in g["slot_loads_single"]["error"]
        assert g["missing"] == [False, None]


@pytest.mark.megatron
@pytest.mark.multirank
def test_a_slot_generation_resumes_bit_exact_into_another_slot_index_its_co_tenant_untouched(w2):
    def over_ranks(part: str) -> dict:  # LayerWise: slot 0's whole params sit on other ranks than slot 1's
        merged: dict = {}
        for result in w2:
            for key, digest in result["guards"]["remap"][part].items():
                merged.setdefault(key, []).append(digest)
        return {key: sorted(digests) for key, digests in merged.items()}

    saved, restored, before = over_ranks("saved"), over_ranks("restored"), over_ranks("before")
    assert sorted(saved) == sorted(restored), sorted(set(saved) ^ set(restored))
    assert any("/state/" in k for k in saved) and "slot0/scheduler" in saved
    assert [k for k in saved if saved[k] != restored[k]] == []  # every tensor, counter, group, scheduler
    assert [k for k in saved if saved[k] != before[k]]  # negative control: slot 0 held other values
    for result in w2:
        r = result["guards"]["remap"]
        assert r["loaded"] == [True, 2, True, True]
        assert r["cotenant_changed"] == [] and r["others_changed"] == []  # slot 1, now at the saved index


@pytest.mark.megatron
@pytest.mark.multirank
def test_retire_replaces_the_same_step_resets_only_the_slot_and_registers_back_exactly(w2):
    for result in w2:
        r = result["retire"]
        assert r["replaced"] == [True, True] and r["periodic_still_there"]  # a new generation, the link swapped
        assert r["changed_slots"] == [1], r["changed_slots"]  # slot 0 (the co-tenant) untouched
        assert r["slot1_zero"] and r["moments_zero"]
        assert r["registered_again"] is None  # restored bit for bit from the retire save


@pytest.mark.megatron
@pytest.mark.multirank
def test_a_slot_saved_with_its_peft_export(w2):
    r = w2[0]["peft"]
    assert r["peft_files"] == ["adapter_config.json", "adapter_model.safetensors"] and r["problems"] == []
    assert cli(["verify", r["path"]]) == 0  # verify also checks the PEFT adapter in it


@pytest.mark.megatron
@pytest.mark.multirank
@pytest.mark.skipif(
    os.environ.get("MILES_LORA_CKPT_TIER") == "mcore-0.19",
    reason="tier 2 runs the slot jobs above (save, load, retire on 0.19's LayerWise); the demo runs on tier 1",
)
def test_demo_slots_killed_mid_save_resumes_every_slot_bit_exact(tmp_path, capsys):
    args = ["demo", "--slots", "2", "--workdir", str(tmp_path), "--crash-at", "before-publish", "--crash-rank", "0"]
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == "RESULT: bit-exact"
    assert "killed by signal 9 (crash injected at before-publish)" in out
    assert "retire slot1@2" in out and "register slot1@2" in out
    assert "slot0: restored adapter, fp32 masters + moments, scheduler from gen-000000006" in out
    assert (
        "slot1: restored adapter, fp32 masters + moments, scheduler from gen-000000004" in out
    )  # after re-registering
    roots = tmp_path / "ckpt" / "adapters"
    assert sorted(reader_links(roots / "slot1" / "checkpoints")) == ["step_2", "step_4"]  # step_6 never published
    assert cli(["verify", str(roots)]) == 0
    # negative control: one differing tensor of slot 1 in the reference is found and named
    reference = json.loads((tmp_path / "reference.json").read_text())
    name = next(n for n in sorted(reference["digests"]["0"]) if "layers.1." in n)
    reference["digests"]["0"][name] = "0" * 64
    (tmp_path / "reference.json").write_text(json.dumps(reference))
    capsys.readouterr()
    assert cli(["demo", "--slots", "2", "--workdir", str(tmp_path), "--phase", "resume"]) == 1
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == f"RESULT: MISMATCH slot1:rank0:{name}" and "slot0: " in out


def test_bad_arguments_fail_collectively_before_anything_is_touched(tmp_path):
    from miles_lora_ckpt.savers.multi_lora import load_slot_checkpoint, save_slot_checkpoint

    one = Consensus.single_process()
    cases = [
        dict(slot=-1, step=2, adapter_filter=lambda n: True),
        dict(slot=0, step=2.5, adapter_filter=lambda n: True),
        dict(slot=0, step=2, adapter_filter=None),
        dict(slot=0, step=2, adapter_filter=lambda n: True, reader_names=["gen-000000002-0123456789abcdef"]),
    ]
    for case in cases:  # the model is never looked at: None would fail any later phase differently
        with pytest.raises(CheckpointError, match="checkpoint phase 'arguments' failed"):
            save_slot_checkpoint(None, None, tmp_path / "root", consensus=one, **case)
    with pytest.raises(CheckpointError, match="checkpoint phase 'arguments' failed"):
        load_slot_checkpoint(None, tmp_path / "root", slot=True, adapter_filter=lambda n: True, consensus=one)
    assert not (tmp_path / "root").exists()


def test_a_slot_remap_shows_the_loader_the_saved_slot_names_and_children_and_refuses_what_differs():
    import re
    from types import SimpleNamespace

    import torch

    from miles_lora_ckpt.core.errors import IncompatibleCheckpoint
    from miles_lora_ckpt.megatron.optimizer_children import leaf_children
    from miles_lora_ckpt.savers.multi_lora import rename_by_pattern
    from miles_lora_ckpt.savers.multi_lora.remap import SlotRemap, model_view, optimizer_view

    rename = rename_by_pattern(re.compile(r"\.adapter\.adapters\.(\d+)\."))
    remap = SlotRemap(saved=1, slot=2, rename=rename)  # saved from slot 1, loading into slot 2

    def name(slot: int) -> str:
        return f"fc1.adapter.adapters.{slot}.linear_in.weight"

    assert [remap.view_name(name(s)) for s in (0, 1, 2)] == [name(0), name(2), name(1)]  # a swap
    assert remap.view_name("fc1.adapter.adapters.12.linear_in.weight").endswith("adapters.12.linear_in.weight")
    in_slot_2 = remap.view_filter(lambda n: ".adapters.2." in n)
    assert in_slot_2(name(1)) and not in_slot_2(name(2))  # the loading slot's params under saved names

    adapters = torch.nn.ModuleList(torch.nn.ModuleDict({"linear_in": torch.nn.Linear(2, 2)}) for _ in range(3))
    model = torch.nn.Module()
    model.fc1 = torch.nn.Module()
    model.fc1.adapter = torch.nn.Module()
    model.fc1.adapter.adapters = adapters
    real = dict(model.named_parameters())
    viewed = dict(model_view(model, remap)[0].named_parameters())
    assert viewed[name(1)] is real[name(2)] and viewed[name(2)] is real[name(1)] and viewed[name(0)] is real[name(0)]
    assert real[name(1)] is not real[name(2)]  # negative control: unmapped, slot 1's names are another slot's
    with pytest.raises(ValueError, match="collide"):  # a renamer that is no swap
        model_view(model, SlotRemap(1, 2, lambda n, a, b: name(0)))

    # the chain: slot s has children [2s, 2s + 1]; the saved [2, 3] stand for slot 2's [4, 5]
    chain = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=object()) for _ in range(6)])
    leaves = [c.optimizer for c in leaf_children(chain)]
    view, children = optimizer_view(chain, [2, 3], [4, 5])
    assert children == [2, 3]
    assert [c.optimizer for c in leaf_children(view)] == [leaves[i] for i in (0, 1, 4, 5, 2, 3)]
    assert [c.index for c in leaf_children(view)] == list(range(6))
    view, children = optimizer_view(chain, [2, 3], [3, 4])  # overlapping: still a permutation
    assert children == [2, 3] and [c.optimizer for c in leaf_children(view)] == [leaves[i] for i in (0, 1, 3, 4, 2, 5)]
    with pytest.raises(IncompatibleCheckpoint, match="do not correspond one-to-one"):
        optimizer_view(chain, [2, 3], [4])
    with pytest.raises(IncompatibleCheckpoint, match="this chain has 6"):
        optimizer_view(chain, [6, 7], [4, 5])
