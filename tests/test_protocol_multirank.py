"""The checkpoint protocol across real processes: injected exceptions, real SIGKILLs, dead peers.

Workers are plain gloo processes (no megatron), so each job starts in about two seconds.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
from jobs_paths import TESTS
from protocol_generations import load_ranks, rank_file, rank_tensors, save_ranks

from miles_lora_ckpt.core import faults
from miles_lora_ckpt.core.consensus import SLOT_BYTES, Consensus, Outcome
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.faults import SAVE_PHASES
from miles_lora_ckpt.core.layout import TRACKER, Topology
from miles_lora_ckpt.core.protocol import open_generation, save_generation
from miles_lora_ckpt.core.verify import verify_generation
from miles_lora_ckpt.tools.cli import main as cli
from miles_lora_ckpt_harness.sim.launch import check_all, run_workers

pytestmark = pytest.mark.multirank

COMMIT_PHASES = ("after-consensus", "mid-manifest", "before-publish")


def jobs(world, target, payload, **kwargs):
    return run_workers(world, f"test_protocol_multirank:{target}", payload, sys_path=[TESTS], megatron=False, **kwargs)


def _tracker(root: Path) -> str | None:
    path = root / TRACKER
    return path.read_text() if path.exists() else None


def raise_matrix(payload: dict, ctx) -> dict:
    """Every save phase on every rank raises once; returns what each attempt looked like here."""
    consensus = Consensus.for_world(timeout_s=payload.get("timeout_s", 60))
    root = Path(payload["root"])
    iteration = 1
    save_ranks(consensus, root, iteration)
    cases = []
    for phase in faults.SAVE_PHASES:
        for failing in range(ctx.world_size):
            before = _tracker(root)
            if ctx.rank == failing:
                faults.arm(phase, failing, "raise")
            started = time.monotonic()
            try:
                save_ranks(consensus, root, iteration + 1)
                error = None
            except CheckpointError as exc:
                error = {"phase": exc.phase, "ranks": exc.failed_ranks, "text": str(exc)}
            faults.disarm()
            elapsed = time.monotonic() - started
            after = _tracker(root)
            # the previous (or, after publish, the new) generation must load on every rank
            loaded_iteration, same = load_ranks(consensus, root)
            iteration += 1 if phase == "after-publish" else 0
            cases.append(
                {
                    "phase": phase,
                    "failing": failing,
                    "error": error,
                    "tracker_unchanged": before == after,
                    "loaded_iteration": loaded_iteration,
                    "expected_iteration": iteration,
                    "content_ok": same,
                    "seconds": elapsed,
                }
            )
            # a later save succeeds
            iteration += 1
            save_ranks(consensus, root, iteration)
    # load-side faults: one rank fails before reading
    load_errors = []
    for failing in range(ctx.world_size):
        if ctx.rank == failing:
            faults.arm("before-read", failing, "raise")
        try:
            load_ranks(consensus, root)
            load_errors.append(None)
        except CheckpointError as exc:
            load_errors.append({"phase": exc.phase, "ranks": exc.failed_ranks})
        faults.disarm()
    return {"cases": cases, "load_errors": load_errors, "final_iteration": iteration}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_phase_on_every_rank_raises_the_same_error_everywhere(world, tmp_path):
    results = check_all(jobs(world, "raise_matrix", {"root": str(tmp_path / "root"), "timeout_s": 30}))
    cases = [r["cases"] for r in results]
    assert len(cases[0]) == len(SAVE_PHASES) * world
    for index, case in enumerate(cases[0]):
        phase, failing = case["phase"], case["failing"]
        expected_phase = "publish" if phase == "after-publish" else "commit" if phase in COMMIT_PHASES else "write"
        for rank_cases in cases:
            mine = rank_cases[index]
            assert mine["error"] is not None, (phase, failing)
            assert mine["error"]["text"] == case["error"]["text"]  # identical on every rank
            assert mine["error"]["phase"] == expected_phase and mine["error"]["ranks"] == [failing]
            assert f"injected fault at phase '{phase}' on rank {failing}" in mine["error"]["text"]
            # past the publishing rename, every rank says the generation was committed, naming it
            committed = mine["error"]["text"].startswith("generation gen-") and (
                " committed; the failure after it: " in mine["error"]["text"]
            )
            assert committed == (phase == "after-publish"), (phase, failing, mine["error"]["text"])
            assert mine["seconds"] < 30
            assert mine["content_ok"] and mine["loaded_iteration"] == mine["expected_iteration"]
            # the previous generation and the tracker are untouched unless the fault came after publishing
            assert mine["tracker_unchanged"] == (phase != "after-publish"), (phase, failing)
    for result in results:
        assert [e["ranks"] for e in result["load_errors"]] == [[r] for r in range(world)]
        assert all(e["phase"] == "read" for e in result["load_errors"])
    # and after all that, the root holds only intact generations
    assert cli(["verify", str(tmp_path / "root"), "--all"]) == 0


def kill_once(payload: dict, ctx) -> dict:
    """Two good saves, then a third during which `payload['rank']` SIGKILLs itself at a phase.
    Also returns what the consensus logged at debug level, and the transport's own error text."""

    consensus = Consensus.for_world(timeout_s=payload.get("timeout_s", 20))
    root = Path(payload["root"])
    save_ranks(consensus, root, 1)
    save_ranks(consensus, root, 2)
    if ctx.rank == payload["rank"]:
        faults.arm(payload["phase"], ctx.rank, "kill")
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(logging.Formatter().format(record))
    logger = logging.getLogger("miles_lora_ckpt.core.consensus")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    transport = []
    try:
        result = _timed_save(consensus, root, 3, errors=transport)
    finally:
        logger.removeHandler(handler)
    return {**result, "debug_log": "\n".join(records), "transport": transport}


