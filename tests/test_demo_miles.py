"""`miles-lora-ckpt demo --via miles`: the launch command with the init hook, killed, relaunched."""

from __future__ import annotations

import pytest

from miles_lora_ckpt.tools import demo_miles
from miles_lora_ckpt.tools.cli import build_parser
from miles_lora_ckpt.tools.cli import main as cli

pytestmark = [pytest.mark.megatron, pytest.mark.multirank]

SMALL = ["--world-size", "2", "--steps", "4", "--save-every", "1"]


def output(capsys) -> tuple[list[str], str]:
    out = capsys.readouterr().out
    return out.strip().splitlines(), out


def test_demo_via_miles_through_the_cli_resumes_bit_exact(tmp_path, capsys):
    assert cli(["demo", "--via", "miles", "--workdir", str(tmp_path), *SMALL]) == 0
    lines, out = output(capsys)
    assert lines[-1] == "RESULT: bit-exact"
    assert "ROLLOUT: resumed at 2" in lines
    assert "--custom-megatron-init-path miles_lora_ckpt.hooks.megatron_init" in out
    assert "MILES_LORA_CKPT_CONFIG=" in out and "launch 2: the identical command" in out
    assert "rank 1: killed by signal 9" in out and "rank 0: stopped: CheckpointError" in out


def run(prewarmed, argv: list[str]) -> int:
    args = build_parser().parse_args(["demo", "--via", "miles", *argv])
    return demo_miles.run(args, launcher=prewarmed)


def test_other_shapes_flags_and_crash_points_compose(prewarmed, tmp_path, capsys):
    argv = [*SMALL, "--workdir", str(tmp_path), "--miles-shape", "positional-args-pr", "--adapters", "expert-only"]
    argv += ["--dtype", "fp32", "--optimizer", "lion", "--crash-at", "after-publish", "--crash-rank", "0"]
    assert run(prewarmed, argv) == 0
    lines, out = output(capsys)
    assert lines[-1] == "RESULT: bit-exact" and "ROLLOUT: resumed at 3" in lines  # rollout 2 was published
    assert "bound to Miles shape positional-args-pr" in out


def test_without_the_plugin_the_same_scenario_is_a_mismatch(prewarmed, tmp_path, capsys):
    assert run(prewarmed, [*SMALL, "--workdir", str(tmp_path), "--without-plugin"]) == 1
    lines, out = output(capsys)
    assert lines[-1].startswith("RESULT: MISMATCH rollout counter resumed at 0")
    assert "ROLLOUT: resumed at 0" in lines and "--custom-megatron-init-path" not in out
    assert "relaunching with --lora-adapter-path" in out


def test_phases_run_separately_and_a_tampered_reference_is_named(prewarmed, tmp_path, capsys):
    import json

    base = [*SMALL, "--workdir", str(tmp_path), "--adapters", "dense"]
    assert run(prewarmed, [*base, "--phase", "reference"]) == 0
    assert run(prewarmed, [*base, "--phase", "train"]) == 0
    reference = tmp_path / "miles" / "reference.json"
    data = json.loads(reference.read_text())
    name = sorted(data["digests"]["1"])[0]
    data["digests"]["1"][name] = "0" * 64
    reference.write_text(json.dumps(data))
    assert run(prewarmed, [*base, "--phase", "resume"]) == 1
    lines, _ = output(capsys)
    assert lines[-1] == f"RESULT: MISMATCH rank1:{name}"
