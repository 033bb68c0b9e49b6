"""Multi-LoRA in Miles: bindings of both multi-LoRA shapes, startup checks, and kill + resume of two slots.

The unit part binds synthetic Miles module sets (`test_miles_bindings.fake_miles`). The multi-rank
part launches the Miles stand-in's multi-LoRA loop (`miles_standin/common/multi_lora.py`: two
adapters in three slots of the slot model, Miles' per-slot LayerWise chain of real megatron-core
Float16 children, per-slot schedulers; adapter b trains every second round, is retired from slot 1
at its step 2 and registered again into slot 2 once adapter a reached step 4: it resumes into
another slot index, holding exactly what it left with, its co-tenant untouched) with the init hook, SIGKILLs one rank in the
middle of a save, relaunches the same command and compares every slot's adapter, fp32 masters,
moments, steps, param groups and scheduler with an uninterrupted run, digest by digest, under both
Miles shapes (v1 `multi_lora_utils`, v2 `lora/checkpoint.py`). Those launches export every slot
save as an HF PEFT adapter (`--hf-checkpoint` a tiny HF Qwen2 with the slot model's MLP shapes; v1 by
default, v2 with `export.peft = true`), and the real HF PEFT loads each adapter's newest export by the
name Miles' readers use (v1 `step_N`, v2 `current`).
"""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest
from test_miles_bindings import attributes, fake_miles, importer

from miles_lora_ckpt.core import settings
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.integration import bindings, runtime
from miles_lora_ckpt.integration.install import install
from miles_lora_ckpt.integration.multi_lora import slot_filter, supported_kind
from miles_lora_ckpt.integration.shapes import (
    LORA_ACTOR,
    LORA_CHECKPOINT,
    MULTI_LORA_UTILS,
    UnknownMilesShape,
    detect_shape,
)

V1, V2 = "lora-utils-2026-08", "lora-package-2026-09"


@pytest.fixture(autouse=True)
def _clean():
    runtime.set_current(None)
    settings.reset()
    yield
    runtime.set_current(None)
    settings.reset()


def multi_lora_args(**extra) -> Namespace:
    return Namespace(lora_rank=4, multi_lora_n_adapters=2, save_interval=2, **extra)


def test_each_shape_binds_its_multi_lora_functions_and_a_second_install_changes_nothing():
    for shape, module, names, kind in (
        (V1, MULTI_LORA_UTILS, ["save_multi_lora_checkpoints", "_register_adapter", "_deregister_adapter"], "v1"),
        (V2, LORA_CHECKPOINT, ["save_slot", "load_slot"], "v2"),
    ):
        runtime.set_current(None)
        modules = fake_miles(shape)
        originals = {name: getattr(modules[module], name) for name in names}
        rt = install(multi_lora_args(), environ={}, import_module=importer(modules))
        for name in names:
            assert bindings.is_replacement(getattr(modules[module], name)), f"{module}.{name}"
            assert bindings.original_of(getattr(modules[module], name)) is originals[name]
        if shape == V2:  # the actor binds both by name
            assert bindings.is_replacement(modules[LORA_ACTOR].save_slot)
            assert bindings.is_replacement(modules[LORA_ACTOR].load_slot)
        assert supported_kind(b.target.handler for b in bindings.plan(rt.shape, importer(modules)).bindings) == kind
        after = attributes(modules)
        install(multi_lora_args(), environ={}, import_module=importer(modules))
        assert attributes(modules) == after


@pytest.mark.parametrize(
    "shape, qualified, changed",
    [
        (V1, f"{MULTI_LORA_UTILS}._register_adapter", "(adapter, model, optimizer)"),
        (V1, f"{MULTI_LORA_UTILS}.save_multi_lora_checkpoints", "(args, model, adapter_steps, adapters, *, keep=...)"),
        (V2, f"{LORA_CHECKPOINT}.load_slot", "(model, optimizer, slot, path, load_optimizer=...)"),
        (V2, f"{LORA_CHECKPOINT}.save_slot", "(model, optimizer, slot, path, step)"),
    ],
)
def test_an_unknown_multi_lora_signature_is_refused_before_anything_is_patched(shape, qualified, changed):
    modules = fake_miles(shape, {qualified: changed})
    before = attributes(modules)
    with pytest.raises(UnknownMilesShape) as info:
        detect_shape(importer(modules))
    assert f"{qualified}: found {changed}" in str(info.value)
    with pytest.raises(CheckpointError, match="patched nothing"):
        install(multi_lora_args(), environ={}, import_module=importer(modules))
    assert attributes(modules) == before  # single-LoRA names untouched too: all or nothing
    assert runtime.installed() is None


