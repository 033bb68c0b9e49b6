"""The load's look-ahead (`protocol._look_ahead`): each rank plans the generation its root's tracker
names and reads its own files of it, verified, before the first agreement round, so the load waits
on the disk once. The resolve round carries those plans and what the reads found, so a load whose
ranks all guessed the newest generation holds no plan round, and no read round either where every
listed byte was someone's to read. A look-ahead counts only for the generation it was made for; a
tracker that names another one, or none, changes nothing a load opens or reports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_corruption import ADAPTER, OPTIM, OPTIM1, STATE, make_generation

from miles_lora_ckpt.core import protocol
from miles_lora_ckpt.core.consensus import Consensus, Outcome
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import TRACKER
from miles_lora_ckpt.core.protocol import open_generation


class Recorder:
    """`files_for_rank` that records the generation of every manifest it was asked about."""

    def __init__(self, files=(ADAPTER, OPTIM, STATE)):
        self.files, self.asked = files, []

    def __call__(self, manifest):
        self.asked.append(manifest.iteration)
        return [f for f in self.files if f in manifest.files]


class Reads(list):
    """`(file name, agreement rounds before it)` of every verified whole-file read since `reset()`."""

    rounds = 0

    def reset(self) -> None:
        self.clear()
        self.rounds = 0


@pytest.fixture
def reads(monkeypatch):
    seen = Reads()
    agree = Consensus.agree
    check = protocol.check_file_content

    def counting(self, phase, outcome):
        seen.rounds += 1
        return agree(self, phase, outcome)

    def recording(gen_dir, relpath, manifest, **kwargs):
        seen.append((f"{Path(gen_dir).name}/{relpath}", seen.rounds))
        return check(gen_dir, relpath, manifest, **kwargs)

    monkeypatch.setattr(Consensus, "agree", counting)
    monkeypatch.setattr(protocol, "check_file_content", recording)
    return seen


def test_the_tracked_generation_is_read_before_any_round_and_planned_once(tmp_path, reads):
    make_generation(tmp_path, 1)
    newest = make_generation(tmp_path, 2)
    asked = Recorder()
    reads.reset()
    opened = open_generation(Consensus.single_process(), tmp_path, asked)
    assert opened.path == newest
    assert asked.asked == [2]  # the look-ahead's plan is the one used: files_for_rank ran once
    assert sorted(name for name, rounds in reads if rounds == 0) == [f"{newest.name}/{f}" for f in sorted(asked.files)]
    # the file nobody asked for is checked after the resolve round, in a read round of its own
    assert [(name, rounds) for name, rounds in reads if rounds] == [(f"{newest.name}/{OPTIM1}", 1)]
    assert reads.rounds == 2


def test_a_load_that_reads_every_listed_file_agrees_once(tmp_path, reads):
    newest = make_generation(tmp_path, 1)
    reads.reset()
    opened = open_generation(Consensus.single_process(), tmp_path, Recorder((ADAPTER, OPTIM, OPTIM1, STATE)))
    assert opened.path == newest and sorted(opened.files) == sorted((ADAPTER, OPTIM, OPTIM1, STATE))
    assert all(rounds == 0 for _, rounds in reads) and len(reads) == 4
    assert reads.rounds == 1  # resolve, carrying the plans and what the reads found: nothing else


def test_a_stale_tracker_costs_a_plan_and_a_read(tmp_path, reads):
    older = make_generation(tmp_path, 1)
    tracker = json.loads((tmp_path / TRACKER).read_text())
    newest = make_generation(tmp_path, 2)
    (tmp_path / TRACKER).write_text(json.dumps(tracker))  # names generation 1 again
    asked = Recorder()
    reads.reset()
    opened = open_generation(Consensus.single_process(), tmp_path, asked)
    assert opened.path == newest  # the agreed listing decides, never the tracker
    assert asked.asked == [1, 2]  # the guess was planned, then the newest was planned again
    assert {name.split("/")[0] for name, rounds in reads if rounds == 0} == {older.name}
    assert {name.split("/")[0] for name, rounds in reads if rounds} == {newest.name}
    assert torch.equal(opened.tensors(ADAPTER)["lora_A"], load_file(newest / ADAPTER)["lora_A"])
    assert reads.rounds == 3  # resolve, plan, read
    assert any(older.name in w for w in opened.warnings)  # the tracker's disagreement is reported as ever


@pytest.mark.parametrize("tracker", ["none", "not JSON", "not a generation's name", "not in the root"])
def test_a_tracker_that_names_no_generation_here_changes_nothing(tmp_path, reads, tracker):
    gone = make_generation(tmp_path, 1)
    named = json.loads((tmp_path / TRACKER).read_text())
    newest = make_generation(tmp_path, 3)
    shutil.rmtree(gone)
    text = {
        "none": None,
        "not JSON": "{",
        "not a generation's name": json.dumps({**named, "generation_dir": "../../etc"}),
        "not in the root": json.dumps(named),  # names generation 1, which is gone
    }[tracker]
    if text is None:
        (tmp_path / TRACKER).unlink()
    else:
        (tmp_path / TRACKER).write_text(text)
    asked = Recorder()
    reads.reset()
    opened = open_generation(Consensus.single_process(), tmp_path, asked)
    assert opened.path == newest and asked.asked == [3]
    assert reads and not any(rounds == 0 for _, rounds in reads)  # nothing guessed, nothing read early
    assert reads.rounds == 3  # resolve, plan, read


def test_a_generation_path_is_its_own_guess(tmp_path, reads):
    make_generation(tmp_path, 1)
    asked = Recorder()
    gen = make_generation(tmp_path, 2)
    reads.reset()
    assert open_generation(Consensus.single_process(), gen, asked).path == gen
    assert asked.asked == [2] and any(rounds == 0 for _, rounds in reads)


def test_damage_the_look_ahead_read_falls_back_on_the_resolve_round_s_word(tmp_path, reads):
    """What the look-ahead's read found travels with the listing: the damaged newest generation is
    skipped with a warning, and the older one is planned and read after it as ever."""
    older = make_generation(tmp_path, 1)
    newest = make_generation(tmp_path, 2)
    target = newest / ADAPTER
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x01
    target.write_bytes(bytes(data))
    reads.reset()
    opened = open_generation(Consensus.single_process(), tmp_path, Recorder((ADAPTER, OPTIM, OPTIM1, STATE)))
    assert opened.path == older
    assert any(newest.name in w and ADAPTER in w for w in opened.warnings)
    assert reads.rounds == 3  # resolve (the newest's verdict with it), then the older's plan and read


def test_a_refusal_in_the_look_ahead_is_the_load_s_refusal(tmp_path):
    """An error planning the guessed generation is that generation's plan: raised as before, once."""
    make_generation(tmp_path, 1)
    make_generation(tmp_path, 2)
    calls = []

    def buggy(manifest):
        calls.append(manifest.iteration)
        return [ADAPTER] + manifest.metadata["no such key"]  # a bug, not damage: it fails the load

    with pytest.raises(CheckpointError, match=r"(?s)phase 'resolve'.*KeyError: 'no such key'"):
        open_generation(Consensus.single_process(), tmp_path, buggy)
    assert calls == [2]  # never the older generation, and the newest planned once


