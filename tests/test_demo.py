"""`miles-lora-ckpt demo` end to end, through the CLI, exactly as users (and checks) call it."""

from __future__ import annotations

import os
from importlib.metadata import version

import pytest

from miles_lora_ckpt.tools.cli import main as cli

pytestmark = [pytest.mark.megatron, pytest.mark.multirank]

MEGATRON = version("megatron-core")
OWN_LION_AND_MUON = not MEGATRON.startswith("0.16")  # the 0.19.2 tier, with emerging-optimizers
# The demo's Adam scenarios test the command (phases, output, exit codes); the resume they drive is
# the one test_single_lora runs on both tiers, so tier 2 runs only the demos of its own optimizers.
TIER1_ONLY = pytest.mark.skipif(
    os.environ.get("MILES_LORA_CKPT_TIER") == "mcore-0.19",
    reason="the Adam demo's command behaviour runs on tier 1; tier 2 runs the resume in test_single_lora",
)


def last_line(capsys) -> tuple[str, str]:
    out = capsys.readouterr().out
    return out.strip().splitlines()[-1], out


@TIER1_ONLY
def test_default_demo_crashes_mid_save_and_resumes_bit_exact(tmp_path, capsys):
    assert cli(["demo", "--workdir", str(tmp_path)]) == 0
    line, out = last_line(capsys)
    assert line == "RESULT: bit-exact"
    assert "killed by signal 9 (crash injected at mid-write)" in out
    assert "restored adapter, fp32 masters + moments, scheduler from gen-000000004" in out


def test_lion_demo_with_a_coordinator_crash_before_publish(tmp_path, capsys):
    """megatron's own Lion (0.19.2 tier); megatron-core 0.16.1 has none: the demo says so, exit 2."""
    args = [
        "demo",
        "--workdir",
        str(tmp_path),
        "--optimizer",
        "lion",
        "--world-size",
        "3",
        "--crash-at",
        "before-publish",
        "--crash-rank",
        "0",
        "--steps",
        "6",
    ]
    code = cli(args)
    line, out = last_line(capsys)
    if not OWN_LION_AND_MUON:
        assert code == 2 and line.startswith("RESULT: not run") and f"megatron-core {MEGATRON} has no Lion" in line
        return
    assert code == 0 and line == "RESULT: bit-exact" and "(iteration 2)" in out
    assert "Float16OptimizerWithFloat16Params(emerging_optimizers.scalar_optimizers.lion.Lion)" in out


def test_muon_demo_is_bit_exact_with_megatrons_own_muon(tmp_path, capsys):
    code = cli(["demo", "--workdir", str(tmp_path), "--optimizer", "muon"])
    line, out = last_line(capsys)
    if not OWN_LION_AND_MUON:
        assert code == 2 and line.startswith("RESULT: not run") and "cannot build Muon" in line
        return
    assert code == 0 and line == "RESULT: bit-exact", out
    assert "TensorParallelMuon" in out and "torch.optim.adamw.AdamW" in out  # Muon, and its Adam scalar optimizer
    assert "killed by signal 9 (crash injected at mid-write)" in out


@TIER1_ONLY
def test_crash_in_the_only_save_resumes_from_step_zero_and_says_so(tmp_path, capsys):
    args = ["demo", "--workdir", str(tmp_path), "--steps", "3", "--save-every", "2", "--adapters", "expert-only"]
    assert cli(args) == 0
    line, out = last_line(capsys)
    assert line == "RESULT: bit-exact" and "no committed generation: starting from step 0" in out


@TIER1_ONLY
@TIER1_ONLY
def test_lora_dropout_resumes_bit_exact_with_every_ranks_rng_states(tmp_path, capsys):
    """Dropout draws from torch's generator and, at TP 2, from each TP rank's own stream of megatron's
    tracker: bit-exact only because every rank's RNG states are saved and restored (without the
    restore this demo ends `RESULT: MISMATCH loss@step2`)."""
    args = ["demo", "--workdir", str(tmp_path), "--lora-dropout", "0.1", "--tp", "2", "--steps", "5"]
    assert cli(args) == 0
    line, out = last_line(capsys)
    assert line == "RESULT: bit-exact" and "(iteration 2)" in out
    assert cli(["inspect", str(tmp_path / "ckpt")]) == 0
    assert "rng         RNG states of 2 rank(s), restored at this layout only" in capsys.readouterr().out


def test_phases_run_separately_and_a_mismatch_is_reported(tmp_path, capsys):
    base = ["demo", "--workdir", str(tmp_path), "--steps", "4", "--adapters", "dense"]
    assert cli([*base, "--phase", "reference"]) == 0
    assert cli([*base, "--phase", "train"]) == 0
    reference = tmp_path / "reference.json"
    text = reference.read_text()
    # tamper with one reference digest: the comparison must notice and name the tensor
    import json

    data = json.loads(text)
    name = sorted(data["digests"]["0"])[0]
    data["digests"]["0"][name] = "0" * 64
    reference.write_text(json.dumps(data))
    assert cli([*base, "--phase", "resume"]) == 1
    line, _ = last_line(capsys)
    assert line == f"RESULT: MISMATCH rank0:{name}"