def _timed_save(consensus: Consensus, root: Path, iteration: int, errors: list | None = None) -> dict:
    """Save once; report "saved" or the CheckpointError text, and how long it took (`errors` gets
    the text of the exception the CheckpointError was raised from, if any)."""
    started = time.monotonic()
    try:
        save_ranks(consensus, root, iteration)
        outcome = "saved"
    except CheckpointError as exc:
        outcome = f"CheckpointError: {exc}"
        if errors is not None and exc.__context__ is not None:
            errors.append(str(exc.__context__))
    return {"outcome": outcome, "seconds": time.monotonic() - started}


@pytest.mark.parametrize("phase_index", range(len(SAVE_PHASES)))
def test_sigkill_at_each_phase_leaves_a_loadable_root(phase_index, tmp_path):
    phase = SAVE_PHASES[phase_index]
    world = 2 if phase_index % 2 else 3
    killed = phase_index % world
    root = tmp_path / "root"
    results = jobs(world, "kill_once", {"root": str(root), "phase": phase, "rank": killed, "timeout_s": 20})
    assert results[killed].exitcode == -9, results[killed]
    expected_phase = "publish" if phase == "after-publish" else "commit" if phase in COMMIT_PHASES else "write"
    for result in results:
        if result.rank != killed:
            assert result.ok, result.error
            outcome = result.result["outcome"]
            assert outcome.startswith("CheckpointError"), result.result
            assert result.result["seconds"] < 25
            # one line names the rank, the phase and what happened; the transport's own text
            # (gloo's source paths, socket errors) is in the debug log only
            line = f"  rank {result.rank}: the collective of phase '{expected_phase}' failed on rank {result.rank}"
            assert f"{line}: a peer died or timed out (" in outcome, outcome
            assert len(outcome.splitlines()) == 2, outcome  # the header and the one failing rank
            (transport,) = result.result["transport"]
            assert transport and transport not in outcome and "gloo" not in outcome, outcome
            assert transport in result.result["debug_log"], result.result["debug_log"]
    published = phase == "after-publish"  # only then did the rename happen
    # the newest committed generation verifies and loads; staging leftovers are never read
    assert cli(["verify", str(root)]) == 0
    opened = open_generation(Consensus.single_process(), root, lambda m: [f"shards/rank{killed:03d}.safetensors"])
    assert opened.path.name.startswith("gen-")
    assert opened.manifest.iteration == (3 if published else 2)
    # and a later save succeeds
    save_generation(
        Consensus.single_process(),
        root,
        iteration=4,
        saver="test",
        topology=opened.manifest.topology,
        write_files=lambda w: w.write_json("x.json", {}),
        keep=2,
    )
    assert cli(["verify", str(root)]) == 0


def hang_peer(payload: dict, ctx) -> dict:
    """Rank 1 stalls past the consensus timeout; everybody must get a CheckpointError, not hang."""
    consensus = Consensus.for_world(timeout_s=payload["timeout_s"])
    root = Path(payload["root"])
    if ctx.rank == 1:
        time.sleep(payload["stall_s"])
    return _timed_save(consensus, root, 1)


def test_a_hung_peer_becomes_an_error_after_the_timeout(tmp_path):
    results = jobs(2, "hang_peer", {"root": str(tmp_path / "root"), "timeout_s": 3, "stall_s": 8}, timeout_s=60)
    assert all(r.ok for r in results), [r.error for r in results]
    first = results[0].result
    assert first["outcome"].startswith("CheckpointError") and "timed out" in first["outcome"]
    assert first["seconds"] < 8  # it did not wait for the stalled peer
    assert results[1].result["outcome"].startswith("CheckpointError")


