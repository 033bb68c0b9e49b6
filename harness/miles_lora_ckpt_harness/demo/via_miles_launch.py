"""How `demo --via miles` launches Miles and reads what a launch left (shared by the demo and its
resharding launch 2, `demo.via_miles_reshard`): the harness jobs, `launch` (one launch on fresh
ranks), `first_launch` (launch 1, a rank SIGKILLed while saving), `newest_rollout`, `last_line`."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles_lora_ckpt_harness.demo.via_miles import Scenario

JOB = "miles_lora_ckpt_harness.miles_standin.launch:launch_job"
WHEEL_JOB = "miles_lora_ckpt_harness.realmiles.launch:launch_job"
WHEEL_SHAPE = "miles-rl-0.0.2"  # the real wheel (realmiles), not a stand-in tree


def launch(scenario: Scenario, launcher, argv: list[str], crash: dict | None = None, env=None, extra=None):
    """One launch of `argv` on `scenario.world` fresh ranks; `extra` adds keys to a stand-in launch's
    payload (`miles_standin.launch`, e.g. `{"views": True}`)."""
    from miles_lora_ckpt_harness.miles_standin import shape_path

    started = time.monotonic()
    if scenario.wheel:
        from miles_lora_ckpt_harness.realmiles import standins

        job, payload, sys_path = WHEEL_JOB, {"argv": argv, "crash": crash, "tier": str(standins.tier_folder())}, []
        if crash and not scenario.plugin:  # stock 0.0.2 has no fault points: killed before the next save
            payload["crash"] = {**crash, "rollout": crash["rollout"] + 1, "phase": "between-saves"}
    else:
        job, payload, sys_path = JOB, {"argv": argv, "crash": crash}, [shape_path(scenario.args.miles_shape)]
        payload.update(extra or {})
    results = launcher.run(
        scenario.world,
        job,
        payload,
        env=scenario.env() if env is None else env,
        sys_path=sys_path,
        timeout_s=scenario.args.timeout,
        failure_grace_s=5.0,
    )
    return results, time.monotonic() - started


def first_launch(scenario: Scenario, launcher) -> None:
    """Launch 1: the launch command on a fresh save directory, rank `crash_rank` SIGKILLed at `--crash-at`
    while saving `crash_rollout` (none without `--crash-at`); prints each rank's outcome and what is on disk."""
    args = scenario.args
    shutil.rmtree(scenario.save, ignore_errors=True)
    crash = None
    if args.crash_at:
        crash = {"rollout": scenario.crash_rollout, "rank": scenario.crash_rank, "phase": args.crash_at}
    results, seconds = launch(scenario, launcher, scenario.command(), crash)
    where = (
        f"rank {scenario.crash_rank} SIGKILLs itself at {args.crash_at} while saving rollout {scenario.crash_rollout}"
    )
    if scenario.wheel and not scenario.plugin:  # stock 0.0.2 has no fault points (see launch)
        where = (
            f"rank {scenario.crash_rank} SIGKILLs itself after training rollout {scenario.crash_rollout + 1}, "
            "before its save (stock Miles has no fault points)"
        )
    print(f"launch 1: {where if crash else 'no crash injected'} ({seconds:.1f}s)")
    for result in results:
        if result.exitcode is not None and result.exitcode < 0:
            print(f"  rank {result.rank}: killed by signal {-result.exitcode}")
        elif not result.ok:
            print(f"  rank {result.rank}: failed: {last_line(result.error)}")
        elif result.result["failed"]:
            print(f"  rank {result.rank}: stopped: {last_line(result.result['failed'])}")
        else:
            print(f"  rank {result.rank}: trained rollouts {_span(result.result['rollouts'])}")
    print(f"  on disk: {', '.join(_committed(scenario)) or 'nothing committed'}")


def _committed(scenario: Scenario) -> list[str]:
    if scenario.plugin:
        from miles_lora_ckpt.core.verify import is_save_root, scan_root

        root = scenario.save / "lora"
        if not is_save_root(root):
            return []
        return [f"{e.name} ({e.state})" for e in reversed(scan_root(root)) if e.state != "deleting"]
    return sorted(p.name + "/adapter" for p in scenario.save.glob("iter_*") if (p / "adapter").exists())


def newest_rollout(scenario: Scenario) -> int | None:
    """The rollout of the newest committed generation (with the plugin) or of the newest stock
    `iter_*/adapter` (without it); None where nothing was saved."""
    if scenario.plugin:
        from miles_lora_ckpt.core.verify import is_save_root, scan_root

        root = scenario.save / "lora"
        entries = [e for e in scan_root(root) if e.state == "committed"] if is_save_root(root) else []
        return entries[0].iteration if entries else None
    adapter = newest_stock_adapter(scenario)
    return int(Path(adapter).parent.name.removeprefix("iter_")) if adapter else None


def newest_stock_adapter(scenario: Scenario) -> str | None:
    """The newest stock Miles `iter_*/adapter` directory under the save directory, or None."""
    found = sorted(p for p in scenario.save.glob("iter_*") if (p / "adapter").exists())
    return str(found[-1] / "adapter") if found else None


def _span(rollouts: list[int]) -> str:
    return f"{rollouts[0]}..{rollouts[-1]}" if rollouts else "none"


def last_line(text: str | None) -> str:
    """The exception a traceback ends with, on one line (multi-line messages joined), shortened."""
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    start = max((i for i, line in enumerate(lines) if line[:1].isalpha() and ": " in line), default=len(lines) - 1)
    summary = re.sub(r"^[\w.]+\.(\w+): ", r"\1: ", " ".join(line.strip() for line in lines[start:]))
    return summary if len(summary) <= 240 else summary[:237] + "..."
