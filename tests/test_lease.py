"""The writer lease: one writer per save root, stale leases taken over safely, renewal, release.

A second process holds a real lease here (no test double): a Python child that imports only the
protocol core, takes the lease, and waits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from single_lora_steps import load, run_steps, save

from miles_lora_ckpt.core import faults, lease, settings
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import LEASE, Topology
from miles_lora_ckpt.core.protocol import save_generation
from miles_lora_ckpt.core.verify import verify_generation
from miles_lora_ckpt_harness.sim.model import SimConfig
from miles_lora_ckpt_harness.sim.snapshot import compare_digests, snapshot, snapshot_digests
from miles_lora_ckpt_harness.sim.train import build_run, teardown

HOLDER = """
import sys, time
from pathlib import Path
from miles_lora_ckpt.core import lease
lease.acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture(autouse=True)
def _clean():
    settings.reset()
    yield
    settings.reset()


@pytest.fixture
def other_holder(tmp_path):
    """Another process on this host holding the lease of tmp_path."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "MILES_LORA_CKPT_RUN_ID": "run-other"},
    )
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_lease_names_its_holder_is_idempotent_and_released(tmp_path):
    with settings.overridden(run_id="run-7", lease_timeout_s=30.0):
        lease.acquire(tmp_path)
        lease.acquire(tmp_path)
    body = json.loads((tmp_path / LEASE).read_text())
    assert body["holder"]["pid"] == os.getpid() and body["holder"]["run"] == "run-7" and body["timeout_s"] == 30.0
    assert body["holder"]["host"] and body["acquired_unix_s"] > 0
    state = lease.read_state(tmp_path)
    assert state.live and state.holder.token == lease.me().token and f"pid {os.getpid()}" in state.describe()
    assert lease.holds(tmp_path)
    lease.release(tmp_path)
    assert not (tmp_path / LEASE).exists() and not lease.holds(tmp_path)
    assert sorted(os.listdir(tmp_path)) == []  # no probe or aside file is left behind


def test_a_second_writer_is_refused_naming_the_holder_until_it_is_gone(tmp_path, other_holder):
    with pytest.raises(lease.LeaseHeld) as info:
        lease.acquire(tmp_path)
    text = str(info.value)
    assert f"pid {other_holder.pid} run run-other" in text and "has another writer" in text
    other_holder.kill()
    other_holder.wait()
    lease.acquire(tmp_path)  # its process is gone and it ran on this host: taken over at once
    assert lease.read_state(tmp_path).holder.pid == os.getpid()
    lease.release(tmp_path)


def test_a_stale_lease_is_taken_over_and_its_old_holder_finds_out(tmp_path):
    lease.acquire(tmp_path)
    foreign = {"host": "elsewhere", "pid": 1, "run": "", "token": "feedfeedfeedfeed", "boot_id": "b"}
    then = time.time() - 1000
    body = {"format": "miles-lora-ckpt-lease", "holder": foreign, "acquired_unix_s": then, "timeout_s": 60}
    (tmp_path / LEASE).write_text(json.dumps(body))  # someone else took it over meanwhile
    with pytest.raises(lease.LeaseHeld, match="lost its writer lease; it is now held by host elsewhere"):
        lease.confirm(tmp_path)
    assert not lease.holds(tmp_path)
    os.utime(tmp_path / LEASE, (then, then))  # ... and then stopped renewing it
    state = lease.read_state(tmp_path)
    assert not state.live and "not renewed for" in state.stale_reason
    lease.acquire(tmp_path)
    assert lease.read_state(tmp_path).holder.token == lease.me().token
    lease.release(tmp_path)


def test_the_next_holder_removes_side_files_of_killed_lease_creations_once_they_are_old(tmp_path):
    # a creator killed between writing its side file and linking it, and a taker-over killed
    # between moving the stale lease aside and removing it, each leave one file behind
    old_new, old_aside = tmp_path / f"{LEASE}.new-0123456789ab", tmp_path / f"{LEASE}.aside-ba9876543210"
    young = tmp_path / f"{LEASE}.new-aaaaaaaaaaaa"
    unrelated = tmp_path / f"{LEASE}.new-not-ours"
    for path in (old_new, old_aside, young, unrelated):
        path.write_text("{}")
    then = time.time() - 1000
    for path in (old_new, old_aside, unrelated):
        os.utime(path, (then, then))
    lease.acquire(tmp_path)
    try:
        assert not old_new.exists() and not old_aside.exists()
        assert young.exists(), "a side file younger than the timeout may be a live creation's"
        assert unrelated.exists(), "only the lease's own side-file names are swept"
    finally:
        lease.release(tmp_path)


def test_a_lease_renewed_while_being_taken_over_is_put_back_and_the_contender_refused(tmp_path, other_holder):
    then = time.time() - 1000
    os.utime(tmp_path / LEASE, (then, then))
    judged = lease.read_state(tmp_path)
    content = (tmp_path / LEASE).read_text()
    os.utime(tmp_path / LEASE)  # the holder renews between our judgement and our rename
    with pytest.raises(lease.LeaseHeld, match="has another writer"):
        lease._take_over(tmp_path, judged)
    assert (tmp_path / LEASE).read_text() == content
    assert [n for n in os.listdir(tmp_path) if n != LEASE] == []


def test_the_heartbeat_keeps_a_lease_live_past_its_timeout(tmp_path):
    # Not a timed test: on a loaded machine the heartbeat thread may be late for one look, so the
    # lease is watched until it is seen renewed well after its timeout and live at that moment.
    # Without a heartbeat its mtime never moves past the acquire, and this fails after 60 s.
    with settings.overridden(lease_timeout_s=0.4):
        lease.acquire(tmp_path)
        acquired_ns = lease.read_state(tmp_path).mtime_ns
        time.sleep(1.2)
        deadline = time.monotonic() + 60
        while True:
            state = lease.read_state(tmp_path)
            if state.live and state.mtime_ns >= acquired_ns + 1_200_000_000:
                break
            assert time.monotonic() < deadline, f"never seen renewed past its timeout and live: {state}"
            time.sleep(0.05)
        assert state.age_s < 0.4, state
        lease.release(tmp_path)


def test_a_fork_does_not_release_its_parents_lease_at_exit(tmp_path):
    lease.acquire(tmp_path)
    pid = os.fork()
    if pid == 0:  # the child runs the exit handler, as a forked worker that exits normally would
        lease.release_all()
        os._exit(0)
    os.waitpid(pid, 0)
    assert lease.read_state(tmp_path).holder.token == lease.me().token
    lease.release(tmp_path)


def test_an_unreadable_lease_is_live_until_it_ages_out(tmp_path):
    (tmp_path / LEASE).write_text("{not json")
    with pytest.raises(lease.LeaseHeld, match="unreadable lease"):
        lease.acquire(tmp_path)
    then = time.time() - 1000
    os.utime(tmp_path / LEASE, (then, then))
    lease.acquire(tmp_path)
    lease.release(tmp_path)
    assert not Path(tmp_path / LEASE).exists()


# ------------------------------------------------------------------ crash leftovers and normal exits

CRASHING_SAVER = """
import sys
from pathlib import Path
from miles_lora_ckpt.core import faults
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.layout import Topology
from miles_lora_ckpt.core.protocol import save_generation

