"""The GPU check (`make gpu-check`, the harness's `gpu_check.py`) without a GPU: it skips in one line, refuses
bad usage, and its CPU dry run (gloo for both groups) runs every check end to end; its bit
comparison and its report catch what they must (no timing is asserted)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from miles_lora_ckpt_harness import gpu_check


def test_without_cuda_it_skips_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out == gpu_check.SKIP_LINE + "\n"
    assert gpu_check.main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().out
    for flags in (["--world-size", "-1"], ["--size-mib", "0"], ["--repeats", "0"]):
        assert gpu_check.main(["--device", "cpu", *flags]) == 2, flags
        assert "at least 1" in capsys.readouterr().out


@pytest.mark.multirank
def test_the_cpu_dry_run_passes_every_check(tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--size-mib", "1", "--repeats", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GPUCHECK device=cpu (CPU dry run) world=2 default_group=gloo consensus_group=gloo 1MiB/rank" in out
    assert re.search(r"^GPUCHECK bitexact save\+load: ok \(7 tensors per rank, 0 mismatched", out, re.M), out
    assert re.search(r"^GPUCHECK hostcopy: ok \(pinned no, side streams 0, bits kept .*: yes", out, re.M), out
    stall = re.search(r"^GPUCHECK stall ours/dcp=(\S+) \(ours (\S+)s: blocked (\S+)s; dcp async_save (\S+)s", out, re.M)
    assert stall and all(math.isfinite(float(v)) and float(v) >= 0 for v in stall.groups()), out
    assert float(stall.group(1)) > 0, out
    assert out.rstrip().endswith("GPUCHECK RESULT: ok"), out
    # both savers wrote where they were told: our generation and DCP's checkpoint
    assert any((tmp_path / "stall" / "ours").glob("gen-*")) and any((tmp_path / "stall").glob("dcp*/.metadata"))


def test_the_comparison_is_bit_for_bit():
    base = {"a": torch.tensor([0.0, 1.5, float("nan")]), "b": torch.ones(2, dtype=torch.bfloat16)}
    same = {k: v.clone() for k, v in base.items()}
    assert gpu_check.mismatches(base, same) == []  # NaN with the same bits is the same
    signed = {**same, "a": torch.tensor([-0.0, 1.5, float("nan")])}  # equal as numbers, not as bits
    assert gpu_check.mismatches(base, signed) == ["a"]
    flipped = same["b"].clone()
    flipped.view(torch.int16)[1] ^= 1  # the lowest mantissa bit
    assert gpu_check.mismatches(base, {**same, "b": flipped}) == ["b"]
    assert gpu_check.mismatches(base, {**same, "b": same["b"].float()}) == ["b"]  # dtype
    assert gpu_check.mismatches(base, {"a": same["a"], "c": same["b"]}) == ["b", "c"]  # missing, unexpected


def _rank(rank, *, mismatched=0, reduced=0, pinned=True, kept=True, device="cuda:0"):
    return {
        "rank": rank,
        "device": device,
        "device_name": "test",
        "default_backend": "nccl",
        "consensus_backend": "gloo",
        "size_mib": 64,
        "repeats": 2,
        "step_s": 0.01,
        "bitexact": {
            "tensors": 7,
            "mismatched_tensors": mismatched,
            "all_reduced_mismatches": reduced,
            "save_s": 1,
            "load_s": 1,
        },
        "hostcopy": {"pinned": pinned, "streams": 1, "kept_bits": kept, "seconds": 0.5},
        "stall": {"ours": [0.2, 0.4], "dcp": [0.8, 0.8], "ours_blocked": [0.1, 0.1], "dcp_blocked": [0.2, 0.2]},
    }


def test_the_report_names_each_failed_check_and_the_slowest_ranks_stall():
    lines, problems = gpu_check.report([_rank(0), _rank(1)])
    assert problems == []
    assert "GPUCHECK stall ours/dcp=0.38 (ours 0.300s: blocked 0.100s; dcp async_save 0.800s" in lines[-1]
    _, problems = gpu_check.report([_rank(0, reduced=1), _rank(1, mismatched=1, reduced=1)])
    assert problems == ["bitexact"]
    _, problems = gpu_check.report([_rank(0, reduced=2), _rank(1, reduced=2)])  # the all-reduce disagrees
    assert problems == ["bitexact"]
    _, problems = gpu_check.report([_rank(0), _rank(1, pinned=False)])
    assert problems == ["hostcopy"]
    _, problems = gpu_check.report([_rank(0, pinned=False, kept=False, device="cpu")])
    assert problems == ["hostcopy"]  # on CPU no pinning is asked for, but the bits must be kept


def test_the_stall_is_the_blocked_time_plus_the_slowed_steps():
    assert gpu_check.stall(0.1, [0.02, 0.03, 0.01], 0.01) == pytest.approx(0.13)
    assert gpu_check.stall(0.1, [0.005, 0.005], 0.01) == 0.1  # faster steps earn nothing back
    assert gpu_check.stall_ratio(0.0, 0.5) == pytest.approx(0.002)


def test_a_failed_rank_gets_its_peers_killed_after_the_grace(tmp_path):
    import subprocess
    import sys
    import time

    def start(code):
        log = open(tmp_path / f"{len(procs)}.log", "w")  # noqa: SIM115 - closed below
        return subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT), log

    procs: list = []
    procs.append(start("import sys; sys.exit(3)"))  # rank 0 fails
    procs.append(start("import time; time.sleep(120)"))  # rank 1 would wait in a collective
    started = time.monotonic()
    gpu_check._wait(procs, tmp_path, timeout_s=120, grace_s=0.5)
    assert time.monotonic() - started < 30
    assert procs[0][0].returncode == 3 and procs[1][0].returncode == -9
    for _, log in procs:
        log.close()
