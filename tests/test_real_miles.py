"""The real Miles wheel (miles-rl 0.0.2, `make tier-miles`): binding, and kill/relaunch on its code paths.

Runs only where MILES_LORA_CKPT_REAL_MILES names the tier folder (the Makefile's `tier-miles` run,
marker `realmiles`); elsewhere these tests skip. Every `miles.*` module a run used must be the
wheel's (its file under the tier folder); what is stood in is listed in `realmiles/standins.py`.
A run goes through `realmiles/launch.py`: the wheel's `initialize_model_and_optimizer`,
`checkpoint.load_checkpoint`, `model.save` and `lora_utils` on the harness's model and megatron's
DistributedOptimizer (gloo, CPU), with the plugin's init hook or without it (stock Miles).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs_paths import TESTS
from test_miles_resume import _first_difference, failed, ok

from miles_lora_ckpt_harness.realmiles import standins

TIER = standins.tier_folder()
pytestmark = [
    pytest.mark.realmiles,
    pytest.mark.skipif(TIER is None, reason=f"no real Miles wheel: {standins.ENV} unset (make tier-miles)"),
]

JOB = "miles_lora_ckpt_harness.realmiles.launch:launch_job"
HOOK = ["--custom-megatron-init-path", "miles_lora_ckpt.hooks.megatron_init"]
TARGETS = {"dense": "linear_qkv,linear_proj", "expert-only": "linear_fc1,linear_fc2", "mixed": None}
QWEN2_TARGETS = {"dense": "q_proj,k_proj,v_proj,o_proj", "mixed": "all-linear"}  # Miles' HF spellings
ROLLOUTS = 4  # x 2 optimizer steps; a save after every rollout; the crash is in the save of rollout 2
USED = (
    "miles.backends.megatron_utils.lora_utils",
    "miles.backends.megatron_utils.checkpoint",
    "miles.backends.megatron_utils.model",
    "miles.utils.misc",
    "megatron.training.global_vars",
)
ACTOR = "miles.backends.megatron_utils.actor"


class Run:
    def __init__(self, launcher, tmp: Path, world: int, adapters: str, hf: Path | None = None):
        self.launcher, self.world = launcher, world
        self.hf = hf or tmp / "hf-base"
        if hf is None:
            self.hf.mkdir(parents=True, exist_ok=True)
            # the Bridge double reads the architecture; any non-Qwen2 config gives the tiny harness model
            (self.hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        tmp.mkdir(parents=True, exist_ok=True)
        self.save = tmp / "run"
        self.config = tmp / "plugin.toml"
        self.config.write_text("[consensus]\ntimeout_s = 60\n")
        self.training = ["--megatron-to-hf-mode", "bridge", "--hf-checkpoint", str(self.hf), "--bf16"]
        self.training += ["--num-rollout", str(ROLLOUTS), "--lora-rank", "4", "--lora-alpha", "4"]
        targets = QWEN2_TARGETS[adapters] if hf is not None else TARGETS[adapters]
        self.training += ["--target-modules", targets] if targets else []

    def command(self, *more: str, plugin: bool = True) -> list[str]:
        saving = ["--save", str(self.save), "--load", str(self.save), "--save-interval", "1"]
        return (HOOK if plugin else []) + self.training + saving + list(more)

    def launch(self, argv, crash=None, wheel_actor=False):
        return self.launcher.run(
            self.world,
            JOB,
            {"argv": argv, "crash": crash, "tier": str(TIER), "wheel_actor": wheel_actor},
            env={"MILES_LORA_CKPT_CONFIG": str(self.config)},
            sys_path=[TESTS],
            timeout_s=300,
            failure_grace_s=5.0,
        )


def validation(launcher, run: Run, cases: dict[str, list[str]]) -> list[dict]:
    """The wheel's parse_args, then its initialize.init with the hook, for each case (realmiles/wheel_args.py)."""
    return ok(
        launcher.run(
            run.world,
            "miles_lora_ckpt_harness.realmiles.wheel_args:validation_job",
            {"cases": cases, "tier": str(TIER)},
            env={"MILES_LORA_CKPT_CONFIG": str(run.config)},
            timeout_s=300,
            failure_grace_s=5.0,
        )
    )


