"""One rank of a harness job: ``python -m miles_lora_ckpt_harness.sim.worker SPEC.json`` (started by launch.py).

Joins the gloo default group, limits torch to one thread, installs the CPU intercepts, then calls
``function(payload, ctx)`` and writes ``{"result": ...}`` or ``{"error": traceback}`` as JSON.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path


@dataclass(frozen=True)
class WorkerContext:
    """What a job function learns about its rank; ``scratch_dir`` is shared by every rank."""

    rank: int
    world_size: int
    scratch_dir: Path


def resolve_target(target: str):
    """Import ``"module:function"`` and return the function."""
    module_name, _, function_name = target.partition(":")
    if not function_name:
        raise ValueError(f"target must look like 'module:function', got {target!r}")
    return getattr(importlib.import_module(module_name), function_name)


def _run(spec: dict) -> object:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if spec.get("megatron", True):
        from miles_lora_ckpt_harness.sim import cpu_intercepts

        cpu_intercepts.install()
    dist.init_process_group(
        "gloo",
        rank=spec["rank"],
        world_size=spec["world_size"],
        timeout=timedelta(seconds=spec["timeout_s"]),
    )
    try:
        function = resolve_target(spec["target"])
        payload = json.loads(Path(spec["payload_path"]).read_text())
        ctx = WorkerContext(spec["rank"], spec["world_size"], Path(spec["scratch_dir"]))
        return function(payload, ctx)
    finally:
        dist.destroy_process_group()


def _write_report(path: str, report: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, path)


def main(spec_path: str) -> int:
    """Run the job function of one rank; return the process exit code."""
    spec = json.loads(Path(spec_path).read_text())
    for entry in reversed(spec["sys_path"]):
        sys.path.insert(0, entry)
    try:
        report, code = {"result": _run(spec)}, 0
    except BaseException:  # noqa: B036  (a failing rank must always leave its traceback)
        report, code = {"error": traceback.format_exc()}, 1
    try:
        _write_report(spec["result_path"], report)
    except (TypeError, ValueError):
        _write_report(spec["result_path"], {"error": "result is not JSON-able:\n" + traceback.format_exc()})
        code = 1
    return code


def release_leases() -> None:
    """Release the writer leases this rank still holds: a rank leaves through `os._exit`, which runs
    no atexit handler, so without this its lease would stay on disk until judged stale."""
    from miles_lora_ckpt.core import lease

    try:
        lease.release_all()
    except Exception:  # noqa: BLE001 - the rank's own report is written already; never mask it
        traceback.print_exc()


def stop_child_processes(timeout_s: float = 10.0) -> list[int]:
    """Stop the `multiprocessing` children this rank started and left running; return their pids.

    megatron-core's `dist_checkpointing` starts a `multiprocessing.Manager` server in the saving
    process and never stops it. A rank leaves through `os._exit`, which runs no finalizer, so that
    server would outlive the rank, the test run and the demo. Each child is asked to stop (SIGTERM),
    then killed if it has not stopped within `timeout_s`."""
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout_s)
        if child.is_alive():
            child.kill()
            child.join()
    return [child.pid for child in children]


if __name__ == "__main__":
    exit_code = main(sys.argv[1])
    release_leases()
    stop_child_processes()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # skip interpreter teardown: gloo threads can stall a normal exit
