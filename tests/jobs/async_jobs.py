"""Worker job for the asynchronous single-LoRA save (real megatron DistributedOptimizer on CPU, gloo).

One job, many cases, in order (each rank writes its report to the scratch folder before the last
case, in which rank 1 SIGKILLs itself):

1. overlap: save asynchronously at step 2 while the background write is held at `before-write`
   (a gate on the protocol's fault point), train steps 2..4 meanwhile, then save at step 4: the
   second save must wait for the first to commit; step 5 trains while the second is written;
2. fault: rank 1 raises mid-write in the background: `wait()` raises on every rank; an unseen
   failure is raised by the next save instead;
3. resume: a fresh run loads the step-2 generation (must equal the state at the snapshot, bit for
   bit, and continue to the step-4 state), another loads the root (the step-4 generation: the
   failed saves left it the newest);
4. kill: rank 1 SIGKILLs itself during a background write (`save_lora_checkpoint_async`, the
   process-wide saver); rank 0's `wait()` raises.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from lora_jobs import Args, load, run_steps

from miles_lora_ckpt.core import faults
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.savers.single_lora.async_save import AsyncSaver, save_lora_checkpoint_async
from miles_lora_ckpt_harness.sim.model import SimConfig
from miles_lora_ckpt_harness.sim.snapshot import compare_digests, snapshot, snapshot_digests
from miles_lora_ckpt_harness.sim.train import build_run, teardown


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