def assert_from_the_wheel(report: dict) -> None:
    modules = report["modules"]
    for name in USED:
        assert Path(modules[name]).resolve().is_relative_to(TIER), (name, modules.get(name))
    for name, path in modules.items():  # nothing named miles comes from elsewhere (a stand-in tree)
        assert not path or Path(path).resolve().is_relative_to(TIER), (name, path)
    listed = {**standins.STANDINS, **standins.ARGUMENT_STANDINS, **standins.ACTOR_STANDINS}
    assert {name.split(".")[0] for name in report["standins"]} <= set(listed), report["standins"]


@pytest.mark.megatron
@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 3])
def test_real_wheel_killed_mid_save_resumes_bit_exact(prewarmed, tmp_path, world):
    """The hook binds to the wheel (shape miles-rl-0.0.2); a rank killed mid-save, the same command
    relaunched: every tensor, counter and loss equals an uninterrupted run's (dense, mixed, expert-only)."""
    from miles_lora_ckpt_harness.realmiles import wheel_args

    qwen2 = wheel_args.write_hf_config(tmp_path / "hf-qwen2")  # what hf_validate_args reads
    for adapters in ("dense", "mixed", "expert-only"):
        run = Run(prewarmed, tmp_path / adapters, world, adapters)
        reference = ok(run.launch(run.training))
        # W=2 dense saves through the wheel's own MegatronTrainRayActor.save_model (its by-name `save`)
        actor = world == 2 and adapters == "dense"
        crash = {"rollout": 2, "rank": world - 1, "phase": "mid-write"}
        crashed = run.launch(run.command(), crash=crash, wheel_actor=actor)
        assert crashed[world - 1].exitcode == -9, adapters
        if world == 2 and adapters == "dense":
            # the wheel's own parse_args and init on the relaunch: its validation forces start_rollout_id = 0
            # in bridge mode (fixed by Miles #2682), so its driver would replay from rollout 0 over the resumed
            # state; the hook refuses on every rank
            relaunch = validation(prewarmed, run, {"relaunch": wheel_args.command(qwen2, run.save, 2)})
            for result in relaunch:  # raised on every rank (rank 0 checked the save directory)
                error = result["cases"]["relaunch"]["error"]
                assert result["cases"]["relaunch"]["parsed"]["start_rollout_id"] == 0, result["cases"]
                assert "start_rollout_id is already 0" in error and "PR #2682" in error, error
        resumed = ok(run.launch(run.command(), wheel_actor=actor))
        for rank, (ref, got) in enumerate(zip(reference, resumed, strict=True)):
            assert_from_the_wheel(got)
            if actor:
                assert Path(got["modules"][ACTOR]).resolve().is_relative_to(TIER)
                assert f"{ACTOR}.save" in got["plugin"]["bindings"], got["plugin"]["bindings"]
            assert got["plugin"]["shape"] == "miles-rl-0.0.2", got["plugin"]
            assert "miles.backends.megatron_utils.model.save_lora_checkpoint" in got["plugin"]["bindings"]
            assert got["start_rollout_id"] == 2, (adapters, rank)
            assert got["rollouts"] == [2, 3], (adapters, rank)
            assert got["after_init"]["scheduler_num_steps"] == 2 * 8, (adapters, rank)  # stepped once
            saved = (crashed[rank].result or {}).get("at_save", {}).get("1")
            if saved is not None:
                assert got["after_init"]["digests"] == saved, _first_difference(saved, got["after_init"]["digests"])
            for step, loss in got["losses"].items():
                assert loss == ref["losses"][step], (adapters, rank, step)
            assert got["final"] == ref["final"], (adapters, rank, _first_difference(ref["final"], got["final"]))


