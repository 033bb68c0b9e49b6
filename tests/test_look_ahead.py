"""The load's look-ahead (`protocol._look_ahead`): each rank plans the generation its root's tracker
names and hints the kernel at its bytes before the first agreement round, so the disk reads while
the rounds run, and the resolve round carries those plans, so a load whose ranks all guessed the
newest generation holds no plan round of its own. A plan is used only for the generation it was
made for; a tracker that names another one, or none, changes nothing a load opens or reports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_corruption import ADAPTER, OPTIM, STATE, make_generation

from miles_lora_ckpt.core import protocol, read_ahead
from miles_lora_ckpt.core.consensus import Consensus
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


class Hints(list):
    """`(file name, agreement rounds before it)` of every `read_ahead.prefetch` since `reset()`."""

    rounds = 0

    def reset(self) -> None:
        self.clear()
        self.rounds = 0


@pytest.fixture
def hints(monkeypatch):
    seen = Hints()
    agree = Consensus.agree

    def counting(self, phase, outcome):
        seen.rounds += 1
        return agree(self, phase, outcome)

    def prefetch(path, record, spans=None):
        seen.append((Path(path).name, seen.rounds))

    monkeypatch.setattr(Consensus, "agree", counting)
    monkeypatch.setattr(read_ahead, "prefetch", prefetch)
    return seen


def test_the_tracked_generation_is_hinted_before_any_round_and_planned_once(tmp_path, hints):
    make_generation(tmp_path, 1)
    newest = make_generation(tmp_path, 2)
    asked = Recorder()
    hints.reset()
    opened = open_generation(Consensus.single_process(), tmp_path, asked)
    assert opened.path == newest
    assert asked.asked == [2]  # the look-ahead's plan is the one used: files_for_rank ran once
    before_rounds = sorted(name for name, rounds in hints if rounds == 0)
    assert before_rounds == sorted(Path(f).name for f in (ADAPTER, OPTIM, STATE))
    assert hints.rounds == 2  # resolve, carrying the plans, and read: no plan round of its own


def test_a_stale_tracker_only_costs_a_plan(tmp_path, hints):
    older = make_generation(tmp_path, 1)
    tracker = json.loads((tmp_path / TRACKER).read_text())
    newest = make_generation(tmp_path, 2)
    (tmp_path / TRACKER).write_text(json.dumps(tracker))  # names generation 1 again
    asked = Recorder()
    hints.reset()
    opened = open_generation(Consensus.single_process(), tmp_path, asked)
    assert opened.path == newest  # the agreed listing decides, never the tracker
    assert asked.asked == [1, 2]  # the guess was planned, then the newest was planned again
    assert hints.rounds == 3  # resolve, plan, read
    assert any(older.name in w for w in opened.warnings)  # the tracker's disagreement is reported as ever


@pytest.mark.parametrize("tracker", ["none", "not JSON", "not a generation's name", "not in the root"])
def test_a_tracker_that_names_no_generation_here_changes_nothing(tmp_path, hints, tracker):
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
    hints.reset()
    opened = open_generation(Consensus.single_process(), tmp_path, asked)
    assert opened.path == newest and asked.asked == [3]
    assert not any(rounds == 0 for _, rounds in hints)  # nothing guessed, nothing hinted early


def test_a_generation_path_is_its_own_guess(tmp_path, hints):
    make_generation(tmp_path, 1)
    asked = Recorder()
    gen = make_generation(tmp_path, 2)
    hints.reset()
    assert open_generation(Consensus.single_process(), gen, asked).path == gen
    assert asked.asked == [2] and any(rounds == 0 for _, rounds in hints)


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


def test_the_look_ahead_trusts_nothing_it_read(tmp_path, monkeypatch):
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
    from protocol_generations import load_ranks, rank_file, save_ranks

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
    # every rank guesses the newest generation: two rounds
    out["all"] = (*load_ranks(consensus, root), rounds[0])
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
    Consensus.agree = agree
    assert verify.tracked_generation(root) is not None
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
        assert out["one_blind"] == [2, True, 3]  # resolve, plan, read
        refused = out["refused"]
        assert refused["phase"] == "resolve" and refused["ranks"] == [1] and "tp: 1 -> 2" in refused["text"]
