"""`miles-lora-ckpt demo --via miles`: the launch command with the init hook, killed, relaunched."""

from __future__ import annotations

import pytest

from miles_lora_ckpt.tools.cli import main as cli
from miles_lora_ckpt_harness.commands import build_parser
from miles_lora_ckpt_harness.demo import via_miles as demo_miles

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
    # the rollout side: the plugin's data source resumes the prompts of an uninterrupted run
    assert "--data-source-path miles_lora_ckpt.hooks.CheckpointedDataSource" in out
    assert (
        "PROMPTS: rollouts 2..3 drew the same prompts as the reference (the data state of rollout 1 restored "
        "from its generation)" in lines
    )


RESHARD = ["--tp", "2", "--resume-tp", "1", "--resume-world-size", "1", "--steps", "4", "--save-every", "1"]


def test_demo_via_miles_reshards_tp_and_world_size_bit_exact(tmp_path, capsys):
    """Launch 2 at TP 1 on one rank loads launch 1's TP-2 generation through Miles' init (the
    plugin's resharding load): its global view equals the uninterrupted run's at that rollout."""
    import json

    assert cli(["demo", "--via", "miles", "--workdir", str(tmp_path), *RESHARD]) == 0
    lines, out = output(capsys)
    assert "rank 1: killed by signal 9" in out and "launch 2: the same command at tp=1 on 1 ranks" in out
    assert "ROLLOUT: resumed at 2" in lines
    assert "(adapter, exp_avg, exp_avg_sq, groups, master, step) at rollout 1" in out, out
    assert lines[-3] == "RESULT: bit-exact", out
    words = lines[-1].split()
    assert words[:4] == ["LOSS:", "max", "relative", "difference"] and words[-1] == "steps", lines[-1]
    assert 0 <= float(words[4]) < 1e-2, lines[-1]  # same data, reduction order only
    # launch 1 again (launch 2 saved on at TP 1), the reference's view of one global tensor altered:
    # the resume names it
    assert cli(["demo", "--via", "miles", "--workdir", str(tmp_path), *RESHARD, "--phase", "train"]) == 0
    path = tmp_path / "miles" / "reference-reshard.json"
    reference = json.loads(path.read_text())
    victim = sorted(k for k in reference["views"]["1"] if k.startswith("master:") and "linear_fc1" in k)[0]
    reference["views"]["1"][victim] = "0" * 32
    path.write_text(json.dumps(reference))
    assert cli(["demo", "--via", "miles", "--workdir", str(tmp_path), *RESHARD, "--phase", "resume"]) == 1
    lines, _ = output(capsys)
    assert lines[-3] == f"RESULT: MISMATCH {victim}", lines


def run(prewarmed, argv: list[str]) -> int:
    args = build_parser().parse_args(["demo", "--via", "miles", *argv])
    return demo_miles.run(args, launcher=prewarmed)


MILES_RESHARDS = {  # flags: (launch 1's layout flags, launch 2's, launch 1's manifest coordinates)
    ("--ep", "2", "--resume-ep", "1"): (
        "--expert-model-parallel-size 2 --num-experts 2 --load",
        "--bf16 --num-experts 2 --load",
        ["tp000_pp000_ep000_etp000", "tp000_pp000_ep001_etp000"],
    ),
    ("--etp", "2", "--resume-etp", "1"): (
        "--bf16 --expert-tensor-parallel-size 2 --load",
        "--bf16 --load",
        ["tp000_pp000_ep000_etp000", "tp000_pp000_ep000_etp001"],
    ),
    ("--pp", "2", "--vpp", "2", "--resume-pp", "1", "--resume-vpp", "1"): (
        "--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 --num-layers 4 --load",
        "--bf16 --num-layers 4 --load",
        ["tp000_pp000_ep000_etp000", "tp000_pp001_ep000_etp000"],
    ),
}


@pytest.mark.parametrize("flags", sorted(MILES_RESHARDS), ids=" ".join)
def test_demo_via_miles_reshards_expert_and_pipeline_layouts_bit_exact(prewarmed, tmp_path, capsys, flags):
    """Launch 1 with Megatron-LM's expert or pipeline flags (EP 2 with globally numbered experts,
    expert-TP 2, or PP 2 with VPP 2 and a layer count both layouts divide), launch 2 without them:
    Miles' init loads launch 1's generation through the plugin, resharded across EP, expert-TP or
    the pipeline layout, and its global view equals the uninterrupted run's at that rollout."""
    import json

    flags_1, flags_2, coordinates = MILES_RESHARDS[flags]
    assert run(prewarmed, [*SMALL, "--workdir", str(tmp_path), *flags]) == 0
    lines, out = output(capsys)
    launch_1, launch_2 = (line for line in lines if line.startswith("  ") and " train.py " in line)
    assert flags_1 in launch_1 and flags_2 in launch_2, (launch_1, launch_2)
    assert "launch 2: the same command at tp=1 on 2 ranks" in out and "ROLLOUT: resumed at 2" in lines
    assert "(adapter, exp_avg, exp_avg_sq, groups, master, step) at rollout 1" in out, out
    assert lines[-3] == "RESULT: bit-exact", out
    words = lines[-1].split()
    assert words[:4] == ["LOSS:", "max", "relative", "difference"] and words[-1] == "steps", lines[-1]
    # launch 1 ran at the expert layout asked for: its generation's manifest records each EP or
    # expert-TP rank's blocks under its own coordinate
    (generation,) = (tmp_path / "miles" / "run" / "lora").glob("gen-000000001-*")  # launch 1's, the one loaded
    manifest = json.loads((generation / "manifest.json").read_text())
    assert sorted(manifest["metadata"]["global_layout"]["params"]) == coordinates, generation