@pytest.mark.megatron
@pytest.mark.multirank
def test_stock_real_wheel_shows_its_defects(prewarmed, tmp_path):
    """Negative control, plugin not installed: the wheel's own LoRA save/load."""
    run = Run(prewarmed, tmp_path / "dense", 2, "dense")
    reference = ok(run.launch(run.training))
    # killed after rollout 3 trained, before its save: stock Miles' save of rollout 2 is complete
    crashed = run.launch(run.command(plugin=False), crash={"rollout": 3, "rank": 1, "phase": "between-saves"})
    assert crashed[1].exitcode == -9
    assert_from_the_wheel(crashed[0].result)
    assert crashed[0].result["plugin"] is None
    saved = crashed[0].result["at_save"]["2"]
    adapter = str(run.save / "iter_0000002" / "adapter")
    resumed = ok(run.launch(run.training + ["--lora-adapter-path", adapter]))
    for rank, (ref, got) in enumerate(zip(reference, resumed, strict=True)):
        after = got["after_init"]
        assert got["start_rollout_id"] == 0, rank  # the rollout counter starts over
        assert after["scheduler_num_steps"] == 24 + 2 * 4, rank  # restored 24 samples, then + 2 x 4 again
        assert not after["masters_match_adapter"], rank  # stale fp32 masters under the loaded adapter
        if rank == 0:
            params = [n for n in saved if n.startswith("param/")]
            assert params and all(after["digests"][n] == saved[n] for n in params)  # the adapter did load
            state = [n for n in saved if "/master/" in n or n.endswith("/exp_avg") or n.endswith("/exp_avg_sq")]
            assert state and all(after["digests"].get(n) != saved[n] for n in state)  # masters, moments did not
        assert got["final"] != ref["final"], rank

    expert = Run(prewarmed, tmp_path / "expert", 2, "expert-only")
    errors = failed(expert.launch(expert.command(plugin=False)))
    assert all("AttributeError" in e for e in errors), errors  # stub child: state_dict() raises on every rank


@pytest.mark.megatron
@pytest.mark.multirank
def test_the_wheels_own_parse_args_validation_and_init_run_the_hook(prewarmed, tmp_path):
    """The wheel's `parse_args` (its Megatron-LM parser, SGLang's server arguments, `hf_validate_args`,
    `miles_validate_args`, Megatron-LM's `validate_args`) on a realistic LoRA command, then the wheel's
    `initialize.init`, which calls the plugin's hook (W=2, one job, cases in order).

    Fault tolerance, as miles-rl 0.0.2 has it: `--use-fault-tolerance` is rollout health checking only;
    the wheel has no `--ft-components` (its parser refuses the flag) and its validation never sets
    `non_persistent_ckpt_type` (the 2026-08 shape's `--ft-components train` does; tests/test_miles_*
    cover that on the stand-in). So: with `--use-fault-tolerance` the hook binds; the in-memory checkpoint
    the user asks for with `--non-persistent-ckpt-type local` (which Megatron-LM's validation accepts with
    `--non-persistent-local-ckpt-dir`) is refused on every rank naming exactly that flag, and no flag the
    user did not pass."""
    from miles_lora_ckpt_harness.realmiles import wheel_args

    hf = wheel_args.write_hf_config(tmp_path / "hf")
    local = ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", str(tmp_path / "local")]
    cases = {
        "ft-components": wheel_args.command(hf, tmp_path / "a", 2, "--use-fault-tolerance", "--ft-components", "train"),
        "in-memory": wheel_args.command(hf, tmp_path / "b", 2, "--use-fault-tolerance", *local),
        "stock": wheel_args.command(hf, tmp_path / "c", 2, *local, plugin=False),
        "rollout-ft": wheel_args.command(hf, tmp_path / "d", 2, "--use-fault-tolerance"),
        "plain": wheel_args.command(hf, tmp_path / "e", 2),
    }
    results = validation(prewarmed, Run(prewarmed, tmp_path / "run", 2, "dense"), cases)
    for rank, result in enumerate(results):
        modules = result["modules"]
        for name in (
            "miles.utils.arguments",
            "miles.backends.megatron_utils.initialize",
            "megatron.training.arguments",
        ):
            assert Path(modules[name]).resolve().is_relative_to(TIER), (name, modules.get(name))
        assert set(result["standins"]) >= {"sglang_router", "openai"}, result["standins"]
        assert {n.split(".")[0] for n in result["standins"]} <= set(standins.STANDINS) | set(standins.ARGUMENT_STANDINS)
        got = result["cases"]
        # 0.0.2 has no --ft-components: its own parser refuses it
        assert got["ft-components"]["exit"] == 2, got["ft-components"]
        assert "unrecognized arguments: --ft-components train" in got["ft-components"]["refused"]
        # the user's in-memory checkpoint: validated by the wheel, refused by the hook naming the user's flag
        memory = got["in-memory"]
        assert memory["parsed"]["non_persistent_ckpt_type"] == "local", memory
        assert memory["plugin"] is None and "UnsupportedConfiguration" in memory["error"], memory
        assert "--non-persistent-ckpt-type local (Miles' in-memory" in memory["error"], memory["error"]
        assert "--ft-components" not in memory["error"] and "--use-fault-tolerance" not in memory["error"]
        assert "rank 0:" in memory["error"] and "rank 1:" in memory["error"]  # raised on every rank
        # stock Miles (no hook) initialises with the same flags: the refusal is the plugin's, not the wheel's
        assert got["stock"]["error"] is None and got["stock"]["initialized"], got["stock"]
        assert got["stock"]["plugin"] is None
        for name in ("rollout-ft", "plain"):
            case = got[name]
            assert case["error"] is None and case["initialized"], (rank, name, case)
            assert case["parsed"]["non_persistent_ckpt_type"] is None, case
            assert case["parsed"]["target_modules"] == [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ]
            assert case["parsed"]["data_parallel_size"] == 2 and case["parsed"]["use_distributed_optimizer"]
            assert case["plugin"]["shape"] == "miles-rl-0.0.2", case["plugin"]
            assert "miles.backends.megatron_utils.model.save" in case["plugin"]["bindings"]
            assert "miles.backends.megatron_utils.checkpoint.load_checkpoint" in case["plugin"]["bindings"]
        assert got["rollout-ft"]["parsed"]["use_fault_tolerance"] is True


