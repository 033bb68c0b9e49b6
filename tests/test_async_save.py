"""The asynchronous single-LoRA save (`savers.single_lora.async_save`) through the real megatron-core
DistributedOptimizer on CPU over gloo: one spawned job (`async_saves`, in this module) runs every case.

A generation saved asynchronously while training went on holds the state at the snapshot, bit for
bit (every tensor, counter and scheduler field compared with the uninterrupted run); a second save
waits for the first to commit; a failure in one rank's background write raises the same error on
every rank and leaves the previous generation the newest; a SIGKILL during a background write
leaves the previous generation loadable.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from jobs_paths import TESTS
from single_lora_steps import Args, load, run_steps

from miles_lora_ckpt.core import faults
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import TRACKER
from miles_lora_ckpt.core.protocol import open_generation
from miles_lora_ckpt.savers.single_lora.async_save import AsyncSaver, save_lora_checkpoint_async
from miles_lora_ckpt.tools.cli import main as cli
from miles_lora_ckpt_harness.sim.launch import run_workers
from miles_lora_ckpt_harness.sim.model import SimConfig
from miles_lora_ckpt_harness.sim.snapshot import compare_digests, snapshot, snapshot_digests
from miles_lora_ckpt_harness.sim.train import build_run, teardown

# The background write runs the same phases (plan_save, write_planned_save) as the synchronous save,
# which test_single_lora and test_miles_resume run on both megatron tiers; the asynchronous cases run
# on tier 1 (checked once on 0.19.2 by hand: the same results).
TIER1_ONLY = pytest.mark.skipif(
    os.environ.get("MILES_LORA_CKPT_TIER") == "mcore-0.19",
    reason="the asynchronous save's phases are the synchronous save's, run on both tiers elsewhere",
)


def test_save_async_key_and_its_startup_refusals():
    from miles_lora_ckpt.integration.config import load_config
    from miles_lora_ckpt.integration.startup import _async_save_problems

    assert load_config({})["save.async"] is False  # opt-in
    on = load_config({"MILES_LORA_CKPT_ASYNC_SAVE": "1"})
    assert on["save.async"] is True
    assert _async_save_problems(SimpleNamespace(), on) == []
    assert _async_save_problems(SimpleNamespace(multi_lora_n_adapters=2), load_config({})) == []
    with_peft = load_config({"MILES_LORA_CKPT_ASYNC_SAVE": "1", "MILES_LORA_CKPT_PEFT_EXPORT": "1"})
    assert "export.peft" in _async_save_problems(SimpleNamespace(), with_peft)[0]
    assert "multi-lora" in _async_save_problems(SimpleNamespace(multi_lora_n_adapters=2), on)[0]


@pytest.mark.parametrize("extra", [["--slots", "2"], ["--export-peft"]])
def test_demo_async_save_refuses_what_it_does_not_cover(extra, capsys):
    assert cli(["demo", "--async-save", *extra]) == 2
    assert "--async-save covers single-LoRA saves without a PEFT export" in capsys.readouterr().err


# ---- rank jobs: run in the workers as "test_async_save:async_saves" (the tests directory on their sys.path)
#
# Worker job for the asynchronous single-LoRA save (real megatron DistributedOptimizer on CPU, gloo).
#
# One job, many cases, in order (each rank writes its report to the scratch folder before the last
# case, in which rank 1 SIGKILLs itself):
#
# 1. overlap: save asynchronously at step 2 while the background write is held at `before-write`
#    (a gate on the protocol's fault point), train steps 2..4 meanwhile, then save at step 4: the
#    second save must wait for the first to commit; step 5 trains while the second is written;
# 2. fault: rank 1 raises mid-write in the background: `wait()` raises on every rank; an unseen
#    failure is raised by the next save instead;
# 3. resume: a fresh run loads the step-2 generation (must equal the state at the snapshot, bit for
#    bit, and continue to the step-4 state), another loads the root (the step-4 generation: the
#    failed saves left it the newest);
# 4. kill: rank 1 SIGKILLs itself during a background write (`save_lora_checkpoint_async`, the
#    process-wide saver); rank 0's `wait()` raises.


def _gate_background_writes() -> threading.Event:
    """Background threads stop at the protocol's `before-write` point until the event is set."""
    gate, original = threading.Event(), faults.point

    def point(phase: str, rank: int) -> None:
        if phase == "before-write" and threading.current_thread() is not threading.main_thread():
            if not gate.wait(120):
                raise TimeoutError("the test's write gate was never opened")
        original(phase, rank)

    faults.point = point
    return gate


def _save(saver: AsyncSaver, run, root, iteration: int):
    return saver.save(
        run.model, Args(), root, optimizer=run.optimizer, opt_param_scheduler=run.scheduler, iteration=iteration
    )


def _error(fn) -> str | None:
    try:
        fn()
    except CheckpointError as exc:
        return str(exc)
    return None