@pytest.mark.parametrize("shape, module", [(V1, MULTI_LORA_UTILS), (V2, LORA_CHECKPOINT)])
def test_a_miles_without_multi_lora_functions_still_binds_single_lora_and_refuses_multi_lora(shape, module):
    modules = fake_miles(shape)
    del modules[module]  # optional targets: the shape is still recognised
    assert detect_shape(importer(modules)).name == shape
    with pytest.raises(CheckpointError) as info:
        install(multi_lora_args(), environ={}, import_module=importer(modules))
    assert "--multi-lora-n-adapters: this Miles has neither multi-LoRA v1's multi_lora_utils" in str(info.value)
    runtime.set_current(None)
    assert install(Namespace(lora_rank=4), environ={}, import_module=importer(modules)).shape.name == shape


@pytest.mark.parametrize(
    "shape, extra, word",
    [
        (V1, {"save_interval": None}, "without --save-interval"),
        (V2, {"use_distributed_optimizer": True}, "--use-distributed-optimizer with multi-LoRA"),
        # a per-slot export needs Bridge (none in this process): refused naming it and the remedy
        (V2, {"peft": True}, "`import megatron.bridge` fails here"),
        (V1, {"peft": True}, "set export.peft = false (or MILES_LORA_CKPT_PEFT_EXPORT=0)"),
    ],
)
def test_startup_refuses_multi_lora_runs_it_cannot_checkpoint(shape, extra, word):
    modules = fake_miles(shape)
    before = attributes(modules)
    args = multi_lora_args()
    vars(args).update(extra)
    environ = {"MILES_LORA_CKPT_PEFT_EXPORT": "1"} if extra.pop("peft", False) else {}
    vars(args).pop("peft", None)
    with pytest.raises(CheckpointError) as info:
        install(args, environ=environ, import_module=importer(modules))
    assert word in str(info.value)
    assert attributes(modules) == before


def test_slot_filter_matches_exactly_one_slot_index():
    keep = slot_filter(1)
    assert keep("chunk0.layers.0.linear_qkv.adapter.adapters.1.linear_in.weight")
    assert not keep("chunk0.layers.0.linear_qkv.adapter.adapters.11.linear_in.weight")
    assert not keep("chunk0.layers.0.linear_qkv.adapter.adapters.0.linear_out.weight")
    assert not keep("chunk0.layers.0.linear_qkv.lora_A.weight")


# --------------------------------------------------------------------------- kill and resume (multi-rank)

JOB = "miles_lora_ckpt_harness.miles_standin.launch_multi_lora:launch_job"
HOOK = ["--custom-megatron-init-path", "miles_lora_ckpt.hooks.megatron_init"]
ADAPTERS = [
    {"name": "a", "steps": 6, "every": 1},
    {"name": "b", "steps": 5, "every": 2, "retire_at": 2, "return_when": {"a": 4}},
]
# b comes back into slot 2 (Miles hands out a free slot), resuming from generations of slot 1
MOVED = [ADAPTERS[0], {**ADAPTERS[1], "return_slot": 2}]
SLOTS = 3


@pytest.fixture(scope="module")
def slot_hf_base(tmp_path_factory):
    """A tiny HF Qwen2 whose MLPs have the slot model's shapes (what its slots export onto)."""
    from miles_lora_ckpt_harness.sim.hf_base import build_tiny_qwen2
    from miles_lora_ckpt_harness.sim.multi_lora_model import MultiLoraSimConfig

    return build_tiny_qwen2(tmp_path_factory.mktemp("slot_hf") / "base", MultiLoraSimConfig().hf_config_kwargs())