# Every function and method the 2026-08 stand-in (miles_standin/lora_utils_2026_08) defines or
# re-exports in a module the wheel also has is compared with the wheel's, as `render_signature` writes
# them (names, kinds, defaults). Only these differ, each exactly as recorded: the 2026-08 shape's own
# signatures where Miles changed after the 0.0.2 wheel, as the 2026-08 source
# has them (miles_standin/source_signatures.py, tests/test_miles_standin_signatures.py).
KNOWN_2026_08_DIFFERENCES = {
    "miles.backends.megatron_utils.model.initialize_model_and_optimizer": (
        "(args, role=..., checkpointing_context=...)",
        "(args, role=...)",
    ),
    "miles.backends.megatron_utils.model.save": (
        "(iteration, model, optimizer, opt_param_scheduler, checkpointing_context=..., non_persistent_ckpt=...)",
        "(iteration, model, optimizer, opt_param_scheduler)",
    ),
    "miles.backends.megatron_utils.actor.MegatronTrainRayActor.init": (
        "(self, args, role, *, with_ref=..., with_opd_teacher=..., recv_ckpt_src_rank=..., indep_dp_info)",
        "(self, args, role, with_ref=...)",
    ),
    "miles.backends.megatron_utils.actor.MegatronTrainRayActor.train": (
        "(self, rollout_id, rollout_data_ref, witness_info=..., attempt=..., external_data=...)",
        "(self, rollout_id, rollout_data_ref)",
    ),
    "miles.backends.megatron_utils.initialize.init": (
        "(args, indep_dp_store_addr=..., indep_dp_info=...)",
        "(args)",
    ),
    "miles.utils.misc.load_function": ("(path, *, sync_required=...)", "(path)"),
}
# the actor binds these by name: the same difference
for _name, _module in (("initialize_model_and_optimizer", "model"), ("save", "model"), ("init", "initialize")):
    KNOWN_2026_08_DIFFERENCES[f"miles.backends.megatron_utils.actor.{_name}"] = KNOWN_2026_08_DIFFERENCES[
        f"miles.backends.megatron_utils.{_module}.{_name}"
    ]