def test_other_shapes_flags_and_crash_points_compose(prewarmed, tmp_path, capsys):
    argv = [*SMALL, "--workdir", str(tmp_path), "--miles-shape", "positional-args-pr", "--adapters", "expert-only"]
    argv += ["--dtype", "fp32", "--optimizer", "lion", "--crash-at", "after-publish", "--crash-rank", "0"]
    argv += ["--lora-dropout", "0.1"]  # Miles' flag: bit-exact with every rank's RNG states restored
    assert run(prewarmed, argv) == 0
    lines, out = output(capsys)
    assert lines[-1] == "RESULT: bit-exact" and "ROLLOUT: resumed at 3" in lines  # rollout 2 was published
    assert "--lora-dropout 0.1" in out
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


def test_layout_flags_become_megatrons_parallel_size_flags(tmp_path, capsys):
    """--tp/--pp/--ep/--cp/--vpp reach the stand-in as Megatron's flags; an invalid layout exits 2."""
    parse = build_parser().parse_args
    args = parse(["demo", "--via", "miles", "--workdir", str(tmp_path), "--world-size", "4", "--cp", "2"])
    flags = demo_miles.Scenario(args).training_flags()
    assert flags[flags.index("--context-parallel-size") + 1] == "2"
    assert "--tensor-model-parallel-size" not in flags  # sizes of 1 stay implicit, as in a user's command
    args = parse(["demo", "--via", "miles", "--workdir", str(tmp_path), "--world-size", "2", "--pp", "2", "--vpp", "2"])
    flags = demo_miles.Scenario(args).training_flags()
    assert flags[flags.index("--pipeline-model-parallel-size") + 1] == "2"
    assert flags[flags.index("--virtual-pipeline-model-parallel-size") + 1] == "2"
    assert cli(["demo", "--via", "miles", "--workdir", str(tmp_path), "--world-size", "3", "--tp", "2"]) == 2
    assert "ERROR invalid layout" in capsys.readouterr().err


def test_export_peft_through_miles_loads_in_peft(prewarmed, tmp_path, capsys):
    """--export-peft: the Qwen2-shaped model at TP=2, export.peft and --save-hf in the launch; the
    relaunch's newest peft/ and last --save-hf adapter load with the real PEFT onto DIR/hf-base."""
    argv = [*SMALL, "--workdir", str(tmp_path), "--export-peft", "--miles-shape", "positional-args-pr"]
    assert run(prewarmed, argv) == 0
    lines, out = output(capsys)
    assert lines[-1] == "RESULT: bit-exact" and "ROLLOUT: resumed at 2" in lines
    assert "PEFT: loadable (0 missing, 0 unexpected)" in lines
    assert "--save-hf PEFT: loadable (0 missing, 0 unexpected)" in lines
    assert "--target-modules all-linear" in out and "--tensor-model-parallel-size 2" in out
    assert f"--hf-checkpoint {tmp_path / 'hf-base'}" in out and "--save-hf" in out
    assert "peft = true" in (tmp_path / "miles" / "miles-lora-ckpt.toml").read_text()


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--without-plugin"], "--export-peft --without-plugin: stock Miles' PEFT export writes a pickled"),
        (["--adapters", "expert-only"], "has no experts"),
        (["--cp", "2", "--world-size", "4"], "no --ep, --cp or --vpp"),
    ],
)
def test_export_peft_usage_errors_exit_2(tmp_path, capsys, extra, words):
    assert cli(["demo", "--via", "miles", "--workdir", str(tmp_path), "--export-peft", *SMALL, *extra]) == 2
    assert words in capsys.readouterr().err


def test_export_peft_takes_tp_2_only_where_the_world_has_room():
    parse = build_parser().parse_args

    def tp(*extra) -> str | None:
        flags = demo_miles.Scenario(parse(["demo", "--via", "miles", "--export-peft", *extra])).training_flags()
        return (
            flags[flags.index("--tensor-model-parallel-size") + 1] if "--tensor-model-parallel-size" in flags else None
        )

    assert tp("--world-size", "2") == "2" and tp("--world-size", "4", "--pp", "2") == "2"
    assert tp("--world-size", "2", "--pp", "2") is None and tp("--world-size", "3") is None  # no room: TP=1


def test_the_wheel_shape_without_the_real_miles_tier_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MILES_LORA_CKPT_REAL_MILES", raising=False)
    argv = ["demo", "--via", "miles", "--miles-shape", "miles-rl-0.0.2", "--workdir", str(tmp_path)]
    assert cli(argv) == 2
    assert "make demo-miles" in capsys.readouterr().err
    assert cli([*argv, "--slots", "2"]) == 2
    assert "no multi-LoRA" in capsys.readouterr().err