@pytest.mark.peft
@pytest.mark.skipif(
    os.environ.get("MILES_LORA_CKPT_TIER") == "mcore-0.19",
    reason="tier 2 covers the PEFT export path in test_peft_export.py; the demo flag runs on tier 1",
)
def test_export_peft_demo_writes_a_loadable_adapter_next_to_the_checkpoint(tmp_path, capsys):
    args = ["demo", "--workdir", str(tmp_path), "--export-peft", "--steps", "5"]
    assert cli(args) == 0
    line, out = last_line(capsys)
    assert line == "PEFT: loadable (0 missing, 0 unexpected)"
    assert "RESULT: bit-exact" in out and "(iteration 2)" in out
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf-base")).config.model_type == "qwen2"
    assert (tmp_path / "peft" / "latest" / "adapter_model.safetensors").is_file()
    generations = sorted((tmp_path / "ckpt").glob("gen-*"))
    assert generations and all((g / "peft" / "adapter_config.json").is_file() for g in generations)
    assert cli(["verify-peft", str(tmp_path / "ckpt"), "--base", str(tmp_path / "hf-base")]) == 0


def test_a_refused_load_ends_with_result_error(tmp_path, capsys):
    """A checkpoint the resume must refuse (written by another saver): the demo says so, last."""
    import json

    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt.core.layout import Topology
    from miles_lora_ckpt.core.protocol import save_generation

    save_generation(
        Consensus.single_process(),
        tmp_path / "ckpt",
        iteration=2,
        saver="another-saver",
        topology=Topology(),
        write_files=lambda writer: writer.write_json("notes.json", {}),
    )
    config = {"world_size": 1, "tp": 1, "pp": 1, "ep": 1, "cp": 1, "vpp": 1, "num_layers": 2}
    config |= {"dtype": "bf16", "adapters": "dense", "optimizer": "adam", "muon_scalar": "adam"}
    config |= {"distributed": None, "layer_wise": False, "slots": 1, "adapter_bias": False}
    reference = {"config": config, "steps": 3, "losses": [0.0, 0.0, 0.0], "digests": {"0": {}}}
    (tmp_path / "reference.json").write_text(json.dumps(reference))
    args = ["demo", "--workdir", str(tmp_path), "--world-size", "1", "--adapters", "dense", "--steps", "3"]
    assert cli([*args, "--phase", "resume"]) == 1
    line, _ = last_line(capsys)
    assert line.startswith("RESULT: ERROR checkpoint phase 'resolve' failed on rank(s) [0]:"), line
    assert "was written by saver 'another-saver', not 'single-lora'" in line