class SlotRun:
    def __init__(self, launcher, tmp: Path, shape: str, hf_base: Path | None = None, adapters=ADAPTERS):
        from miles_lora_ckpt_harness.miles_standin import shape_path

        tmp.mkdir(parents=True, exist_ok=True)
        self.launcher, self.shape_dir, self.save = launcher, shape_path(shape), tmp / "run"
        (tmp / "adapters.json").write_text(json.dumps({"adapters": adapters}))
        self.config = tmp / "plugin.toml"
        # PEFT per slot save: v1 exports by default (as stock v1 does), v2 when export.peft asks
        peft = "[export]\npeft = true\n" if hf_base is not None and shape == V2 else ""
        self.config.write_text("[consensus]\ntimeout_s = 60\n" + peft)
        self.argv = HOOK + ["--save", str(self.save), "--save-interval", "2", "--lora-rank", "4", "--bf16"]
        self.argv += ["--multi-lora-n-adapters", str(SLOTS), "--multi-lora-config", str(tmp / "adapters.json")]
        self.argv += ["--num-rollout", "1"]
        self.argv += ["--hf-checkpoint", str(hf_base)] if hf_base is not None else []

    def launch(self, crash=None):
        return self.launcher.run(
            2,
            JOB,
            {"argv": self.argv, "crash": crash},
            env={"MILES_LORA_CKPT_CONFIG": str(self.config)},
            sys_path=[self.shape_dir],
            timeout_s=240,
            failure_grace_s=5.0,
        )


def _over_ranks(results: list[dict], when: str) -> dict[str, list[str]]:
    """Every rank's digests of adapter b's slot `when` ("retired", "joined"): `{key: [digest on
    each rank that holds it]}` (per-child param-group keys collected over the children)."""
    merged: dict[str, list[str]] = {}
    for result in results:
        for key, digest in result[when]["b"]["digests"].items():
            merged.setdefault(key, []).append(digest)
    return {key: sorted(digests) for key, digests in merged.items()}


def _ok(results) -> list[dict]:
    for r in results:
        assert r.ok and not r.result["failed"], f"rank {r.rank}: {r.error or r.result['failed']}\n{r.stderr_tail}"
    return [r.result for r in results]


@pytest.mark.megatron
@pytest.mark.multirank
@pytest.mark.parametrize("shape", [V1, V2])
def test_two_slots_killed_mid_save_and_relaunched_end_bit_identical_to_an_uninterrupted_run(
    prewarmed, tmp_path, shape, slot_hf_base
):
    # b comes back into slot 2 (Miles hands out a free slot), resuming from its slot-1 retire save
    reference = _ok(SlotRun(prewarmed, tmp_path / "reference", shape, adapters=MOVED).launch())
    run = SlotRun(prewarmed, tmp_path / "killed", shape, slot_hf_base, adapters=MOVED)  # exporting PEFT
    # rank 1 dies in the middle of adapter a's step-4 save, after b was retired at its step 2
    crashed = run.launch(crash={"adapter": "a", "step": 4, "rank": 1, "phase": "mid-write", "reason": "periodic"})
    assert any(r.exitcode == -9 for r in crashed), [(r.rank, r.exitcode, r.error) for r in crashed]
    # strays stock Miles would trip over (v1's scan: int("foo") raises) or promote: never chosen, no crash
    slot_root = run.save / "adapters" / "a" / ("checkpoints" if shape == V1 else "")
    for stray in ("step_foo", "step_12_x", "_tmp_step_8", "_version_current_0bad", "_tmp_current"):
        (slot_root / stray).mkdir(parents=True, exist_ok=True)
        (slot_root / stray / "adapter_megatron_tp0_pp0.pt").write_bytes(b"stale")
    resumed = _ok(run.launch())
    for rank in range(2):
        assert resumed[rank]["registered_at"] == {"a": 2, "b": 2}  # a's step-4 save never committed
        assert resumed[rank]["steps"]["a"] == [3, 4, 5, 6] and resumed[rank]["steps"]["b"] == [3, 4, 5]
        assert reference[rank]["steps"]["b"] == [1, 2, 3, 4, 5]  # b left at 2 and came back
        assert resumed[rank]["final_slots"] == reference[rank]["final_slots"] == {"a": 0, "b": 2}
        for adapter in ("a", "b"):
            want, got = reference[rank]["final"][adapter], resumed[rank]["final"][adapter]
            assert sorted(got) == sorted(want)
            assert any(k.startswith("master/") for k in want) and "scheduler" in want
            differing = [k for k in want if got[k] != want[k]]
            assert not differing, f"rank {rank}, adapter {adapter}: {differing[:5]}"
    # the slot index on resume: b left slot 1 and resumed into slot 2 holding exactly what it left
    # with (every rank's adapter, fp32 masters, moments, steps, param groups, scheduler; LayerWise
    # gives slot 2's whole params to other DP ranks than slot 1's, so compare over every rank)
    for results in (reference, resumed):
        assert [r["retired"]["b"]["slot"] for r in results] == [1, 1] and [
            r["joined"]["b"]["slot"] for r in results
        ] == [2, 2]
        left, came_back = _over_ranks(results, "retired"), _over_ranks(results, "joined")
        assert sorted(left) == sorted(came_back) and any(k.endswith("/step") for k in left)  # moments restored
        assert [k for k in left if left[k] != came_back[k]] == []
        assert all(r["cotenants_changed_by_join"] == {"a": []} for r in results)  # slot 0 untouched by it
    if shape == V1:  # each resumed slot's saved scheduler state restored after Miles repositioned it
        # (num_steps = step x 4 samples: a and b both resumed at their step 2; b again when it came back)
        assert resumed[0]["plugin"]["slot_schedulers_restored"] == {"0": 8, "1": 8, "2": 8}
        assert reference[0]["plugin"]["slot_schedulers_restored"] == {"2": 8}  # b re-registered from its retire save
    if shape == V1:  # Miles' own scan, replaced: the agreed newest generation, through its step_N link
        latest = resumed[0]["find_latest"]
        assert latest["a"] == [str(run.save / "adapters" / "a" / "checkpoints" / "step_6"), 6]
        assert latest["b"][1] == 4  # b: steps 2 (periodic, then its retire save) and 4; 5 is not a multiple of 2
    bindings_seen = resumed[0]["plugin"]["bindings"]
    wanted = ("save_multi_lora_checkpoints", "_deregister_adapter") if shape == V1 else ("save_slot", "load_slot")
    assert all(any(b.endswith("." + name) for b in bindings_seen) for name in wanted)
    link = slot_root / ("step_6" if shape == V1 else "current")
    assert link.is_symlink() and (link / "manifest.json").is_file()
    assert not [p.name for p in slot_root.iterdir() if p.name.startswith(".staging-")]
    # every slot save exported the slot; the real HF PEFT loads each adapter's newest export as is,
    # by the name Miles' readers use (v1 step_N: stock v1's file names; v2 the name save_slot was given)
    from miles_lora_ckpt.tools.peft_tools import load_report

    for adapter, name in (("a", "step_6"), ("b", "step_4")):
        root = run.save / "adapters" / adapter / ("checkpoints" if shape == V1 else "")
        generations = [p for p in root.iterdir() if p.name.startswith("gen-")]
        assert generations and all((g / "adapter_model.safetensors").is_file() for g in generations), adapter
        report = load_report(root / (name if shape == V1 else "current"), slot_hf_base)
        assert report.ok and report.headline() == "PEFT: loadable (0 missing, 0 unexpected)", report.headline()
        assert report.loaded_tensors == 2 * 3 * 2  # lora_A/B of gate, up, down in both layers
        config = json.loads((root / (name if shape == V1 else "current") / "adapter_config.json").read_text())
        assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "gate_proj", "up_proj"]


