"""`bench --sections distckpt` runs end to end with tiny sizes and prints its two lines (no timing is
asserted: speed targets live in the bench's output, never in tests)."""

from __future__ import annotations

import math
import re

import pytest

from miles_lora_ckpt.tools.cli import main as cli

pytestmark = [pytest.mark.megatron, pytest.mark.multirank]

NUMBER = r"(\S+)"


def test_distckpt_section_prints_finite_ratios(tmp_path, capsys):
    args = ["bench", "--sections", "distckpt", "--distckpt-worlds", "2", "--distckpt-bucket-mib", "0.25"]
    assert cli([*args, "--repeats", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    distckpt = re.search(rf"^DISTCKPT W=2 save/ours={NUMBER} load/ours={NUMBER} ", out, re.MULTILINE)
    reshard = re.search(rf"^RESHARD W=2 load/same={NUMBER} ", out, re.MULTILINE)
    assert distckpt and reshard, out
    for value in (*distckpt.groups(), *reshard.groups()):
        assert math.isfinite(float(value)) and float(value) > 0, out
    # both formats were written to the same storage; the resharding load is compared with a load of
    # a save at the layout it loads into, with each rank's bytes read by both
    assert (tmp_path / "distckpt2" / "ours").is_dir() and any((tmp_path / "distckpt2").glob("dc*")), out
    assert (tmp_path / "distckpt2" / "ours-tp2").is_dir(), out
    assert re.search(r"saved and loaded at TP 2 DP 1: \S+s; MiB read per rank \d+/\d+ and \d+/\d+;", out), out


def test_usage_errors_of_the_section_exit_2_before_any_worker(capsys):
    assert cli(["bench", "--sections", "distckpt,nope"]) == 2
    assert "unknown sections ['nope']" in capsys.readouterr().out
    for flags in (["--distckpt-worlds", "2,3"], ["--distckpt-worlds", "x"], ["--distckpt-bucket-mib", "0"]):
        assert cli(["bench", "--sections", "distckpt", *flags]) == 2, flags
        out = capsys.readouterr().out
        assert "--distckpt-" in out and "DISTCKPT" not in out, out
