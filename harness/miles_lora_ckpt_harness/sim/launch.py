"""Start a job of real OS worker processes joined by a gloo process group, and collect their results.

The parent side imports only the standard library: torch and megatron are imported in the workers.
Payload and results travel as JSON files (never pickle); each rank's stdout and stderr go to one
log file whose tail comes back in its ``RankResult``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# The folders holding the harness and the plugin packages: appended to a worker's PYTHONPATH so that it
# imports the code the launching process runs, from a source tree without an install too. find_spec, not
# an import: the launching side stays light.
_PACKAGE_ROOTS = tuple(
    dict.fromkeys(
        [
            str(Path(__file__).resolve().parents[2]),
            str(Path(importlib.util.find_spec("miles_lora_ckpt").origin).resolve().parents[1]),
        ]
    )
)
_TAIL_CHARS = 6000
_POLL_S = 0.05
_router = None  # see route_megatron_jobs


@dataclass
class RankResult:
    """What one rank of a job left behind.

    ``exitcode`` is negative when the rank died by a signal (``-9`` for SIGKILL, also when the
    launcher killed it). ``error`` is the worker's traceback text, or a launcher note: the rank left
    no result file, it was killed at the timeout (``timed_out``), or it was killed because another
    rank had failed and the grace period ran out. ``stderr_tail`` holds the end of the rank's interleaved stdout and stderr.
    """

    rank: int
    exitcode: int | None
    result: dict | None
    error: str | None
    stderr_tail: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """True when the rank exited 0 and reported no error."""
        return self.exitcode == 0 and self.error is None


def run_workers(
    world_size: int,
    target: str,
    payload: dict,
    *,
    timeout_s: float = 300,
    sys_path: tuple[str, ...] | list[str] = (),
    env: dict[str, str] | None = None,
    scratch_dir: str | os.PathLike | None = None,
    failure_grace_s: float = 30.0,
    megatron: bool = True,
) -> list[RankResult]:
    """Run ``target`` ("module:function") as ``function(payload, ctx)`` on ``world_size`` ranks.

    Each rank is a fresh ``python -m miles_lora_ckpt_harness.sim.worker`` process with RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT set; the worker joins a gloo group, installs the CPU intercepts and
    calls the function. ``sys_path`` entries are prepended to the worker's ``sys.path``; ``env``
    adds environment variables. ``ctx.scratch_dir`` is ``scratch_dir`` (shared by all ranks), or a
    temporary folder removed after the job. Once a rank fails, the others get ``failure_grace_s``
    to finish; at ``timeout_s`` every rank still running is killed and marked ``timed_out``.
    With ``megatron=False`` the worker neither imports megatron nor installs the intercepts (jobs
    that only need gloo and torch start in about a second).

    While a router is set (`route_megatron_jobs`), megatron jobs are forked from it instead.
    """
    if megatron and _router is not None:
        return _router.run_as_spawned(
            world_size,
            target,
            payload,
            env=env,
            sys_path=sys_path,
            timeout_s=timeout_s,
            failure_grace_s=failure_grace_s,
            scratch_dir=scratch_dir,
        )
    job_dir = Path(tempfile.mkdtemp(prefix="miles-sim-job-"))
    try:
        scratch = Path(scratch_dir) if scratch_dir is not None else job_dir / "scratch"
        scratch.mkdir(parents=True, exist_ok=True)
        (job_dir / "payload.json").write_text(json.dumps(payload))
        port = _free_port()
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(world_size):
                procs.append(
                    _start_rank(job_dir, rank, world_size, target, port, scratch, sys_path, env, timeout_s, megatron)
                )
            killed = _wait_all(procs, timeout_s, failure_grace_s)
        except BaseException:  # e.g. Ctrl-C in pytest: leave no orphaned worker behind
            for proc in procs:
                _kill_group(proc)
            raise
        return [_collect(job_dir, rank, proc, killed.get(rank)) for rank, proc in enumerate(procs)]
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)


@contextlib.contextmanager
def route_megatron_jobs(router) -> Iterator[None]:
    """Within the block, `run_workers` forks megatron jobs from `router` (None: spawn every rank).

    `router` is a `sim.prewarmed.PrewarmedLauncher`: torch and megatron are imported once, and each
    rank is a forked child running the same worker code with the caller's current environment. The
    test suite routes its jobs this way (tests/conftest.py), so that each launch costs a fork
    instead of seconds of imports per rank; tools (demo, bench) always spawn.
    """
    global _router
    previous, _router = _router, router
    try:
        yield
    finally:
        _router = previous


def check_all(results: list[RankResult]) -> list[dict]:
    """Return every rank's result, or raise ``RuntimeError`` with the error text of each failed rank."""
    failed = [r for r in results if not r.ok]
    if not failed:
        return [r.result for r in results]
    reports = [
        f"--- rank {r.rank}: exitcode={r.exitcode} timed_out={r.timed_out}\n{r.error}\n"
        f"--- rank {r.rank} output tail:\n{r.stderr_tail}"
        for r in failed
    ]
    raise RuntimeError(f"{len(failed)} of {len(results)} ranks failed\n" + "\n".join(reports))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_env(rank: int, world_size: int, port: int, extra: dict[str, str] | None) -> dict[str, str]:
    child = dict(os.environ)
    child.update(extra or {})
    # Appended, not prepended: a megatron tier put first on PYTHONPATH must stay first.
    paths = [p for p in child.get("PYTHONPATH", "").split(os.pathsep) if p] + list(_PACKAGE_ROOTS)
    child.update(
        PYTHONPATH=os.pathsep.join(paths),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        MILES_LORA_CKPT_SIM_WORKER="1",  # cpu_intercepts.WORKER_ENV; install() refuses without it
    )
    return child