# Megatron-LM functions the stand-in only names (miles_standin/common/megatron_lm.py): any call raises
MEGATRON_LM_PLACEHOLDERS = {
    "miles.backends.megatron_utils.checkpoint.save_checkpoint",
    "miles.backends.megatron_utils.checkpoint._load_checkpoint_megatron",
    "miles.backends.megatron_utils.model.save_checkpoint",
}
_SIGNATURES = """
import json, pathlib, sys
from miles_lora_ckpt.integration.shapes import detect_shape, render_signature
from miles_lora_ckpt_harness.miles_standin.signature_collect import collect
kind, path, tree = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
if kind == "wheel":
    from miles_lora_ckpt_harness.realmiles import standins
    standins.activate(path)
    standins.install_for_actor()  # the actor module imports SGLang's runtime
else:
    sys.path.insert(0, path)
# the wheel: every name (a module of the 2026-08 shape the wheel does not have is left out); the
# stand-in: what it defines or binds from other miles modules, not its own imports of torch & co
functions, files = collect(tree, scope="all" if kind == "wheel" else "miles", skip_missing=kind == "wheel")
names = {name: render_signature(function) for name, function in functions.items()}
print("RESULT" + json.dumps({"signatures": names, "files": files, "shape": detect_shape().name}))
"""


