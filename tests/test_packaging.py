"""The package imports and its CLI answers in a bare virtual environment: no torch, megatron, peft."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_and_help_in_a_bare_venv(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "miles_lora_ckpt_repo.pth").write_text(str(REPO) + "\n")
    probe = "import importlib.util as u; assert not any(u.find_spec(m) for m in ('torch', 'megatron', 'peft', 'transformers'))"
    subprocess.run([str(python), "-c", probe], check=True)
    subprocess.run([str(python), "-c", "import miles_lora_ckpt"], check=True)
    helped = subprocess.run([str(python), "-m", "miles_lora_ckpt", "--help"], capture_output=True, text=True)
    assert helped.returncode == 0, helped.stderr
    for command in ("verify", "inspect", "ls", "gc", "bench", "demo", "verify-peft", "export-peft"):
        assert re.search(rf"\n    {command}[ \n]", helped.stdout), command
    for command in ("verify-peft", "export-peft"):  # their --help needs neither torch nor peft either
        sub = subprocess.run([str(python), "-m", "miles_lora_ckpt", command, "--help"], capture_output=True, text=True)
        assert sub.returncode == 0 and "--base" in sub.stdout, sub.stderr
    version = subprocess.run([str(python), "-m", "miles_lora_ckpt", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("miles-lora-ckpt ")