# --------------------------------------------------------------------------- the demo


def test_demo_via_miles_slots_usage_errors_exit_2_before_any_worker(tmp_path, capsys):
    from miles_lora_ckpt.tools.cli import main as cli

    base = ["demo", "--via", "miles", "--workdir", str(tmp_path)]
    cases = {
        ("--slots", "1"): "needs 2 to 4 slots",
        ("--slots", "2", "--miles-shape", "positional-args-pr"): "has no multi-LoRA",
        ("--slots", "2", "--pp", "2"): "--pp/--ep/--cp/--vpp 1",
        ("--slots", "2", "--dtype", "fp32"): "Adam per slot in bf16",
        ("--slots", "2", "--without-plugin", "--crash-at", "after-publish"): "only before-write, mid-write",
        ("--slots", "2", "--without-plugin", "--export-peft"): "stock multi-LoRA writes no PEFT files",
    }
    for flags, words in cases.items():
        assert cli([*base, *flags]) == 2, flags
        assert words in capsys.readouterr().err, flags
    assert not (tmp_path / "miles-slots").exists()


@pytest.mark.megatron
@pytest.mark.multirank
def test_demo_via_miles_slots_resumes_every_slot_bit_exact(prewarmed, tmp_path, capsys):
    from miles_lora_ckpt_harness.commands import build_parser
    from miles_lora_ckpt_harness.demo import via_miles as demo_miles

    argv = ["demo", "--via", "miles", "--slots", "2", "--miles-shape", V2, "--steps", "6", "--workdir", str(tmp_path)]
    assert demo_miles.run(build_parser().parse_args([*argv, "--export-peft"]), launcher=prewarmed) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "RESULT: bit-exact"
    for slot in ("s0", "s1"):  # each slot's newest export, loaded with the real HF PEFT
        assert f"  slot of {slot}: run/adapters/{slot}/current: PEFT: loadable (0 missing, 0 unexpected)" in lines
    assert "  slot of s0: resumed at step 2, trained to 6: bit-exact" in lines  # s0's step-4 save was killed
    assert "  slot of s1: resumed at step 2, trained to 6: bit-exact" in lines
    assert any("rank 1: killed by signal 9" in line for line in lines)


