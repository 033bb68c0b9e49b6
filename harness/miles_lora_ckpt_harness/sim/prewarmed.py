"""Launch harness jobs as processes forked from one pre-warmed launcher (torch and megatron imported once).

`launch.run_workers` starts every rank as a fresh interpreter, which costs seconds of imports per
rank on a small machine. A test or demo that launches the same training many times (run, SIGKILL,
relaunch with the identical command) uses `PrewarmedLauncher`: one server process imports torch and
megatron-core and installs the CPU intercepts, then, for every launch, forks one child per rank. A
child shares nothing with its siblings or with earlier launches but those imports. It applies the
launch's environment and sys.path, joins a new gloo group and runs `function(payload, ctx)` exactly
as a `run_workers` rank does, with the same context and report. A SIGKILL of a child is a real
SIGKILL. The server never imports Miles or runs plugin code, so `import miles` and the init hook run
afresh in every launch.

    with PrewarmedLauncher() as launcher:
        results = launcher.run(2, "module:function", payload, sys_path=[...], env={...})
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from miles_lora_ckpt_harness.sim.launch import _PACKAGE_ROOTS, _TAIL_CHARS, RankResult, _free_port, _read_json

_POLL_S = 0.02
_DONE = "@@prewarmed-done@@"
_READY = "@@prewarmed-ready@@"


class PrewarmedLauncher:
    """The caller's side: starts the server on first use, sends launches, returns `RankResult`s."""

    def __init__(self, *, env: dict[str, str] | None = None, start_timeout_s: float = 300.0):
        self._env = env or {}
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="miles-sim-prewarmed-"))
        self._count = 0
        self._buffer = b""

    def __enter__(self) -> PrewarmedLauncher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if self._proc is not None:
            return
        env = dict(os.environ)
        env.update(self._env)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + list(_PACKAGE_ROOTS)
        env.update(
            PYTHONPATH=os.pathsep.join(paths),
            OMP_NUM_THREADS="1",
            CUDA_VISIBLE_DEVICES="",
            MILES_LORA_CKPT_SIM_WORKER="1",
        )
        self._started_environ = dict(os.environ)
        self._server_paths = paths
        self._log = open(self._dir / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "miles_lora_ckpt_harness.sim.prewarmed"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            start_new_session=True,
        )
        self._wait_for(_READY, self._start_timeout_s)

    def run(
        self,
        world_size: int,
        target: str,
        payload: dict,
        *,
        env: dict[str, str] | None = None,
        sys_path: tuple[str, ...] | list[str] = (),
        timeout_s: float = 300.0,
        failure_grace_s: float = 10.0,
        scratch_dir: str | os.PathLike | None = None,
        unset: list[str] | tuple[str, ...] = (),
    ) -> list[RankResult]:
        """Like `launch.run_workers`: run `target` as `function(payload, ctx)` on `world_size` forked ranks.

        The children get the server's environment, then `env`, minus the variables named in `unset`.
        """
        self.start()
        self._count += 1
        job_dir = self._dir / f"launch-{self._count}"
        job_dir.mkdir()
        scratch = Path(scratch_dir) if scratch_dir is not None else job_dir / "scratch"
        scratch.mkdir(parents=True, exist_ok=True)
        (job_dir / "payload.json").write_text(json.dumps(payload))
        request = {
            "id": self._count,
            "job_dir": str(job_dir),
            "world_size": world_size,
            "target": target,
            "env": env or {},
            "unset": list(unset),
            "sys_path": [str(p) for p in sys_path],
            "scratch_dir": str(scratch),
            "timeout_s": timeout_s,
            "failure_grace_s": failure_grace_s,
        }
        self._proc.stdin.write((json.dumps(request) + "\n").encode())
        self._proc.stdin.flush()
        self._wait_for(f"{_DONE} {self._count}", timeout_s + failure_grace_s + 60)
        reports = json.loads((job_dir / "results.json").read_text())
        shutil.rmtree(job_dir, ignore_errors=True)
        return [RankResult(**report) for report in reports]

    def run_as_spawned(
        self,
        world_size: int,
        target: str,
        payload: dict,
        *,
        env: dict[str, str] | None = None,
        sys_path: tuple[str, ...] | list[str] = (),
        timeout_s: float = 300.0,
        failure_grace_s: float = 30.0,
        scratch_dir: str | os.PathLike | None = None,
    ) -> list[RankResult]:
        """`run`, with the environment a `launch.run_workers` rank would get now.

        The server's environment is the one it started with; a spawned rank would see the caller's
        current one. So every variable set or changed since (and `env`) is applied in the children,
        every one removed since is removed there, and PYTHONPATH entries added since come first on
        their `sys.path`, as they would in a fresh interpreter.
        """
        self.start()
        now = dict(os.environ)
        now.update(env or {})
        changed = {k: v for k, v in now.items() if self._started_environ.get(k) != v and k != "PYTHONPATH"}
        removed = [k for k in self._started_environ if k not in now]
        added_paths = [p for p in now.get("PYTHONPATH", "").split(os.pathsep) if p and p not in self._server_paths]
        return self.run(
            world_size,
            target,
            payload,
            env=changed,
            sys_path=[*added_paths, *sys_path],
            timeout_s=timeout_s,
            failure_grace_s=failure_grace_s,
            scratch_dir=scratch_dir,
            unset=removed,
        )

    def close(self) -> None:
        if self._proc is not None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self._proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._proc.wait()
            self._log.close()
            self._proc = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def _wait_for(self, line: str, timeout_s: float) -> None:
        """Read the server's stdout until `line` (other lines, e.g. import chatter, are skipped)."""
        deadline = time.monotonic() + timeout_s
        fd = self._proc.stdout.fileno()
        while time.monotonic() < deadline:
            while b"\n" in self._buffer:
                got, self._buffer = self._buffer.split(b"\n", 1)
                if got.decode(errors="replace").strip() == line:
                    return
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break  # the server exited
                self._buffer += chunk
        self.close_on_failure()
        raise RuntimeError(f"pre-warmed launcher did not answer {line!r}; its log:\n{self._server_log()}")

    def close_on_failure(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait()

    def _server_log(self) -> str:
        try:
            return (self._dir / "server.log").read_bytes().decode(errors="replace")[-_TAIL_CHARS:]
        except FileNotFoundError:
            return ""


# =========================================================================== server side


def _warm() -> None:
    import torch

    torch.set_num_threads(1)
    from miles_lora_ckpt_harness.sim import cpu_intercepts

    cpu_intercepts.install()
    import miles_lora_ckpt_harness.sim.snapshot  # noqa: F401  (megatron's optimizer, DDP, layers)
    import miles_lora_ckpt_harness.sim.train  # noqa: F401


def _launch(request: dict) -> list[dict]:
    port = _free_port()
    pids = {}
    for rank in range(request["world_size"]):
        pid = os.fork()
        if pid == 0:
            _child(request, rank, port)  # never returns
        pids[rank] = pid
    codes, killed = _wait_all(pids, request["timeout_s"], request["failure_grace_s"])
    return [_collect(request, rank, codes[rank], killed.get(rank)) for rank in sorted(pids)]


def _child(request: dict, rank: int, port: int) -> None:
    code = 1
    job_dir = Path(request["job_dir"])
    try:
        # the child stays in the server's process group: killing the server's group leaves no orphan
        log = os.open(job_dir / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.stdin.close()
        for name in request.get("unset", ()):
            os.environ.pop(name, None)
        os.environ.update(request["env"])
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(request["world_size"]),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        sys.path[:0] = request["sys_path"]
        from miles_lora_ckpt.core import faults

        faults.disarm()
        faults.arm_from_env()  # the launch's own environment, not the server's
        from miles_lora_ckpt_harness.sim.worker import _run

        spec = {
            "rank": rank,
            "world_size": request["world_size"],
            "target": request["target"],
            "payload_path": str(job_dir / "payload.json"),
            "scratch_dir": request["scratch_dir"],
            "timeout_s": request["timeout_s"],
            "megatron": True,
        }
        report, code = {"result": _run(spec)}, 0
    except BaseException:  # noqa: B036 - a failing rank must leave its traceback
        report = {"error": traceback.format_exc()}
    try:
        _write(job_dir / f"result-{rank}.json", report)
    except (TypeError, ValueError):
        _write(job_dir / f"result-{rank}.json", {"error": "result is not JSON-able:\n" + traceback.format_exc()})
        code = 1
    finally:
        try:
            from miles_lora_ckpt_harness.sim.worker import release_leases, stop_child_processes

            release_leases()  # os._exit runs no atexit handler
            stop_child_processes()  # nor any finalizer: megatron's Manager server would be orphaned
        except BaseException:  # noqa: B036 - the child must reach os._exit whatever happens
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _write(path: Path, report: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, path)


def _wait_all(pids: dict[int, int], timeout_s: float, grace_s: float) -> tuple[dict[int, int], dict[int, str]]:
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    reason = f"timed out: killed by the launcher after {timeout_s} s"
    grace_started = False
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for rank, pid in pids.items():
            if rank in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[rank] = os.waitstatus_to_exitcode(status)
        failed = [rank for rank, code in codes.items() if code != 0]
        if failed and not grace_started:
            grace_started = True
            if time.monotonic() + grace_s < deadline:
                deadline = time.monotonic() + grace_s
                reason = f"killed by the launcher {grace_s} s after rank {min(failed)} failed"
        time.sleep(_POLL_S)
    killed = {rank: reason for rank in pids if rank not in codes}
    for rank in killed:
        try:
            os.kill(pids[rank], signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pids[rank], 0)
        codes[rank] = os.waitstatus_to_exitcode(status)
    return codes, killed


def _collect(request: dict, rank: int, exitcode: int, kill_reason: str | None) -> dict:
    job_dir = Path(request["job_dir"])
    report = _read_json(job_dir / f"result-{rank}.json")
    error = report.get("error") if report else None
    if kill_reason:
        error = kill_reason + (f"\n{error}" if error else "")
    elif report is None:
        error = (
            f"rank died by signal {signal.Signals(-exitcode).name} and left no result"
            if exitcode < 0
            else f"rank exited with code {exitcode} and left no result"
        )
    try:
        tail = (job_dir / f"rank-{rank}.log").read_bytes().decode("utf-8", errors="replace")[-_TAIL_CHARS:]
    except FileNotFoundError:
        tail = ""
    return {
        "rank": rank,
        "exitcode": exitcode,
        "result": report.get("result") if report else None,
        "error": error,
        "stderr_tail": tail,
        "timed_out": bool(kill_reason) and kill_reason.startswith("timed out"),
    }


def main() -> int:
    _warm()
    print(_READY, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        results = _launch(request)
        _write(Path(request["job_dir"]) / "results.json", results)
        print(f"{_DONE} {request['id']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