root, iteration = Path(sys.argv[1]), int(sys.argv[2])
def save(i):
    def write(w):
        w.write_json("big.json", {"i": i, "pad": "x" * 4096})
        w.write_json("second.json", {"i": i})
    return save_generation(Consensus.single_process(), root, iteration=i, saver="test", topology=Topology(), write_files=write)
print(save(iteration).name, flush=True)
faults.arm("mid-write", 0, "kill")  # the coordinator dies with its staging directory half written
save(iteration + 1)
"""


def _staging(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith((".staging-", ".deleting-")))


def test_the_next_save_reclaims_the_staging_of_crashed_coordinators_and_keeps_every_generation(tmp_path):
    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt.tools.cli import main as cli

    root = tmp_path / "root"
    committed, left = [], []
    for crash in range(3):  # three runs, each commits a save and is killed in the next one
        proc = subprocess.run(
            [sys.executable, "-c", CRASHING_SAVER, str(root), str(10 * crash + 1)], capture_output=True, text=True
        )
        assert proc.returncode == -9, proc.stderr
        committed.append(proc.stdout.strip())
        # each run's first save reclaimed what the previous run's crash left: only its own crash's is there
        (stale,) = _staging(root)
        assert stale not in left and os.listdir(root / stale)  # a new one, holding what was written
        left.append(stale)
    digests = {name: json.loads((root / name / "manifest.json").read_text())["manifest_digest"] for name in committed}

    final = save_generation(
        Consensus.single_process(),
        root,
        iteration=99,
        saver="test",
        topology=Topology(),
        write_files=lambda w: w.write_json("x.json", {}),
    )
    lease.release(root)
    assert _staging(root) == []  # the crashed attempts' directories are gone, no retention asked
    gens = sorted(p.name for p in root.iterdir() if p.name.startswith("gen-"))
    assert gens == sorted([*committed, final.name])  # every committed generation is still there
    for name in committed:
        assert json.loads((root / name / "manifest.json").read_text())["manifest_digest"] == digests[name]
        assert verify_generation(root / name).intact
    assert cli(["verify", str(root), "--all"]) == 0


def test_a_save_refused_by_a_live_writer_leaves_that_writers_staging_alone(tmp_path, other_holder):
    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt.core.errors import CheckpointError

    live = tmp_path / ".staging-00000000000000aa"  # the other writer's attempt in flight
    live.mkdir()
    (live / "part.json").write_text("{}")
    with pytest.raises(CheckpointError, match="has another writer"):
        save_generation(
            Consensus.single_process(),
            tmp_path,
            iteration=1,
            saver="test",
            topology=Topology(),
            write_files=lambda w: w.write_json("x.json", {}),
        )
    assert (live / "part.json").exists()


def test_a_save_never_reclaims_the_staging_of_another_attempt_of_its_own_process(tmp_path):
    """Two saves of one process on one root at once (e.g. a background save and another saver):
    the second's reclaim must leave the first's staging directory, live, alone."""
    import threading

    from miles_lora_ckpt.core.consensus import Consensus

    writing, resume, outcome = threading.Event(), threading.Event(), {}

    def slow_write(writer):
        writer.write_json("first.json", {"part": 1})
        writing.set()
        assert resume.wait(60)
        writer.write_json("second.json", {"part": 2})

    def first():
        try:
            outcome["first"] = save_generation(
                Consensus.single_process(),
                tmp_path,
                iteration=1,
                saver="test",
                topology=Topology(),
                write_files=slow_write,
            )
        except Exception as exc:  # noqa: BLE001 - reported below
            outcome["first"] = exc

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert writing.wait(60)
        (in_flight,) = _staging(tmp_path)
        second = save_generation(
            Consensus.single_process(),
            tmp_path,
            iteration=2,
            saver="test",
            topology=Topology(),
            write_files=lambda w: w.write_json("x.json", {}),
        )
        assert _staging(tmp_path) == [in_flight]  # still there, still being written
    finally:
        resume.set()
        thread.join(60)
    lease.release(tmp_path)
    assert isinstance(outcome["first"], Path), outcome["first"]
    assert sorted(os.listdir(outcome["first"])) == ["first.json", "manifest.json", "second.json"]
    assert second.exists() and _staging(tmp_path) == []


def hold_lease(payload: dict, ctx) -> dict:
    """Rank 0 takes the writer lease of `root` and returns normally, still holding it."""
    from miles_lora_ckpt.core import lease

    if ctx.rank == 0:
        lease.acquire(Path(payload["root"]))
    return {"pid": os.getpid(), "holds": lease.holds(Path(payload["root"]))}


@pytest.mark.multirank
def test_a_harness_worker_releases_its_lease_when_it_exits_normally(tmp_path, prewarmed):
    """Workers leave through os._exit (no atexit): they release their leases themselves, spawned
    (sim.worker) and forked (sim.prewarmed) alike."""
    from jobs_paths import TESTS

    from miles_lora_ckpt_harness.sim.launch import check_all, run_workers

    spawned = check_all(
        run_workers(1, "test_lease:hold_lease", {"root": str(tmp_path)}, sys_path=[TESTS], megatron=False)
    )
    assert spawned[0]["holds"] and not (tmp_path / LEASE).exists()
    forked = check_all(prewarmed.run(1, "test_lease:hold_lease", {"root": str(tmp_path)}, sys_path=[TESTS]))
    assert forked[0]["holds"] and forked[0]["pid"] != spawned[0]["pid"] and not (tmp_path / LEASE).exists()


# ------------------------------------------------------------------ two writers that really overlap


def _mark(scratch: Path, event: str, rank: int) -> None:
    (scratch / f"{event}.r{rank}").touch()


def _await(scratch: Path, event: str, ranks: int, timeout_s: float) -> None:
    """Wait until ranks 0..ranks-1 of a run marked `event` (a file barrier between two runs)."""
    deadline = time.monotonic() + timeout_s
    while not all((scratch / f"{event}.r{r}").exists() for r in range(ranks)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {event} of {ranks} rank(s)")
        time.sleep(0.02)


def overlapping_writer(payload: dict, ctx) -> dict:
    """One of two whole training runs on one root that save at the same moments.

    Both runs train `steps` steps, then meet at a file barrier and both save, `saves` times. The
    `leader`'s save holds still right after its prepare (the lease taken, its staging directory
    made: a fault hook) until every rank of the other run finished its own save attempt, so the two
    saves overlap by construction; the other run's save starts only once the leader's is in flight.
    Afterwards the leader loads each generation it committed into a fresh run and compares every
    tensor, counter and scheduler field with the run at the moment it saved.
    """
    scratch, name, other = Path(payload["scratch"]), payload["name"], payload["other"]
    others, timeout_s, leader = payload["other_world"], payload["wait_s"], payload["leader"]
    consensus = Consensus.for_world(timeout_s=120)
    config = SimConfig.from_dict(payload["config"])
    current = {"save": None}
    if leader:
        real_point = faults.point

        def held_point(phase: str, rank: int) -> None:
            if phase == "after-prepare" and rank == 0 and current["save"] is not None:
                _mark(scratch, f"in-save-{name}-{current['save']}", 0)
                _await(scratch, f"done-{other}-{current['save']}", others, timeout_s)
            real_point(phase, rank)

        faults.point = held_point
    run = build_run(config)
    outcomes, at_save = [], {}
    for k in range(payload["saves"]):
        run_steps(run, k * payload["steps"], (k + 1) * payload["steps"])
        _mark(scratch, f"arrived-{name}-{k}", ctx.rank)
        _await(scratch, f"arrived-{other}-{k}", others, timeout_s)  # both runs at the same save point
        if not leader:
            _await(scratch, f"in-save-{other}-{k}", 1, timeout_s)  # the leader's save is in flight
        current["save"] = k
        iteration = (k + 1) * payload["steps"]
        staging_seen = sorted(n for n in os.listdir(payload["root"]) if n.startswith(".staging-"))
        try:
            path = save(run, payload["root"], iteration, consensus)
            at_save[path] = snapshot_digests(snapshot(run))
            outcomes.append({"saved": Path(path).name})
        except CheckpointError as exc:
            outcomes.append({"refused": str(exc), "phase": exc.phase, "staging_seen": staging_seen})
        current["save"] = None
        _mark(scratch, f"done-{name}-{k}", ctx.rank)
    _mark(scratch, f"finished-{name}", ctx.rank)
    _await(scratch, f"finished-{other}", others, timeout_s)
    loaded = {}
    if at_save:
        teardown(run)
        for path, digests in at_save.items():
            fresh = build_run(config)
            result = load(fresh, path, consensus)
            loaded[Path(path).name] = {
                "iteration": result.iteration,
                "first_difference": compare_digests(digests, snapshot_digests(snapshot(fresh))),
                "tensors": len(digests),
            }
            teardown(fresh)
    else:
        teardown(run)
    return {"pid": os.getpid(), "outcomes": outcomes, "loaded": loaded}


@pytest.mark.multirank
def test_two_training_runs_saving_at_the_same_moments_one_is_refused_and_the_others_generations_load_exactly(
    tmp_path, prewarmed
):
    """Two whole training runs (megatron's optimizer on CPU) on one root: the leader (1 rank, a
    spawned process) and the other run (2 ranks, forked) meet at a file barrier before each save
    and save together; the leader's save is held in flight until the other's attempt is over.
    The other run is refused by the lease on both ranks alike, naming the leader; the leader's
    generations verify and load bit-exact."""
    import threading

    from jobs_paths import TESTS

    from miles_lora_ckpt.tools.cli import main as cli
    from miles_lora_ckpt_harness.sim import launch
    from miles_lora_ckpt_harness.sim.model import SimConfig

    root, scratch = tmp_path / "root", tmp_path / "barrier"
    root.mkdir()
    scratch.mkdir()
    common = {"root": str(root), "scratch": str(scratch), "saves": 2, "steps": 2, "wait_s": 240}
    leader = {**common, "name": "leader", "other": "other", "other_world": 2, "leader": True}
    follower = {**common, "name": "other", "other": "leader", "other_world": 1, "leader": False}
    leader["config"] = SimConfig(world_size=1).to_dict()
    follower["config"] = SimConfig(world_size=2).to_dict()
    results = {}

    def run_other():
        results["other"] = prewarmed.run_as_spawned(
            2,
            "test_lease:overlapping_writer",
            follower,
            sys_path=[TESTS],
            env={"MILES_LORA_CKPT_RUN_ID": "run-other"},
            timeout_s=400,
        )

    thread = threading.Thread(target=run_other)
    thread.start()
    try:
        with launch.route_megatron_jobs(None):  # a second, independent process: spawned
            results["leader"] = launch.run_workers(
                1,
                "test_lease:overlapping_writer",
                leader,
                sys_path=[TESTS],
                env={"MILES_LORA_CKPT_RUN_ID": "run-leader"},
                timeout_s=400,
            )
    finally:
        thread.join()
    (won,) = launch.check_all(results["leader"])
    lost = launch.check_all(results["other"])
    # the other run: refused at every save, loudly and alike on both ranks, naming the leader,
    # while the leader's save was in flight (its staging directory was there)
    for outcomes in (r["outcomes"] for r in lost):
        assert [o.get("phase") for o in outcomes] == ["prepare", "prepare"], outcomes
        for outcome, first in zip(outcomes, lost[0]["outcomes"], strict=True):
            assert outcome["refused"] == first["refused"]
            assert "failed on rank(s) [0]" in outcome["refused"] and "has another writer" in outcome["refused"]
            assert f"pid {won['pid']} run run-leader" in outcome["refused"], outcome["refused"]
    assert all(len(o["staging_seen"]) == 1 for o in lost[0]["outcomes"]), lost[0]["outcomes"]
    # the leader: every save committed; each generation verifies and loads bit-exact
    saved = [o["saved"] for o in won["outcomes"]]
    assert len(saved) == 2 and sorted(p.name for p in root.iterdir() if p.name.startswith("gen-")) == sorted(saved)
    assert sorted(won["loaded"]) == sorted(saved)
    for name, check in won["loaded"].items():
        assert check["first_difference"] is None and check["tensors"] > 0, (name, check)
    assert [won["loaded"][name]["iteration"] for name in saved] == [2, 4]
    assert not [n for n in os.listdir(root) if n.startswith(".staging-")]
    assert not (root / LEASE).exists()  # the leader released it when it exited
    assert cli(["verify", str(root), "--all"]) == 0