def _start_rank(job_dir, rank, world_size, target, port, scratch, sys_path, env, timeout_s, megatron):
    spec = {
        "rank": rank,
        "world_size": world_size,
        "target": target,
        "payload_path": str(job_dir / "payload.json"),
        "result_path": str(job_dir / f"result-{rank}.json"),
        "scratch_dir": str(scratch),
        "sys_path": [str(p) for p in sys_path],
        "timeout_s": timeout_s,
        "megatron": megatron,
    }
    spec_path = job_dir / f"spec-{rank}.json"
    spec_path.write_text(json.dumps(spec))
    with open(job_dir / f"rank-{rank}.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "miles_lora_ckpt_harness.sim.worker", str(spec_path)],
            env=_worker_env(rank, world_size, port, env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so a kill reaches its children too
        )


def _wait_all(procs: list[subprocess.Popen], timeout_s: float, failure_grace_s: float) -> dict[int, str]:
    """Wait for every rank; return the ranks the launcher had to kill, with the reason."""
    deadline = time.monotonic() + timeout_s
    reason = f"timed out: killed by the launcher after {timeout_s} s"
    grace_started = False
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return {}
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed and not grace_started and time.monotonic() + failure_grace_s < deadline:
            deadline = time.monotonic() + failure_grace_s
            reason = f"killed by the launcher {failure_grace_s} s after rank {failed[0]} failed"
        grace_started = grace_started or bool(failed)
        time.sleep(_POLL_S)
    killed = {rank: reason for rank, p in enumerate(procs) if p.poll() is None}
    for rank in killed:
        _kill_group(procs[rank])
    return killed


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _collect(job_dir: Path, rank: int, proc: subprocess.Popen, kill_reason: str | None) -> RankResult:
    tail = _tail(job_dir / f"rank-{rank}.log")
    report = _read_json(job_dir / f"result-{rank}.json")
    error = report.get("error") if report else None
    if kill_reason:
        error = kill_reason + (f"\n{error}" if error else "")
    elif report is None:
        error = _no_result_note(proc.returncode)
    return RankResult(
        rank=rank,
        exitcode=proc.returncode,
        result=report.get("result") if report else None,
        error=error,
        stderr_tail=tail,
        timed_out=bool(kill_reason) and kill_reason.startswith("timed out"),
    )


def _no_result_note(exitcode: int) -> str:
    if exitcode < 0:
        return f"rank died by signal {signal.Signals(-exitcode).name} and left no result"
    return f"rank exited with code {exitcode} and left no result"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _tail(path: Path) -> str:
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    return text[-_TAIL_CHARS:]
