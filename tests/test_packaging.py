"""What `pip install` ships, from wheels built here: the plugin's wheel holds the plugin's modules only
(no harness, no Miles stand-in trees, no tests), the harness's wheel holds the harness with the stand-in
trees; the plugin imports and its CLI answers in a bare virtual environment (no torch, megatron, peft,
harness), where `demo` and `bench` say in one line what to install."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "miles_lora_ckpt"
HARNESS = REPO / "harness" / "miles_lora_ckpt_harness"
PLUGIN_TOP = {"__init__.py", "__main__.py", "core", "megatron", "savers", "integration", "hooks", "tools"}
# never copied into the build: what a checkout holds besides its sources
NOT_SOURCES = (".git", ".venv", ".tier2", ".tier3", ".tier-miles", "build", "*.egg-info", "__pycache__", "site")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, zipfile.ZipFile]:
    """The plugin's and the harness's wheels, each built by pip from a copy of the source tree (a stale
    build/ folder of the checkout cannot leak into them, and the checkout is left as it was)."""
    tmp = tmp_path_factory.mktemp("wheels")
    source = tmp / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*NOT_SOURCES), symlinks=True)
    built = {}
    for name, folder in (("plugin", source), ("harness", source / "harness")):
        out = tmp / name
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
        result = subprocess.run([*command, str(folder)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        (wheel,) = out.glob("*.whl")
        built[name] = zipfile.ZipFile(wheel)
    return built


def _sources(root: Path) -> set[str]:
    return {p.relative_to(root.parent).as_posix() for p in root.rglob("*.py")}


def test_the_plugin_wheel_holds_the_plugin_only(wheels):
    names = wheels["plugin"].namelist()
    assert {n.split("/")[0] for n in names} == {"miles_lora_ckpt", "miles_lora_ckpt-0.1.0.dist-info"}
    assert {n.split("/")[1] for n in names if n.startswith("miles_lora_ckpt/")} == PLUGIN_TOP
    assert {n for n in names if n.startswith("miles_lora_ckpt/")} == _sources(PACKAGE)
    assert not [n for n in names if re.search(r"(^|/)(sim|miles|harness|tests|miles_lora_ckpt_harness)/", n)]


def test_the_plugin_wheel_names_the_harness_by_name_in_its_demo_extra(wheels):
    metadata = wheels["plugin"].read("miles_lora_ckpt-0.1.0.dist-info/METADATA").decode()
    requires = re.findall(r"^Requires-Dist: (.*)$", metadata, re.M)
    assert 'miles-lora-ckpt-harness==0.1.0; extra == "demo"' in requires
    assert not [r for r in requires if "@" in r or "file:" in r], "no direct reference (a path) in the metadata"
    entry_points = wheels["plugin"].read("miles_lora_ckpt-0.1.0.dist-info/entry_points.txt").decode()
    assert "miles-lora-ckpt = miles_lora_ckpt.tools.cli:main" in entry_points


def test_the_harness_wheel_holds_the_harness_and_the_miles_standin_trees(wheels):
    names = wheels["harness"].namelist()
    assert {n.split("/")[0] for n in names} == {"miles_lora_ckpt_harness", "miles_lora_ckpt_harness-0.1.0.dist-info"}
    assert {n for n in names if n.startswith("miles_lora_ckpt_harness/")} == _sources(HARNESS)
    trees = sorted(p.parent.parent.name for p in (HARNESS / "miles_standin").glob("*/miles/__init__.py"))
    assert len(trees) >= 3, trees
    for tree in trees:
        assert f"miles_lora_ckpt_harness/miles_standin/{tree}/miles/__init__.py" in names, tree
    metadata = wheels["harness"].read("miles_lora_ckpt_harness-0.1.0.dist-info/METADATA").decode()
    assert "Requires-Dist: miles-lora-ckpt==0.1.0" in metadata


def test_import_and_help_in_a_bare_venv(wheels, tmp_path):
    """The plugin's wheel unpacked into a venv with nothing else: no torch, megatron, peft, harness."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    wheels["plugin"].extractall(purelib)  # a pure wheel: unpacking it is installing it (but the script)
    absent = ("torch", "megatron", "peft", "transformers", "miles_lora_ckpt_harness")
    probe = f"import importlib.util as u; assert not any(u.find_spec(m) for m in {absent!r})"
    bare_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout must not leak in
    subprocess.run([str(python), "-c", probe], check=True, cwd=tmp_path, env=bare_env)

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(python), "-m", "miles_lora_ckpt", *argv], capture_output=True, text=True, cwd=tmp_path, env=bare_env
        )

    helped = cli("--help")
    assert helped.returncode == 0, helped.stderr
    for command in ("verify", "inspect", "ls", "gc", "bench", "demo", "verify-peft", "export-peft"):
        assert re.search(rf"\n    {command}[ \n]", helped.stdout), command
    for command in ("verify-peft", "export-peft"):  # their --help needs neither torch nor peft either
        sub = cli(command, "--help")
        assert sub.returncode == 0 and "--base" in sub.stdout, sub.stderr
    for argv in (["demo"], ["demo", "--help"], ["bench", "--sections", "ratio"], ["--debug", "bench", "--help"]):
        missing = cli(*argv)
        assert missing.returncode == 2 and missing.stdout == "", argv
        (line,) = missing.stderr.splitlines()
        command = next(word for word in argv if word in ("demo", "bench"))
        assert line.startswith(f"ERROR `miles-lora-ckpt {command}` needs"), line
        assert "pip install 'miles-lora-ckpt[demo]'" in line and "make install" in line, line
    version = cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("miles-lora-ckpt ")
