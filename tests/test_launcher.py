"""Tests of the job launcher itself (`sim.launch.run_workers`), with every rank a fresh interpreter.

The rest of the suite forks its megatron jobs from a pre-warmed launcher (tests/conftest.py); these
tests turn that off, so the spawn path that the demo and the bench use is the one under test. They
do not depend on the megatron version, so they run on tier 1 only (no `megatron` marker).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from jobs_paths import TESTS

from miles_lora_ckpt_harness.sim import check_all, cpu_intercepts, launch, run_workers

pytestmark = [pytest.mark.multirank]


REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def every_rank_spawned():
    with launch.route_megatron_jobs(None):
        yield


IMPORT_CHECK = """
import os, sys, torch
from miles_lora_ckpt_harness.sim import cpu_intercepts as ci
assert not ci.active()
assert not [m for m in sys.modules if m.startswith("megatron")]
assert torch._C._len_torch_function_stack() == 0
assert torch.cuda.current_device.__module__ == "torch.cuda"
try:
    ci.install()
except RuntimeError as exc:
    assert ci.WORKER_ENV in str(exc)
else:
    raise AssertionError("install() ran outside a harness worker")
assert not ci.active()
"""


def test_nothing_is_intercepted_at_import_or_outside_workers():
    env = {k: v for k, v in os.environ.items() if k != "MILES_LORA_CKPT_SIM_WORKER"}
    done = subprocess.run([sys.executable, "-c", IMPORT_CHECK], env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ------------------------------------------------------------------------------ launcher behaviour


_KEPT: list = []  # what a job keeps alive until its process ends, as a module global would


def launcher_job(payload: dict, ctx) -> dict:
    """Per-rank behaviour chosen by the payload: return, raise, SIGKILL itself, or hang."""
    action = payload["actions"][ctx.rank]
    if action == "raise":
        raise ValueError(f"boom from rank {ctx.rank}")
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "hang":
        time.sleep(3600)
    if action == "leave-a-child":  # as megatron's dist_checkpointing does: a Manager kept in a global
        import multiprocessing

        _KEPT.append(multiprocessing.get_context("spawn").Manager())
        return {"child_pid": _KEPT[-1]._process.pid}
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "payload": payload,
        "scratch_is_dir": ctx.scratch_dir.is_dir(),
        "env_mark": os.environ.get("SIM_TEST_MARK"),
        "torch_threads": torch.get_num_threads(),
        "dist_world_size": torch.distributed.get_world_size(),
        "intercepts_active": cpu_intercepts.active(),
    }


def test_launcher_reports_results_errors_signals_and_grace_kills():
    payload = {"actions": ["return", "sigkill", "raise", "hang"]}
    results = run_workers(
        4,
        "test_launcher:launcher_job",
        payload,
        sys_path=[TESTS],
        env={"SIM_TEST_MARK": "marked"},
        failure_grace_s=5,
        timeout_s=120,
    )
    ok, killed, raised, hung = results
    assert ok.ok and ok.exitcode == 0 and ok.error is None
    assert ok.result == {
        "rank": 0,
        "world_size": 4,
        "payload": payload,
        "scratch_is_dir": True,
        "env_mark": "marked",
        "torch_threads": 1,
        "dist_world_size": 4,
        "intercepts_active": True,
    }
    assert killed.exitcode == -signal.SIGKILL and killed.result is None and "SIGKILL" in killed.error
    assert raised.exitcode == 1 and "ValueError: boom from rank 2" in raised.error
    assert hung.exitcode == -signal.SIGKILL and not hung.timed_out and "after rank" in hung.error
    with pytest.raises(RuntimeError) as failure:
        check_all(results)
    assert "3 of 4 ranks failed" in str(failure.value) and "boom from rank 2" in str(failure.value)


def test_launcher_kills_every_rank_at_timeout():
    start = time.monotonic()
    results = run_workers(2, "test_launcher:launcher_job", {"actions": ["hang", "hang"]}, sys_path=[TESTS], timeout_s=6)
    assert time.monotonic() - start < 20
    for result in results:
        assert result.timed_out and result.exitcode == -signal.SIGKILL
        assert result.error.startswith("timed out")


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for init to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("route", ["spawned", "forked"])
def test_a_child_process_a_rank_left_running_is_stopped_with_the_rank(route, prewarmed):
    """megatron's dist_checkpointing starts a multiprocessing Manager and never stops it; a rank
    leaves by os._exit, so without the launcher's stop the Manager outlived the test run (found as
    orphans after `make test`, in the native warm-start job's dist_checkpointing.save)."""
    with launch.route_megatron_jobs(prewarmed if route == "forked" else None):
        (result,) = check_all(
            run_workers(1, "test_launcher:launcher_job", {"actions": ["leave-a-child"]}, sys_path=[TESTS])
        )
    pid = result["child_pid"]
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"the rank's multiprocessing child {pid} outlived it"


def import_job(payload: dict, ctx) -> dict:
    """Import the payload's module by name (found on the rank's sys.path) and return its VALUE."""
    import importlib

    module = importlib.import_module(payload["module"])
    return {"module": payload["module"], "value": module.VALUE}


def test_a_routed_job_sees_what_a_spawned_rank_would(prewarmed, monkeypatch, tmp_path):
    """The suite's fork route: the caller's environment now (set, changed, removed), new PYTHONPATH
    entries first on sys.path, and the same results, errors and signals as a spawned rank."""
    prewarmed.start()  # its environment is taken here: what follows changes the caller's only
    monkeypatch.setenv("SIM_TEST_MARK", "set-after-the-server-started")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    (tmp_path / "late_module.py").write_text("VALUE = 7\n")
    payload = {"actions": ["return", "sigkill", "raise"]}
    with launch.route_megatron_jobs(prewarmed):
        results = run_workers(3, "test_launcher:launcher_job", payload, sys_path=[TESTS], failure_grace_s=5)
        late = check_all(run_workers(1, "test_launcher:import_job", {"module": "late_module"}, sys_path=[TESTS]))
    ok, killed, raised = results
    assert ok.ok and ok.result["env_mark"] == "set-after-the-server-started"
    assert ok.result["intercepts_active"] is True and ok.result["torch_threads"] == 1
    assert ok.result["dist_world_size"] == 3 and ok.result["scratch_is_dir"] is True
    assert killed.exitcode == -signal.SIGKILL and "SIGKILL" in killed.error
    assert raised.exitcode == 1 and "ValueError: boom from rank 2" in raised.error
    assert late == [{"module": "late_module", "value": 7}]