def test_v1_slot_scheduler_gets_its_saved_state_after_miles_repositions_it():
    """The loader restores into a capture (Miles installs the slot's scheduler only after
    `_register_adapter`); `load_adapters` then puts the saved state into the scheduler Miles
    installed: every field of the saved one, bit for bit, whatever Miles repositioned it to."""
    from types import SimpleNamespace

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from miles_lora_ckpt.integration import multi_lora
    from miles_lora_ckpt.integration.config import load_config
    from miles_lora_ckpt.integration.shapes import SHAPES_BY_NAME
    from miles_lora_ckpt.megatron.scheduler import reposition_scheduler, restore_scheduler, scheduler_state

    def scheduler():
        groups = SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0}])
        return OptimizerParamScheduler(
            groups, init_lr=1e-3, max_lr=1e-2, min_lr=1e-4, lr_warmup_steps=8, lr_decay_steps=40,
            lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=40, wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False,
        )  # fmt: skip

    runtime.set_current(runtime.Runtime(Namespace(), load_config({}), SHAPES_BY_NAME[V1]))
    trained = scheduler()
    for _ in range(5):
        trained.step(increment=3)  # 15 samples: not what a reposition from the step count gives
    capture = multi_lora._SchedulerCapture()
    restore_scheduler(capture, scheduler_state(trained))  # what the slot load does with it
    reposition_scheduler(multi_lora._SchedulerCapture(), 4, 4)  # a reposition leaves nothing to restore
    installed = scheduler()
    installed.step(increment=4 * 4)  # Miles' install_slot_scheduler: resume_step x samples
    assert installed.state_dict() != trained.state_dict()  # the negative control
    optimizer = SimpleNamespace(miles_slot_schedulers={1: installed})
    assert multi_lora._restore_slot_schedulers(optimizer, {1: capture.saved}) == {1: 15}
    assert installed.state_dict() == trained.state_dict()
    assert installed.optimizer.param_groups == trained.optimizer.param_groups  # lr and wd, exactly
    with pytest.raises(multi_lora.UnsupportedConfiguration, match=r"no scheduler for slot\(s\) \[0\]"):
        multi_lora._restore_slot_schedulers(SimpleNamespace(miles_slot_schedulers={}), {0: capture.saved})


# --------------------------------------------------------------------------- each adapter's data state

MULTI_DATA_SOURCE = "miles_lora_ckpt.hooks.CheckpointedMultiLoRADataSource"
STOCK_MULTI_DATA_SOURCE = "miles.rollout.multi_lora.data_source.MultiLoRAAsyncDataSource"  # the v2 stand-in's
# Miles 2026-08 (v1) has the same class at the same path; the v1 stand-in tree has no `rollout/`, so a v1
# launch names the class both trees share
STOCK_MULTI_DATA_SOURCE_V1 = (
    "miles_lora_ckpt_harness.miles_standin.common.multi_lora_data_source.MultiLoRAAsyncDataSource"
)
PROMPT_FILES = {"a": 10, "b": 7}  # prompts per adapter; 2 groups a step (4 samples, 2 per prompt): both wrap
A_STEP_6 = {"adapter": "a", "step": 6, "rank": 1, "phase": "mid-write", "reason": "periodic"}


def _prompted_run(launcher, tmp: Path, data_source: str, shape: str = V2) -> tuple[SlotRun, Path]:
    """The two-slot run of `shape`, each adapter drawing from its own prompt file through `data_source`."""
    from miles_lora_ckpt_harness.miles_standin.common.rollout import write_prompts

    tmp.mkdir(parents=True, exist_ok=True)
    adapters = [{**a, "data": str(write_prompts(tmp / f"{a['name']}.jsonl", PROMPT_FILES[a["name"]]))} for a in MOVED]
    run = SlotRun(launcher, tmp, shape, adapters=adapters)
    run.argv += ["--data-source-path", data_source]
    if shape == V1:  # the class the plugin's data source wraps (data_state.multi_lora_source)
        stock = f'[data_state]\nmulti_lora_source = "{STOCK_MULTI_DATA_SOURCE_V1}"\n'
        run.config.write_text(run.config.read_text() + stock)
    return run, tmp / "prompts.jsonl"