def disagreeing_generations(payload: dict, ctx) -> dict:
    """Each rank is pointed at a different generation: loading must fail on all ranks."""
    consensus = Consensus.for_world(timeout_s=30)
    root = Path(payload["root"])
    save_ranks(consensus, root, 10)
    save_ranks(consensus, root, 11)
    gens = sorted(p for p in root.iterdir() if p.name.startswith("gen-"))
    # rank-local choice, as stock Miles does it: every rank verifies "its" generation
    mine = gens[ctx.rank % len(gens)]
    # payloads around the consensus' first slot (SLOT_BYTES), longer on one rank than the other
    sizes = (0, SLOT_BYTES - 40, SLOT_BYTES - 12, SLOT_BYTES - 11, SLOT_BYTES, 3 * SLOT_BYTES)
    expected = [[{"r": r, "s": "\u00e9" * (n if r == 1 else n // 3)} for r in range(ctx.world_size)] for n in sizes]
    agreed = [consensus.agree("sizes", Outcome.success(e[ctx.rank])) for e in expected]
    try:
        opened = open_generation(consensus, mine if ctx.rank == 0 else root, lambda m: [rank_file(ctx.rank)])
        return {"iteration": opened.manifest.iteration, "ok": verify_generation(opened.path).intact}
    except CheckpointError as exc:
        return {"error": str(exc), "payloads_ok": agreed == expected}


def test_ranks_asking_for_different_generations_fail_together(tmp_path):
    results = check_all(jobs(2, "disagreeing_generations", {"root": str(tmp_path / "root")}))
    assert all("ranks disagree" in r["error"] for r in results), results
    assert all(r["payloads_ok"] for r in results)  # agreements longer than one slot arrive whole


def pid(payload: dict, ctx) -> dict:
    return {"pid": os.getpid()}


def chaos_writer(payload: dict, ctx) -> dict:
    """One of two training runs saving into the same root at the same time.

    Saves `saves` generations (iterations `first`, `first`+1, ...), recording for each whether it
    committed or was refused; then keeps running (and holding the lease, if it won it) until the
    other run is done, so the other one meets a live writer every time.
    """
    consensus = Consensus.for_world(timeout_s=60)
    root, scratch = Path(payload["root"]), Path(payload["scratch"])
    outcomes = []
    for offset in range(payload["saves"]):
        iteration = payload["first"] + offset

        def write(writer, iteration=iteration):
            writer.write_tensors(rank_file(consensus.rank), rank_tensors(consensus.rank, iteration))

        topo = Topology(world=consensus.world_size, dp=consensus.world_size)
        try:
            path = save_generation(consensus, root, iteration=iteration, saver="test", topology=topo, write_files=write)
            outcomes.append({"saved": path.name})
        except CheckpointError as exc:
            outcomes.append({"refused": str(exc)})
        time.sleep(payload.get("pause_s", 0.1))
    (scratch / f"done-{payload['name']}-{ctx.rank}").touch()
    deadline = time.monotonic() + 60
    while len(list(scratch.glob("done-*"))) < 2 * ctx.world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"outcomes": outcomes, "pid": os.getpid()}


def test_two_writers_on_one_root_one_is_refused_and_every_save_of_the_other_commits(tmp_path):
    root = tmp_path / "root"
    results = {}

    def writer(name, first):
        payload = {"root": str(root), "scratch": str(tmp_path), "name": name, "first": first, "saves": 4}
        results[name] = check_all(jobs(2, "chaos_writer", payload, timeout_s=120))

    threads = [threading.Thread(target=writer, args=(name, first)) for name, first in (("a", 1), ("b", 101))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    saved = {name: all("saved" in o for o in r[0]["outcomes"]) for name, r in results.items()}
    refused = {name: all("refused" in o for o in r[0]["outcomes"]) for name, r in results.items()}
    assert sorted(saved.values()) == [False, True] and sorted(refused.values()) == [False, True], results
    winner = next(name for name, ok in saved.items() if ok)
    loser = next(name for name in results if name != winner)
    holder_pid = results[winner][0]["pid"]
    for rank_result in results[loser]:
        for outcome, first in zip(rank_result["outcomes"], results[loser][0]["outcomes"], strict=True):
            assert outcome["refused"] == first["refused"]  # the same error on every rank
            assert "phase 'prepare'" in outcome["refused"] and "has another writer" in outcome["refused"]
            assert f"pid {holder_pid}" in outcome["refused"]
    # the loser wrote nothing; every save of the winner committed and verifies
    committed = sorted(p.name for p in root.iterdir() if p.name.startswith("gen-"))
    assert committed == sorted(o["saved"] for o in results[winner][0]["outcomes"])
    assert not [n for n in os.listdir(root) if n.startswith(".staging-")]
    assert cli(["verify", str(root), "--all"]) == 0


def fifo_load(payload: dict, ctx) -> dict:
    """Save, replace one listed file by a FIFO, load on every rank: all must fail within seconds."""
    consensus = Consensus.for_world(timeout_s=60)
    root = Path(payload["root"])
    gen = save_ranks(consensus, root, 1)
    consensus.agree("sync", Outcome.success())
    if ctx.rank == 0:
        target = gen / rank_file(1)
        target.unlink()
        os.mkfifo(target)
    consensus.agree("sync", Outcome.success())
    started = time.monotonic()
    try:
        open_generation(consensus, gen, lambda m: [rank_file(consensus.rank)])
        error = None
    except CheckpointError as exc:
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - started}


def test_a_fifo_in_a_generation_fails_every_loading_rank_within_seconds(tmp_path):
    results = check_all(jobs(2, "fifo_load", {"root": str(tmp_path / "root")}, timeout_s=60))
    for result in results:
        assert result["error"] and "is a fifo" in result["error"] and result["seconds"] < 10, result
    assert results[0]["error"] == results[1]["error"]