def async_saves(payload: dict, ctx) -> dict:
    config = SimConfig.from_dict(payload["config"])
    root = Path(payload["root"])
    consensus = Consensus.for_world(timeout_s=60)  # the loads' (and nothing else's)
    saver = AsyncSaver(timeout_s=payload["timeout_s"])
    gate = _gate_background_writes()
    out: dict = {}

    # 1. overlap: the write is held back while training changes every tensor the save holds
    run = build_run(config)
    run_steps(run, 0, 2)
    at2 = snapshot_digests(snapshot(run))
    first = _save(saver, run, root, 2)
    losses = run_steps(run, 2, 4)
    at4 = snapshot_digests(snapshot(run))
    out["first_done_after_training"] = first.done()  # False: the gate holds it
    opener = threading.Timer(0.5, gate.set)
    opener.start()
    second = _save(saver, run, root, 4)  # waits for the first to commit
    out["first_done_when_second_returned"] = first.done()
    run_steps(run, 4, 5)  # training collectives on the main thread while the second save's rounds run
    out["first"], out["second"] = first.wait(), second.wait()
    out["control_state_changed"] = compare_digests(at2, at4)  # not None: the comparison can fail

    # 2. fault in the background write on rank 1, seen at wait(); then unseen, raised by the next save
    if ctx.rank == 1:
        faults.arm("mid-write", 1, "raise")
    third = _save(saver, run, root, 5)
    out["fault_at_wait"] = _error(third.wait)
    out["saver_wait_after_seen"] = saver.wait()  # None: the error was already raised to the caller
    if ctx.rank == 1:
        faults.arm("mid-write", 1, "raise")
    _save(saver, run, root, 5)
    out["fault_at_next_save"] = _error(lambda: _save(saver, run, root, 5))
    out["saver_usable_after"] = saver.wait()  # nothing pending: the raising save started nothing
    teardown(run)

    # 3. resume: the step-2 generation is the state at the snapshot; the root's newest is step 4
    resumed = build_run(config)
    result = load(resumed, out["first"], consensus)
    out["resumed_iteration"] = result.iteration
    out["at_snapshot"] = compare_digests(at2, snapshot_digests(snapshot(resumed)))
    out["losses_match"] = run_steps(resumed, 2, 4) == losses
    out["continued"] = compare_digests(at4, snapshot_digests(snapshot(resumed)))
    teardown(resumed)
    latest = build_run(config)
    run_steps(latest, 0, 1)
    result = load(latest, root, consensus)
    out["latest_path"], out["latest_iteration"] = result.path, result.iteration
    out["latest"] = compare_digests(at4, snapshot_digests(snapshot(latest)))
    (ctx.scratch_dir / f"report{ctx.rank}.json").write_text(json.dumps(out))

    # 4. SIGKILL of rank 1 during the background write (through the process-wide saver)
    run_steps(latest, 4, 5)
    if ctx.rank == 1:
        faults.arm("mid-write", 1, "kill")
    pending = save_lora_checkpoint_async(
        latest.model, Args(), root, optimizer=latest.optimizer, opt_param_scheduler=latest.scheduler, iteration=5
    )
    out["killed_peer"] = _error(pending.wait)
    return out


@TIER1_ONLY
@pytest.mark.megatron
@pytest.mark.multirank
def test_async_save_snapshot_wait_fault_and_kill(tmp_path):
    root = tmp_path / "root"
    # with LoRA dropout: the RNG states are captured at the snapshot too (the held write would
    # otherwise record them after training went on, and the resume below would not continue identically)
    config = SimConfig(world_size=2, dtype="bf16", adapters="mixed", lora_dropout=0.1).to_dict()
    results = run_workers(
        2,
        "test_async_save:async_saves",
        {"config": config, "root": str(root), "timeout_s": 30},
        sys_path=[TESTS],
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


@TIER1_ONLY
@pytest.mark.megatron
@pytest.mark.multirank
def test_miles_save_async_killed_mid_write_resumes_bit_exact(prewarmed, tmp_path):
    """`save.async = true` through the Miles stand-in: rank 1 is SIGKILLed in the background write of
    rollout 2, so rollout 1's generation (written while rollout 2 trained) is the newest; the same
    command resumes from it bit-exact, and the user's post-save hook gets committed generations."""
    from test_miles_resume import ROLLOUTS, Run, _check_post_save_hook, assert_resumed_exactly, ok

    run = Run(prewarmed, tmp_path, "lora-package-2026-09", 2, "mixed", "bf16")
    run.config.write_text("[consensus]\ntimeout_s = 60\n[save]\nasync = true\n")
    hooks = ["--custom-megatron-post-save-hook-path", "miles_hooks.record_post_save"]
    reference = run.reference()
    crashed = run.launch(run.command(*hooks), crash={"rollout": 2, "rank": 1, "phase": "mid-write"})
    assert crashed[1].exitcode == -9
    assert not crashed[0].ok or crashed[0].result["failed"], "the survivor must stop with an error"
    resumed = ok(run.launch(run.command(*hooks)))
    assert_resumed_exactly(reference, crashed, resumed, resumed_at=2)
    assert all(r["plugin"]["async_saves"] for r in resumed)  # the saves went through the AsyncSaver
    assert resumed[0]["plugin"]["saved"].keys() == {str(r) for r in range(2, ROLLOUTS)}
    _check_post_save_hook(run)