def test_usage_errors_of_the_optimizer_flags_exit_2_before_any_worker(tmp_path, capsys):
    base = ["demo", "--workdir", str(tmp_path), "--world-size", "2"]
    cases = {
        # the Miles stand-in builds what Miles builds for adam and lion: no harness-only layouts
        ("--via", "miles", "--optimizer", "muon"): "--optimizer muon: the Miles stand-in builds",
        ("--via", "miles", "--layer-wise", "--chain-slots", "2"): "--layer-wise, --chain-slots: the Miles stand-in",
        ("--chain-slots", "2", "--pp", "2"): "--chain-slots 2 needs --pp 1",
        ("--slots", "2", "--pp", "2"): "--slots needs --pp 1",
        ("--slots", "2", "--optimizer", "muon"): "drop --optimizer muon",
        ("--slots", "2", "--chain-slots", "2"): "pick one",
        ("--slots", "9"): "--slots must be between 1 and 4",
        ("--layer-wise", "--distributed-optimizer"): "drop --distributed-optimizer",
        ("--lora-dropout", "1"): "--lora-dropout takes P in [0, 1)",
        ("--slots", "2", "--lora-dropout", "0.1"): "on the tiny model: drop --slots/--export-peft",
    }
    for flags, words in cases.items():
        assert cli([*base, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert words in err, (flags, err)
    assert not (tmp_path / "miles").exists() and not (tmp_path / "ckpt").exists()


RESHARDS = {  # demo flags: words the output must hold
    # TP 2 -> 1 at the same DP size (1): the losses differ by reduction order only
    ("--tp", "2", "--resume-tp", "1", "--resume-world-size", "1"): "resumed at tp1 pp1 vpp1 ep1 cp1 dp1",
    ("--pp", "2", "--vpp", "2", "--resume-pp", "1", "--resume-vpp", "1"): "resumed at tp1 pp1 vpp1 ep1 cp1 dp2",
    # a bigger world: TP 1 -> 2 at W=2 -> 4 (the DP size, and so the data, unchanged)
    ("--resume-tp", "2", "--resume-world-size", "4"): (
        "saved at tp1 pp1 vpp1 ep1 cp1 dp2, resumed at tp2 pp1 vpp1 ep1 cp1 dp2"
    ),
    # expert-TP 2 -> 1 at TP 1 (megatron's expert-TP group), on one rank (world size 1)
    ("--etp", "2", "--resume-etp", "1", "--resume-world-size", "1"): (
        "saved at tp1 pp1 vpp1 ep1 etp2 cp1 dp2, resumed at tp1 pp1 vpp1 ep1 cp1 dp1"
    ),
}


@TIER1_ONLY
@pytest.mark.parametrize("flags", sorted(RESHARDS), ids=" ".join)
def test_resharding_resume_is_bit_exact_at_the_load(tmp_path, capsys, flags):
    assert cli(["demo", "--workdir", str(tmp_path), *flags]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert RESHARDS[flags] in out and "killed by signal 9 (crash injected at mid-write)" in out
    assert "from gen-000000004" in out and "(iteration 4) at the new layout" in out
    assert "(adapter, exp_avg, exp_avg_sq, groups, master, step) at step 4" in out, out
    assert lines[-3] == "RESULT: bit-exact", out
    words = lines[-1].split()
    assert words[:4] == ["LOSS:", "max", "relative", "difference"] and words[-3:] == ["over", "4", "steps"], lines[-1]
    assert 0 <= float(words[4]) < 1, lines[-1]
    if "--resume-tp" in flags:  # the same data at both layouts: reduction order only
        assert float(words[4]) < 1e-2, lines[-1]


@TIER1_ONLY
def test_a_resharding_resume_reports_a_mismatch_naming_the_global_tensor(tmp_path, capsys):
    """The reference's global view of one tensor altered: the resume names that tensor."""
    import json

    base = ["demo", "--workdir", str(tmp_path), "--tp", "2", "--resume-tp", "1", "--resume-world-size", "1"]
    assert cli([*base, "--phase", "reference"]) == 0
    assert cli([*base, "--phase", "train"]) == 0
    reference = json.loads((tmp_path / "reference.json").read_text())
    view = reference["views"]["6"]  # --phase train alone crashes nothing: the newest save is step 6
    victim = sorted(k for k in view if k.startswith("exp_avg_sq:") and "linear_qkv" in k)[0]
    view[victim] = "0" * 32
    (tmp_path / "reference.json").write_text(json.dumps(reference))
    capsys.readouterr()
    assert cli([*base, "--phase", "resume"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3] == f"RESULT: MISMATCH {victim}", lines
    assert lines[-1].startswith("LOSS: max relative difference "), lines


def test_resharding_usage_errors_exit_2_before_any_worker(tmp_path, capsys):
    base = ["demo", "--workdir", str(tmp_path), "--world-size", "2"]
    cases = {
        ("--resume-tp", "3"): "ERROR invalid resume layout: tp must be 1 or 2",
        ("--resume-pp", "2", "--resume-world-size", "3"): "ERROR invalid resume layout: world size 3",
        ("--resume-tp", "2", "--resume-etp", "2", "--resume-ep", "2"): "ERROR invalid resume layout: world size / pp",
        # an expert-TP 2 save resumed on one rank keeps expert-TP 2 unless --resume-etp says otherwise
        ("--etp", "2", "--resume-world-size", "1"): "is not divisible by etp*ep = 2*1 (expert mesh)",
        ("--etp", "3"): "ERROR invalid layout: etp must be 1 or 2",
        ("--etp", "2", "--resume-etp", "2"): "nothing to reshard",
        ("--etp", "2", "--via", "miles", "--miles-shape", "miles-rl-0.0.2"): "--etp runs the harness demo's model",
        ("--resume-tp", "1"): "nothing to reshard",
        # through Miles: every axis, the resume's layout checked; stock Miles has no resharding load
        ("--via", "miles", "--resume-pp", "2", "--resume-world-size", "3"): "ERROR invalid resume layout: world size 3",
        ("--via", "miles", "--pp", "2", "--resume-vpp", "2", "--resume-pp", "1"): "vpp=2 needs pp >= 2",
        ("--via", "miles", "--without-plugin", "--resume-tp", "2"): "stock Miles has no resharding load",
        ("--via", "miles", "--resume-tp", "3"): "ERROR invalid resume layout: tp must be 1 or 2",
        ("--slots", "2", "--resume-tp", "2"): "drop --slots",
        ("--export-peft", "--resume-world-size", "1"): "drop --export-peft",
    }
    for flags, words in cases.items():
        assert cli([*base, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert words in err, (flags, err)
    assert not (tmp_path / "miles").exists() and not (tmp_path / "ckpt").exists()
    assert not (tmp_path / "reference.json").exists()