def test_the_look_ahead_trusts_nothing_it_planned(tmp_path, monkeypatch):
    """A generation damaged after the look-ahead planned it is still skipped by the verified read."""
    older = make_generation(tmp_path, 1)
    newest = make_generation(tmp_path, 2)
    plan = protocol._plan_reads

    def then_damaged(candidate, files_for_rank, key):
        out = plan(candidate, files_for_rank, key)
        if Path(candidate) == newest:  # bytes change after the plan, before the read
            target = newest / ADAPTER
            data = bytearray(target.read_bytes())
            data[-1] ^= 0x01
            target.write_bytes(bytes(data))
        return out

    monkeypatch.setattr(protocol, "_plan_reads", then_damaged)
    opened = open_generation(Consensus.single_process(), tmp_path, Recorder())
    assert opened.path == older and any(newest.name in w for w in opened.warnings)


# --------------------------------------------------------------------------- across ranks


def guesses(payload: dict, ctx) -> dict:
    """Rank job: three loads of one root, each with another rank-local look-ahead (see the test)."""
    from protocol_generations import load_ranks, rank_file, rank_tensors, save_ranks

    from miles_lora_ckpt.core import verify
    from miles_lora_ckpt.core.errors import IncompatibleCheckpoint

    consensus = Consensus.for_world(timeout_s=60)
    root = Path(payload["root"])
    save_ranks(consensus, root, 1)
    save_ranks(consensus, root, 2)
    rounds = [0]
    agree = Consensus.agree

    def counting(self, phase, outcome):
        rounds[0] += 1
        return agree(self, phase, outcome)

    Consensus.agree = counting
    out = {}
    # every rank guesses the newest generation: resolve, then the read round of the files nobody asked for
    out["all"] = (*load_ranks(consensus, root), rounds[0])
    # every listed file is some rank's to read: the resolve round is the only one
    rounds[0] = 0
    claimed = [rank_file(ctx.rank), f"shards/second{ctx.rank:03d}.safetensors"] + ["meta/common.json"] * (ctx.rank == 0)
    opened = protocol.open_generation(consensus, root, lambda manifest: claimed)
    same = torch.equal(opened.tensors(rank_file(ctx.rank))["w"], rank_tensors(ctx.rank, 2)["w"])
    out["every"] = (opened.manifest.iteration, same, sorted(opened.files) == sorted(claimed), rounds[0])
    # rank 1 finds no tracker: the plan round is held as before, and every rank loads the newest
    rounds[0] = 0
    tracked = protocol.tracked_generation
    if ctx.rank == 1:
        protocol.tracked_generation = lambda path: None
    out["one_blind"] = (*load_ranks(consensus, root), rounds[0])
    protocol.tracked_generation = tracked

    # rank 1 refuses the guessed generation in its look-ahead: every rank fails with its reason
    def refusing(manifest):
        if ctx.rank == 1:
            raise IncompatibleCheckpoint("exact restore needs the same model-parallel layout (tp: 1 -> 2)")
        return [rank_file(ctx.rank)]

    try:
        protocol.open_generation(consensus, root, refusing)
        out["refused"] = None
    except CheckpointError as exc:
        out["refused"] = {"phase": exc.phase, "ranks": exc.failed_ranks, "text": str(exc)}

    # rank 1 plans the newest generation from another manifest than its peers: every rank skips it
    rounds[0] = 0
    plan = protocol._plan_reads

    def other_manifest(candidate, files_for_rank, key):
        gen, planned = plan(candidate, files_for_rank, key)
        if ctx.rank == 1 and gen.manifest.iteration == 2:
            planned = {**planned, "manifest": "xxh3_128:" + "0" * 32}
        return gen, planned

    protocol._plan_reads = other_manifest
    opened = protocol.open_generation(consensus, root, lambda manifest: [rank_file(ctx.rank)])
    mismatch = [w for w in opened.warnings if "manifest.json: changed while the load read it" in w]
    out["other_manifest"] = (opened.manifest.iteration, len(mismatch), rounds[0])
    protocol._plan_reads = plan

    # only rank 2's look-ahead finds its file of the newest generation damaged: every rank skips it
    consensus.agree("sync", Outcome.success())
    if ctx.rank == 0:
        newest = verify.tracked_generation(root)
        target = newest / rank_file(2)
        data = bytearray(target.read_bytes())
        data[-1] ^= 0x40
        target.write_bytes(bytes(data))
    consensus.agree("sync", Outcome.success())
    out["damaged"] = load_ranks(consensus, root)
    Consensus.agree = agree
    return out


@pytest.mark.multirank
def test_ranks_that_guess_differently_or_refuse_agree(tmp_path):
    from jobs_paths import TESTS

    from miles_lora_ckpt_harness.sim.launch import check_all, run_workers

    results = check_all(
        run_workers(3, "test_look_ahead:guesses", {"root": str(tmp_path)}, sys_path=[TESTS], megatron=False)
    )
    for out in results:
        assert out["all"] == [2, True, 2]  # iteration 2, bit-exact, resolve + read
        assert out["every"] == [2, True, True, 1]  # resolve only
        assert out["other_manifest"] == [1, 1, 3]  # resolve (the mismatch), then the older's plan and read
        assert out["one_blind"] == [2, True, 3]  # resolve, plan, read
        refused = out["refused"]
        assert refused["phase"] == "resolve" and refused["ranks"] == [1] and "tp: 1 -> 2" in refused["text"]
        assert out["damaged"] == [1, True]