def _signatures(kind: str, path: str) -> dict:
    import subprocess
    import sys

    from miles_lora_ckpt_harness.miles_standin import shape_path

    tree = shape_path("lora-utils-2026-08")
    proc = subprocess.run(
        [sys.executable, "-c", _SIGNATURES, kind, path, tree], capture_output=True, text=True, timeout=300
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line, proc.stderr[-3000:]
    return json.loads(line[len("RESULT") :])


def signature_drift(standin: dict[str, str], wheel: dict[str, str]) -> dict[str, tuple[str, str | None]]:
    """Every name in both whose stand-in signature differs from the wheel's, except the recorded
    differences when they are exactly as recorded; a placeholder must render `(*args, **kwargs)`."""
    drift = {}
    for name, ours in standin.items():
        real = wheel.get(name)
        if real is None:
            continue  # not in the wheel: nothing to compare with
        if name in MEGATRON_LM_PLACEHOLDERS:
            if ours != "(*args, **kwargs)":
                drift[name] = (ours, real)
        elif name in KNOWN_2026_08_DIFFERENCES:
            if (ours, real) != KNOWN_2026_08_DIFFERENCES[name]:
                drift[name] = (ours, real)
        elif ours != real:
            drift[name] = (ours, real)
    return drift


def test_the_wheel_is_detected_and_the_2026_08_stand_in_agrees_with_its_signatures():
    """inspect.signature of every function/method present in both (issue 19 item 6): save_model(force_sync),
    train(rollout_data_ref), parse_args(add_custom_arguments), ... agree; the harness's own step is not
    named like Miles' train_one_step. Negative control: a drifted or unrecorded signature is reported."""
    from miles_lora_ckpt_harness.miles_standin import shape_path

    wheel = _signatures("wheel", str(TIER))
    assert wheel["shape"] == "miles-rl-0.0.2"
    for module, path in wheel["files"].items():
        assert Path(path).resolve().is_relative_to(TIER), (module, path)
    standin = _signatures("standin", shape_path("lora-utils-2026-08"))
    assert standin["shape"] == "lora-utils-2026-08"
    ours, real = standin["signatures"], wheel["signatures"]
    compared = {name for name in ours if name in real}
    for name in (
        "miles.backends.megatron_utils.actor.MegatronTrainRayActor.save_model",
        "miles.backends.megatron_utils.actor.MegatronTrainRayActor.train",
        "miles.backends.megatron_utils.lora_utils.load_lora_adapter",
        "miles.backends.megatron_utils.initialize.init",
        "miles.utils.arguments.parse_args",
        "miles.utils.misc.should_run_periodic_action",
    ):
        assert name in compared, name
    assert set(KNOWN_2026_08_DIFFERENCES) | MEGATRON_LM_PLACEHOLDERS <= compared  # no stale entry
    assert not signature_drift(ours, real), signature_drift(ours, real)
    # negative control: the stand-in as it was before issue 19 item 6, and a recorded difference that moved
    before = dict(ours)
    before["miles.backends.megatron_utils.actor.MegatronTrainRayActor.save_model"] = "(self, rollout_id)"
    before["miles.utils.arguments.parse_args"] = "(argv=...)"
    before["miles.backends.megatron_utils.model.save"] = "(iteration, model, optimizer, opt_param_scheduler)"
    assert set(signature_drift(before, real)) == {
        "miles.backends.megatron_utils.actor.MegatronTrainRayActor.save_model",
        "miles.utils.arguments.parse_args",
        "miles.backends.megatron_utils.model.save",
    }


def test_the_stand_ins_are_not_importable_outside_the_harness():
    """Importing the plugin (and its Miles hook) installs no stand-in: `import ray` still fails."""
    import subprocess
    import sys

    code = (
        "import miles_lora_ckpt.hooks, miles_lora_ckpt.integration.install\n"
        "import importlib\n"
        f"for name in {sorted({**standins.STANDINS, **standins.ARGUMENT_STANDINS, **standins.ACTOR_STANDINS})!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    raise SystemExit('importable: ' + name)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


@pytest.mark.megatron
@pytest.mark.multirank
def test_demo_runs_the_real_wheel_and_stock_is_the_negative_control(prewarmed, tmp_path, capsys):
    from miles_lora_ckpt_harness.commands import build_parser
    from miles_lora_ckpt_harness.demo import via_miles as demo_miles

    small = ["--world-size", "2", "--steps", "4", "--save-every", "1", "--miles-shape", "miles-rl-0.0.2"]

    def demo(*more: str) -> int:
        args = build_parser().parse_args(["demo", "--via", "miles", *small, *more])
        return demo_miles.run(args, launcher=prewarmed)

    assert demo("--workdir", str(tmp_path / "plugin")) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == "RESULT: bit-exact"
    assert "(miles-rl-0.0.2 real wheel)" in out and "bound to Miles shape miles-rl-0.0.2" in out
    # the wheel's RolloutDataSourceWithBuffer behind the plugin's data source: the same prompts
    assert "drew the same prompts as the reference (the data state of rollout 1 restored" in out
    assert demo("--workdir", str(tmp_path / "stock"), "--without-plugin") == 1
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("RESULT: MISMATCH rollout counter resumed at 0")
    assert "--custom-megatron-init-path" not in out


@pytest.mark.megatron
@pytest.mark.multirank
@pytest.mark.peft
def test_save_hf_on_the_wheel_publishes_the_adapter_though_the_merged_export_fails(prewarmed, tmp_path):
    """The wheel's save_hf_model runs the adapter export (save_lora_checkpoint, the plugin's --save-hf
    publication) after the merged-model export's try block: Bridge's merged export failing (the double
    has no save_hf_pretrained) does not skip it. Every --save-hf adapter is a loadable HF PEFT adapter."""
    from miles_lora_ckpt.tools.peft_tools import load_report
    from miles_lora_ckpt_harness.sim.hf_base import build_tiny_qwen2
    from miles_lora_ckpt_harness.sim.qwen2_model import Qwen2SimConfig

    hf = build_tiny_qwen2(tmp_path / "hf-base", Qwen2SimConfig().hf_config_kwargs())
    run = Run(prewarmed, tmp_path / "run", 2, "dense", hf=hf)
    out = tmp_path / "hf-out"
    # saved through the wheel's own MegatronTrainRayActor.save_model (model.save, then save_hf_model)
    results = ok(run.launch(run.command("--save-hf", str(out / "{rollout_id}")), wheel_actor=True))
    assert results[0]["plugin"]["shape"] == "miles-rl-0.0.2"
    assert f"{ACTOR}.save" in results[0]["plugin"]["bindings"]
    for rollout in range(ROLLOUTS):
        assert not (out / str(rollout) / "config.json").exists()  # the merged export failed (Miles logged it)
        report = load_report(out / str(rollout) / "adapter" / "latest", hf)
        assert report.ok and report.loaded_tensors > 0, (rollout, report.headline())