def _launch_logged(run: SlotRun, log: Path, crash=None):
    return run.launcher.run(
        2,
        JOB,
        {"argv": run.argv, "crash": crash, "prompts_log": str(log)},
        env={"MILES_LORA_CKPT_CONFIG": str(run.config)},
        sys_path=[run.shape_dir],
        timeout_s=240,
        failure_grace_s=5.0,
    )


def _launches(log: Path) -> list[dict]:
    """The prompt log per launch (a launch starts where a step repeats or goes back): [{(adapter, step): prompts}]."""
    launches: list[dict] = [{}]
    last: dict[str, int] = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        if entry["step"] <= last.get(entry["adapter"], 0):
            launches.append({})
            last = {}
        last[entry["adapter"]] = entry["step"]
        launches[-1][(entry["adapter"], entry["step"])] = entry["prompts"]
    return launches


def _uninterrupted(adapter: str, step: int) -> list[int]:
    """What an adapter's source that never restarts hands step `step` (1-based): the next 2 prompts, wrapping."""
    return [(2 * (step - 1) + i) % PROMPT_FILES[adapter] for i in range(2)]


@pytest.mark.megatron
@pytest.mark.multirank
@pytest.mark.parametrize("shape", [V1, V2])
def test_each_adapter_resumes_its_own_prompt_cursor_after_a_kill_and_after_a_retire(prewarmed, tmp_path, shape):
    # with the plugin: launch 1 trains a to 6 (killed in its step-6 save) and b 1, 2, retired, back, 3;
    # launch 2 resumes a at 4 and b at 2 (its retire save); every step draws what an uninterrupted source draws.
    # v1 (multi_lora_utils) commits the state in its periodic and retire saves as v2's save_slot does
    run, log = _prompted_run(prewarmed, tmp_path / "plugin", MULTI_DATA_SOURCE, shape)
    crashed = _launch_logged(run, log, crash=A_STEP_6)
    assert any(r.exitcode == -9 for r in crashed), [(r.rank, r.exitcode, r.error) for r in crashed]
    resumed = _ok(_launch_logged(run, log))
    assert resumed[0]["registered_at"] == {"a": 4, "b": 2}
    first, second = _launches(log)
    assert sorted(first) == [("a", s) for s in range(1, 7)] + [("b", s) for s in (1, 2, 3)]
    assert sorted(second) == [("a", 5), ("a", 6)] + [("b", s) for s in (3, 4, 5)]
    for launch in (first, second):
        for (adapter, step), prompts in launch.items():
            assert prompts == _uninterrupted(adapter, step), (adapter, step, prompts)
    # every slot generation holds its adapter's data state at its own step, and verifies
    from miles_lora_ckpt.core.verify import verify_generation

    seen = set()
    for adapter in ("a", "b"):
        slot_root = run.save / "adapters" / adapter / ("checkpoints" if shape == V1 else "")
        for path in sorted(slot_root.glob("gen-*")):
            generation = verify_generation(path)
            assert generation.intact, (path, generation.problems)
            step = generation.manifest.iteration
            doc = json.loads((path / "rollout_data_state.json").read_text())
            cursor = 2 * step % PROMPT_FILES[adapter]
            assert (doc["adapter"], doc["rollout_id"], doc["state"]["value"]["offset"]) == (adapter, step, cursor)
            seen.add((adapter, step))
    assert {("a", 4), ("a", 6), ("b", 2), ("b", 4)} <= seen
    if shape == V1:
        return  # the stock control below: the same data source class under both shapes

    # stock Miles' data source (negative control): b's source is rebuilt at offset 0 when it comes back,
    # and every source at a relaunch
    stock, stock_log = _prompted_run(prewarmed, tmp_path / "stock", STOCK_MULTI_DATA_SOURCE)
    _launch_logged(stock, stock_log, crash=A_STEP_6)
    _ok(_launch_logged(stock, stock_log))
    first, second = _launches(stock_log)
    assert first[("b", 3)] == [0, 1] != _uninterrupted("b", 3)  # retired and registered again: offset 0
    assert second[("a", 5)] == [0, 1] != _uninterrupted("a", 5)  # relaunched: offset 0
    assert second[("b", 3)] == [0, 1]
