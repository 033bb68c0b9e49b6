"""`bench --sections scale`: the sweep's table has one sane line per point (no timing is asserted:
speed targets live in the bench's output, never in tests), and its plot and guards work."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest

from miles_lora_ckpt.tools.cli import main as cli
from miles_lora_ckpt_harness.bench import scale as bench_scale

NUMBER = r"([0-9.eE+-]+)"
LINE = re.compile(
    rf"^SCALE W=(\d+) size=(\d+)MiB/root save/raw={NUMBER} load/raw={NUMBER} consensus save={NUMBER}s "
    rf"load={NUMBER}s manifest={NUMBER}KiB peak save={NUMBER}MiB load={NUMBER}MiB ",
    re.MULTILINE,
)


@pytest.mark.multirank
def test_the_sweep_prints_one_sane_point_per_world_and_size(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_scale, "plot_available", lambda: False)  # as where matplotlib is absent
    args = ["bench", "--sections", "scale", "--scale-worlds", "2,3", "--scale-sizes-mib", "1,2"]
    plot = tmp_path / "scale.png"
    assert cli([*args, "--scale-repeats", "1", "--dir", str(tmp_path), "--json", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert out.count("needs matplotlib") == 1 and not plot.exists(), out
    lines = LINE.findall(out)
    assert [(int(w), int(s)) for w, s, *_ in lines] == [(2, 1), (2, 2), (3, 1), (3, 2)], out
    for _, _, *values in lines:
        assert all(math.isfinite(float(v)) for v in values), out
    points = json.loads(next(line for line in out.splitlines() if line.startswith("{")))["scale"]
    for point in points:
        # every time and ratio positive; each protocol step agreed in rounds that took time
        assert all(v > 0 for v in point["seconds"].values()), point
        assert point["save_over_raw"] > 0 and point["load_over_raw"] > 0, point
        assert point["consensus_save_s"] > 0 and point["consensus_load_s"] > 0, point
        # a save agrees prepare, write, commit and publish; a load where every rank reads its own
        # file and guessed the newest generation agrees once, in the resolve round
        assert point["rounds_save"] == 4 and point["rounds_load"] == 1, point
        # the load holds the verified state: its peak is at least most of the rank's bytes
        assert point["peak_load_bytes"] >= 0.5 * point["size_mib"] * 2**20, point
    manifest = {(p["world"], p["size_mib"]): p["manifest_bytes"] for p in points}
    # the manifest names every rank's file: it grows with the world, not with the bytes
    assert manifest[(3, 1)] > manifest[(2, 1)] and manifest[(3, 2)] > manifest[(2, 2)], manifest
    assert manifest[(2, 1)] == manifest[(2, 2)], manifest


def test_usage_errors_exit_2_before_any_worker(capsys):
    for flags, expected in (
        (["--scale-worlds", "2,x"], "comma-separated whole numbers"),
        (["--scale-worlds", "0"], "--scale-worlds"),
        (["--scale-sizes-mib", "0"], "--scale-sizes-mib"),
        (["--scale-repeats", "0"], "--scale-repeats"),
    ):
        assert cli(["bench", "--sections", "scale", *flags]) == 2, flags
        out = capsys.readouterr().out
        assert expected in out and "SCALE" not in out, out
    assert cli(["bench", "--sections", "ratio", "--plot", "x.png"]) == 2
    assert "add scale to --sections" in capsys.readouterr().out


def test_points_that_do_not_fit_this_host_are_named_not_run():
    gib = 2**30
    assert bench_scale.fits(2, 64, mem_available=20 * gib, disk_free=100 * gib) is None
    too_big = bench_scale.fits(16, 2048, mem_available=20 * gib, disk_free=100 * gib)
    assert too_big and "memory" in too_big and "20.0 GiB available" in too_big
    no_disk = bench_scale.fits(2, 1024, mem_available=100 * gib, disk_free=1 * gib)
    assert no_disk and "disk" in no_disk


def test_a_skipped_point_prints_why_and_runs_no_worker(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_scale, "mem_available_bytes", lambda: 2**30)
    args = argparse.Namespace(scale_worlds="16", scale_sizes_mib="2048", scale_repeats=1, dir=str(tmp_path), json=False)
    assert bench_scale.run_section(args) == []
    assert capsys.readouterr().out.startswith("SCALE W=16 size=2048MiB/root skipped: needs about")


def _point(world, size, ratio):
    seconds = {phase: 0.1 * size for phase in bench_scale.SCALE_PHASES}
    return {
        "world": world,
        "size_mib": size,
        "seconds": seconds,
        "save_over_raw": ratio,
        "load_over_raw": ratio + 0.1,
        "consensus_save_s": 0.01 * world,
        "consensus_load_s": 0.005 * world,
        "manifest_bytes": 300 * world,
        "peak_save_bytes": size * 2**19,
        "peak_load_bytes": size * 2**20,
        "repeats": 3,
    }


def test_the_plot_is_a_png_of_the_points(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "scale.png"
    bench_scale.plot([_point(w, s, 1.0 + w / 100) for w in (2, 4) for s in (64, 256)], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_line_gives_every_figure_of_a_point():
    line = bench_scale.format_point(_point(4, 64, 1.02))
    match = LINE.match(line)
    assert match, line
    assert match.groups()[:4] == ("4", "64", "1.02", "1.12")
    assert "manifest=1.2KiB peak save=32MiB load=64MiB (0.50 and 1.00 of a root's state" in line
