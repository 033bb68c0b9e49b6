"""PEFT export through Miles: `export.peft` and `--save-hf` (integration/peft.py).

Units (one process, no megatron workers): what the init hook's `peft.prepare` refuses at startup,
naming the key or flag and the remedy, and what it builds; how the replaced `save_lora_checkpoint`
routes Miles' `--save-hf` call; the `--save-hf` export root (`latest`, the writer lease released
after every export, a failed export publishing nothing).

One multi-rank test on the Miles stand-in (CPU, gloo, W=2): every launch runs the stand-in's train
loop with the plugin's init hook on the Qwen2-shaped harness model (picked by `--hf-checkpoint`, a
tiny HF Qwen2 built from a config, no hub), with the Bridge double installed as `megatron.bridge`
in every rank, as Miles' GPU image has Bridge. The exported adapters are loaded with the real HF
PEFT onto that base, in this process. Four launches: export on (a PEFT-phase fault fails a save on
every rank), the identical relaunch (Miles' merged HF export fails at one rollout: `save_hf_model`
returns before the adapter export, as Miles 2026-08 does, and the generation is unaffected), export
off in another Miles shape with the fork's Bridge (a fault in `--save-hf`'s adapter export is logged
by Miles and publishes nothing; a merged-export failure at another rollout skips its adapter), and a
Miles without Bridge (refused at startup).

With the real Megatron-Bridge importable (Miles' GPU image), `prepare` builds it from a tiny HF base.

In the Bridge tier, `test_export_peft_and_save_hf_through_miles_with_the_real_bridge` runs the first
two launches with the REAL Megatron-Bridge 0.6.2 building the stand-in's model (a tiny Qwen2, fp32)
and exporting it. The other launches keep the double, each for a reason: the fork's three-item
tuples (no installable Bridge yields them), a Miles without Bridge (no Bridge at all), and the
bf16 Qwen2-shaped harness model (our LoRA, which 0.6.2 cannot export) for tiers 1 and 2.
"""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch
from jobs_paths import TESTS

from miles_lora_ckpt.core import faults, lease
from miles_lora_ckpt.core.checked_reads import load_tensors
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import LEASE
from miles_lora_ckpt.core.verify import committed_candidates, verify_generation
from miles_lora_ckpt.integration import peft, runtime, single_lora
from miles_lora_ckpt.integration.config import load_config
from miles_lora_ckpt.integration.shapes import SHAPES_BY_NAME
from miles_lora_ckpt.integration.startup import UnsupportedConfiguration
from miles_lora_ckpt.megatron import bridge_export
from miles_lora_ckpt.savers.peft_export import (
    LATEST,
    WEIGHTS_NAME,
    ExportedWeight,
    LoraSpec,
    PeftExport,
    StaticSource,
    check_peft_dir,
)
from miles_lora_ckpt_harness.miles_standin import shape_path

# =========================================================================== units: startup

SHAPE = SHAPES_BY_NAME["lora-package-2026-09"]
CONTEXT = "miles.utils.megatron_bridge_utils"


@contextmanager
def patch_megatron_model(model):  # what Miles' context manager is to the plugin: fn(model) -> context
    yield


def miles_modules(**extra) -> dict[str, ModuleType]:
    module = ModuleType(CONTEXT)
    module.patch_megatron_model = patch_megatron_model
    return {CONTEXT: module, **extra}


def importer(modules: dict[str, ModuleType]):
    def import_module(name: str):
        if name not in modules:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return modules[name]

    return import_module


class FakeAutoBridge:
    """Only what `BridgeSource.prepare` touches: `from_hf_pretrained` and the export's signature."""

    built: list = []

    @classmethod
    def from_hf_pretrained(cls, path, **kwargs):
        if not Path(path, "config.json").is_file():
            raise FileNotFoundError(f"{path}/config.json")
        cls.built.append((path, kwargs))
        return cls()

    def export_adapter_weights(self, model, cpu=True, show_progress=True):
        yield from ()


@pytest.fixture
def fake_bridge(monkeypatch, tmp_path):
    """An importable Bridge under a name that is NOT `megatron.bridge`, and an HF base directory."""
    module = ModuleType("fake_bridge_of_test_miles_peft")
    module.AutoBridge = FakeAutoBridge
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(bridge_export, "BRIDGE_MODULE", module.__name__)
    FakeAutoBridge.built = []
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    return tmp_path / "hf"


def lora_args(hf, **changes) -> Namespace:
    args = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, hf_checkpoint=str(hf), save_hf=None)
    return Namespace(**(args | changes))


def prepare(args, environ, modules=None, *, lora=True, bridge_error=lambda: None):
    return peft.prepare(
        args,
        load_config(environ),
        SHAPE,
        lora=lora,
        import_module=importer(miles_modules() if modules is None else modules),
        bridge_error=bridge_error,
    )


ON = {"MILES_LORA_CKPT_PEFT_EXPORT": "1"}


def test_nothing_is_checked_or_built_when_nothing_exports(tmp_path):
    def no_bridge_check():
        raise AssertionError("Bridge must not be looked at when nothing exports")

    assert prepare(lora_args(tmp_path / "absent"), {}, {}, bridge_error=no_bridge_check) is None
    # a full-model run's --save-hf is Miles' own HF export: not ours to check
    full = lora_args(None, lora_rank=0, save_hf="/out/{rollout_id}")
    assert prepare(full, {}, {}, lora=False, bridge_error=no_bridge_check) is None


def test_export_peft_builds_bridge_once_at_startup_with_miles_context(fake_bridge):
    export = prepare(lora_args(fake_bridge), ON)
    assert isinstance(export, PeftExport) and FakeAutoBridge.built == [(str(fake_bridge), {"trust_remote_code": True})]
    assert isinstance(export.source.bridge, FakeAutoBridge) and export.source.model_context is patch_megatron_model
    assert export.lora == LoraSpec(r=4, alpha=8.0, dropout=0.0, base_model_name_or_path=str(fake_bridge))
    # --save-hf alone (export.peft off) needs the same export
    assert prepare(lora_args(fake_bridge, save_hf="/out/{rollout_id}"), {}) is not None


@pytest.mark.parametrize(
    "case, words",
    [
        ("no-bridge", "`import megatron.bridge` fails here: ModuleNotFoundError: No module named 'megatron.bridge'"),
        ("no-hf-checkpoint", "--hf-checkpoint is not set: pass the HF base model"),
        ("no-lora-rank", "--lora-rank is not set: the adapter's rank"),
        ("no-lora-run", "--lora-rank is not set (this run trains no LoRA adapter, so there is nothing to export)"),
        ("no-context-module", f"Miles shape 'lora-package-2026-09': {CONTEXT} cannot be imported"),
        ("no-context-function", f"{CONTEXT}.patch_megatron_model is absent"),
        ("shape-without-context", "names no context manager for Bridge calls"),
        ("bridge-cannot-build", "Megatron-Bridge cannot be built from --hf-checkpoint"),
    ],
)
def test_what_cannot_export_is_refused_naming_the_flag_and_the_remedy(fake_bridge, tmp_path, case, words):
    args, modules, lora, shape = lora_args(fake_bridge), miles_modules(), True, SHAPE
    bridge_error = (lambda: "ModuleNotFoundError: No module named 'megatron.bridge'") if case == "no-bridge" else None
    if case == "no-hf-checkpoint":
        args.hf_checkpoint = None
    if case in ("no-lora-rank", "no-lora-run"):
        args.lora_rank, lora = 0, case == "no-lora-rank"  # no-lora-rank: --lora-adapter-path alone
    if case == "no-context-module":
        modules = {}
    if case == "no-context-function":
        modules = {CONTEXT: ModuleType(CONTEXT)}
    if case == "shape-without-context":
        shape = replace(SHAPE, bridge_model_context=None)
    if case == "bridge-cannot-build":
        args.hf_checkpoint = str(tmp_path / "not-an-hf-model")
    with pytest.raises(UnsupportedConfiguration) as info:
        peft.prepare(
            args,
            load_config(ON),
            shape,
            lora=lora,
            import_module=importer(modules),
            bridge_error=bridge_error or (lambda: None),
        )
    text = str(info.value)
    assert text.startswith(
        "miles-lora-ckpt cannot export PEFT adapters for export.peft = true ($MILES_LORA_CKPT_PEFT_EXPORT)"
    )
    assert words in text, text
    assert text.endswith("Fix the above, or set export.peft = false (or MILES_LORA_CKPT_PEFT_EXPORT=0).")
    assert FakeAutoBridge.built == []


def test_multi_lora_slot_exports_v1_by_default_when_it_can_and_refuses_a_bridge_without_slots(fake_bridge, caplog):
    def slot_prepare(environ, multi, slot_error=lambda: None, args=None):
        return peft.prepare(
            args or lora_args(fake_bridge),
            load_config(environ),
            SHAPE,
            lora=True,
            multi_lora=multi,
            import_module=importer(miles_modules()),
            bridge_error=lambda: None,
            slot_error=slot_error,
        )

    no_slots = lambda: "ModuleNotFoundError: No module named 'megatron.bridge.peft'"  # noqa: E731
    # v1, export.peft at its default: stock v1 writes PEFT files in every step_N, so the plugin exports
    assert isinstance(slot_prepare({}, "v1"), PeftExport) and len(FakeAutoBridge.built) == 1
    assert peft.exports_slots(load_config({}), "v1", lora=True)
    # ... and when it cannot, it says why (a warning) and runs without: nothing is built
    with caplog.at_level("WARNING", logger="miles_lora_ckpt.integration"):
        assert slot_prepare({}, "v1", no_slots) is None
        assert slot_prepare({}, "v1", args=lora_args(fake_bridge, hf_checkpoint=None)) is None
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and all("the slot checkpoints will hold no PEFT adapter" in w for w in warned)
    assert "expose_adapter_slot" in warned[0] and "--hf-checkpoint is not set" in warned[1]
    assert len(FakeAutoBridge.built) == 1
    # export.peft = false set explicitly: off, Bridge never looked at; v2 (stock writes none): off by default
    off = {"MILES_LORA_CKPT_PEFT_EXPORT": "0"}
    assert slot_prepare(off, "v1") is None and not peft.exports_slots(load_config(off), "v1", lora=True)
    assert slot_prepare({}, "v2") is None and not peft.exports_slots(load_config({}), "v2", lora=True)
    assert peft.exports_slots(load_config(ON), "v2", lora=True)
    assert len(FakeAutoBridge.built) == 1
    # export.peft = true: a Bridge without expose_adapter_slot is refused, naming it and the remedy
    with pytest.raises(UnsupportedConfiguration) as info:
        slot_prepare(ON, "v2", no_slots)
    assert "megatron.bridge.peft.multi_lora_layers.expose_adapter_slot, which this Bridge lacks" in str(info.value)
    from miles_lora_ckpt.megatron.bridge_export import bridge_version

    # ... naming the installed Bridge's version and how to get one that has it
    assert f"(megatron-bridge {bridge_version()}: ModuleNotFoundError" in str(info.value)
    assert "install a Megatron-Bridge that has megatron.bridge.peft.multi_lora_layers" in str(info.value)
    assert str(info.value).endswith("set export.peft = false (or MILES_LORA_CKPT_PEFT_EXPORT=0).")


def test_save_hf_refusal_names_the_flag_and_its_remedy(tmp_path):
    args = lora_args(tmp_path, save_hf="/out/{rollout_id}", hf_checkpoint=None)
    with pytest.raises(UnsupportedConfiguration) as info:
        prepare(args, {}, bridge_error=lambda: "ModuleNotFoundError: No module named 'megatron.bridge'")
    text = str(info.value)
    assert "for --save-hf /out/{rollout_id}:" in text and "export.peft" not in text
    assert "import megatron.bridge" in text and "--hf-checkpoint is not set" in text
    assert text.endswith("Fix the above, or drop --save-hf.")


# =========================================================================== units: Miles' --save-hf call


def miles_save_lora_checkpoint(model, args, save_dir, *, optimizer=None, opt_param_scheduler=None, iteration=None):
    raise AssertionError("the plugin replaces Miles' save_lora_checkpoint")


@pytest.fixture
def rt():
    from miles_lora_ckpt.integration.config import defaults

    current = runtime.Runtime(Namespace(save="/ckpt"), defaults(), SHAPE)
    current.peft = object()
    current.saved = {0: "/ckpt/lora/gen-0", 3: "/ckpt/lora/gen-3"}
    runtime.set_current(current)
    yield current
    runtime.set_current(None)


def test_save_hf_call_publishes_into_an_export_root_at_the_last_saved_rollout(rt, monkeypatch):
    calls = []
    monkeypatch.setattr(peft, "publish_save_hf_adapter", lambda *a, **k: calls.append(("peft", a, k)) or "/hf/3/x")
    monkeypatch.setattr(single_lora, "save_adapter_generation", lambda *a, **k: calls.append(("saver", a, k)))
    replacement = single_lora.save_lora_checkpoint(miles_save_lora_checkpoint, None)
    model = ["chunk"]
    assert replacement(model, rt.args, "/hf/3/adapter") == "/hf/3/x"  # hf_export.save_hf_model's call
    assert calls == [("peft", (rt.peft, model, "/hf/3/adapter"), {"iteration": 3, "keep": None})]
    # with an optimizer (any other caller): a checkpoint generation, holding peft/ only with export.peft
    calls.clear()
    replacement(model, rt.args, "/elsewhere", optimizer="opt", iteration=5)
    options = calls[0][1][3]  # save_adapter_generation(model, args, save_dir, options, ...)
    assert (
        calls[0][0] == "saver" and options.peft is None and options.iteration == 5 and calls[0][2]["optimizer"] == "opt"
    )
    rt.config = load_config(ON)
    calls.clear()
    replacement(model, rt.args, "/elsewhere", optimizer="opt", iteration=5)
    assert calls[0][1][3].peft is rt.peft


def weights(seed: int) -> list[ExportedWeight]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(2):
        for module, size in (("self_attn.q_proj", 8), ("self_attn.v_proj", 4)):
            base = f"model.layers.{layer}.{module}"
            out.append(ExportedWeight(f"{base}.lora_A.weight", torch.randn(2, 8, generator=gen)))
            out.append(ExportedWeight(f"{base}.lora_B.weight", torch.randn(size, 2, generator=gen)))
    return out


def test_save_hf_export_root_moves_latest_releases_the_lease_and_publishes_nothing_on_failure(tmp_path):
    root = tmp_path / "hf-out" / "adapter"
    spec = LoraSpec(r=2, alpha=4.0)
    first = peft.publish_save_hf_adapter(PeftExport(StaticSource(weights(1)), spec), None, root, iteration=1, keep=None)
    assert (root / LATEST).resolve() == first and check_peft_dir(root / LATEST) == []
    assert not (root / LEASE).exists() and not lease.holds(root)  # each --save-hf export gives the root up
    second = peft.publish_save_hf_adapter(
        PeftExport(StaticSource(weights(2)), spec), None, root, iteration=2, keep=None
    )
    assert (root / LATEST).resolve() == second != first and not (root / LEASE).exists()
    faults.arm("peft-export", 0)
    try:
        with pytest.raises(CheckpointError, match="peft-export"):
            peft.publish_save_hf_adapter(PeftExport(StaticSource(weights(3)), spec), None, root, iteration=3, keep=1)
    finally:
        faults.disarm()
    assert (root / LATEST).resolve() == second and not (root / LEASE).exists()  # failed: nothing moved
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(("gen-", ".staging"))) == sorted(
        [first.name, second.name]
    )


# =========================================================================== the Miles stand-in, W=2

JOB = "miles_lora_ckpt_harness.miles_standin.launch:launch_job"
HOOK = ["--custom-megatron-init-path", "miles_lora_ckpt.hooks.megatron_init"]
ROLLOUTS = 3  # x 2 optimizer steps, a save after every rollout


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    from miles_lora_ckpt_harness.sim.hf_base import build_tiny_qwen2
    from miles_lora_ckpt_harness.sim.qwen2_model import Qwen2SimConfig

    return build_tiny_qwen2(tmp_path_factory.mktemp("qwen2") / "hf-base", Qwen2SimConfig().hf_config_kwargs())


class Launch:
    """One run directory: --save/--load, --save-hf, the plugin config (export.peft = true), a shape."""

    def __init__(self, launcher, directory: Path, hf: Path, shape: str, bridge: str | None = "nvidia"):
        self.launcher, self.dir, self.hf, self.shape, self.bridge = launcher, directory, hf, shape, bridge
        self.save, self.hf_out = directory / "run", directory / "hf-out"
        self.config = directory / "plugin.toml"
        directory.mkdir(parents=True)
        self.config.write_text("[consensus]\ntimeout_s = 60\n[export]\npeft = true\n")

    def command(self, target_modules: str = "all-linear", bf16: bool = True) -> list[str]:
        return HOOK + [
            *("--megatron-to-hf-mode", "bridge", "--hf-checkpoint", str(self.hf)),
            *(("--bf16",) if bf16 else ()),
            *(
                "--num-rollout",
                str(ROLLOUTS),
                "--lora-rank",
                "4",
                "--lora-alpha",
                "8",
                "--target-modules",
                target_modules,
            ),
            *("--save", str(self.save), "--load", str(self.save), "--save-interval", "1"),
            *("--save-hf", str(self.hf_out / "{rollout_id}")),
            *("--custom-megatron-post-save-hook-path", "miles_hooks.record_post_save"),
        ]

    def run(self, argv, crash=None, env=None, hf_merged_fails=()):
        return self.launcher.run(
            2,
            JOB,
            {"argv": argv, "crash": crash, "bridge": self.bridge, "hf_merged_fails": list(hf_merged_fails)},
            env={"MILES_LORA_CKPT_CONFIG": str(self.config), **(env or {})},
            sys_path=[shape_path(self.shape), TESTS],
            timeout_s=400 if self.bridge == "real" else 240,
            failure_grace_s=5.0,
        )

    def generations(self) -> list[Path]:
        """Committed generations of the save root, newest first."""
        return committed_candidates(self.save / "lora")[0]


def ok(results) -> list[dict]:
    for r in results:
        assert r.ok and not r.result["failed"], f"rank {r.rank}: {r.error or r.result['failed']}\n{r.stderr_tail}"
    return [r.result for r in results]


def failures(results) -> list[str]:
    texts = [r.error if not r.ok else r.result["failed"] for r in results]
    assert all(texts), "every rank must fail"
    return texts


def loads_in_peft(adapter_dir: Path, hf: Path) -> None:
    from miles_lora_ckpt.tools.peft_tools import load_report

    report = load_report(adapter_dir, hf)
    assert report.ok and report.loaded_tensors > 0, report.headline()
    assert report.headline() == "PEFT: loadable (0 missing, 0 unexpected)"


def holds_peft(generation: Path) -> bool:
    files = verify_generation(generation)
    assert files.intact, files.problems
    return any(name.startswith("peft/") for name in files.manifest.files)


def adapter_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_tensors(directory / WEIGHTS_NAME)[0]


@pytest.mark.megatron
@pytest.mark.multirank
@pytest.mark.peft
def test_export_peft_and_save_hf_through_miles(prewarmed, tmp_path, hf_base):
    # --- export.peft = true, --save-hf, a user's post-save hook; rank 1 raises inside the PEFT export of
    # rollout 1's save: that save fails on every rank with the same error; rollout 0 stays committed
    on = Launch(prewarmed, tmp_path / "on", hf_base, "lora-package-2026-09")
    crash = {"rollout": 1, "rank": 1, "phase": "peft-export", "action": "raise"}
    crashed = on.run(on.command(), crash=crash)
    errors = failures(crashed)
    assert all("CheckpointError" in e and "peft-export" in e and "injected fault" in e for e in errors), errors[0]
    assert [r.result["rollouts"] for r in crashed] == [[0, 1]] * 2
    generations = on.generations()
    assert [verify_generation(g).manifest.iteration for g in generations] == [0]
    assert holds_peft(generations[0])
    assert not list((on.save / "lora").glob(".staging-*"))  # the failed attempt left nothing behind
    loads_in_peft(generations[0] / "peft", hf_base)
    # --save-hf: <dir>/adapter is an export root whose `latest` PEFT loads; the failed save never got there
    assert (on.hf_out / "0" / ".complete").exists() and not (on.hf_out / "1").exists()
    loads_in_peft(on.hf_out / "0" / "adapter" / "latest", hf_base)
    same = adapter_tensors(generations[0] / "peft"), adapter_tensors(on.hf_out / "0" / "adapter" / "latest")
    assert sorted(same[0]) == sorted(same[1]) and all(torch.equal(same[0][k], same[1][k]) for k in same[0])
    record = json.loads((on.save / "post_save_0.json").read_text())
    assert record == {"checkpoint_dir": str(generations[0]), "hf_checkpoint_dir": str(on.hf_out / "0")}
    # every export ran inside Miles' patch_megatron_model: rollout 0 (peft/ and --save-hf), rollout 1's peft/
    assert all(r.result["bridge_context_entries"] == 3 for r in crashed)

    # --- the identical command resumes from rollout 0's generation; every save holds peft/ again. Miles'
    # merged HF export (Bridge) fails at rollout 1 on every rank: save_hf_model logs it and returns before
    # the adapter export, as Miles does, so <save-hf>/1/adapter is not published and gets no .complete;
    # rollout 1's generation (written by the save before it) is committed, verifies and holds peft/
    resumed = on.run(on.command(), hf_merged_fails=[1])
    assert all("save_hf_model failed for rollout 1: merged HF export" in r.stderr_tail for r in resumed)
    resumed = ok(resumed)
    assert all(r["start_rollout_id"] == 1 and r["rollouts"] == [1, 2] for r in resumed)
    assert [verify_generation(g).manifest.iteration for g in on.generations()] == [2, 1, 0]
    assert all(holds_peft(g) for g in on.generations())
    loads_in_peft(on.generations()[1] / "peft", hf_base)
    assert not (on.hf_out / "1" / "adapter").exists() and not (on.hf_out / "1" / ".complete").exists()
    assert (on.hf_out / "2" / ".complete").exists()  # the next rollout's --save-hf export works
    assert check_peft_dir(on.hf_out / "2" / "adapter" / "latest") == []
    loads_in_peft(on.hf_out / "2" / "adapter" / "latest", hf_base)

    # --- export.peft = false (the environment wins over the file), another Miles shape, the fork's Bridge
    # (three-item tuples), Miles' HF spellings of the targets: no peft/ anywhere, and --save-hf still
    # publishes; a fault in rollout 1's --save-hf adapter export raises on every rank inside Miles'
    # save_hf_model, which logs it and goes on: rollout 1 gets no .complete and no export, nothing
    # half-published. The 2026-08 save_hf_model's early return: Miles' merged export fails at rollout 0, so
    # rollout 0's adapter export never runs (no <save-hf>/0/adapter, no .complete); its generation stands
    off = Launch(prewarmed, tmp_path / "off", hf_base, "lora-utils-2026-08", bridge="fork")
    crash = {"rollout": 1, "rank": 0, "phase": "peft-export", "action": "raise"}
    targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    env = {"MILES_LORA_CKPT_PEFT_EXPORT": "0"}
    done = off.run(off.command(targets), crash=crash, env=env, hf_merged_fails=[0])
    assert all(r["rollouts"] == [0, 1, 2] for r in ok(done))
    assert all("save_hf_model failed for rollout 0: merged HF export" in r.stderr_tail for r in done)
    assert all("save_hf_model failed for rollout 1: LoRA adapter export" in r.stderr_tail for r in done)
    assert [verify_generation(g).manifest.iteration for g in off.generations()] == [2, 1, 0]
    assert not any(holds_peft(g) for g in off.generations())
    assert not (off.hf_out / "0" / "adapter").exists() and not (off.hf_out / "0" / ".complete").exists()
    assert not (off.hf_out / "1" / ".complete").exists()
    assert sorted(p.name for p in (off.hf_out / "1" / "adapter").iterdir()) == []
    assert (off.hf_out / "2" / ".complete").exists()
    assert check_peft_dir(off.hf_out / "2" / "adapter" / "latest") == []
    loads_in_peft(off.hf_out / "2" / "adapter" / "latest", hf_base)

    # --- a Miles without Megatron-Bridge: refused at startup on every rank, naming the key and the flag
    bare = Launch(prewarmed, tmp_path / "bare", hf_base, "positional-args-pr", bridge=None)
    errors = failures(bare.run(bare.command()))
    for text in errors:
        assert "export.peft = true" in text and "--save-hf" in text and "import megatron.bridge" in text, text
        assert "set export.peft = false" in text and "drop --save-hf" in text, text
    assert not (bare.save / "lora").exists() and not bare.hf_out.exists()


@pytest.mark.bridge
@pytest.mark.multirank
@pytest.mark.peft
def test_export_peft_and_save_hf_through_miles_with_the_real_bridge(prewarmed, tmp_path):
    """The first two launches above with the REAL Megatron-Bridge 0.6.2 (the Bridge tier): the
    stand-in's model is built by Bridge from a tiny HF Qwen2 (`AutoBridge`, its provider and its
    LoRA; fp32) and the plugin exports it through the real `AutoBridge` that the init hook builds
    from --hf-checkpoint. A PEFT-phase fault fails rollout 1's save on every rank; the identical
    relaunch resumes with peft/ in every generation; every export loads in the real PEFT."""
    import os

    from miles_lora_ckpt_harness.sim import bridge_shims

    if not bridge_shims.available():
        if os.environ.get("MILES_LORA_CKPT_TIER") == "bridge":
            pytest.fail("the Bridge tier runs without megatron-bridge: run make tier-bridge")
        pytest.skip("megatron.bridge is not installed here (the Bridge tier: make tier-bridge)")
    from miles_lora_ckpt_harness.sim.bridge_model import BridgeRunConfig, build_hf_base

    hf = build_hf_base(tmp_path / "hf-qwen2", BridgeRunConfig(family="qwen2"))
    on = Launch(prewarmed, tmp_path / "on", hf, "lora-package-2026-09", bridge="real")
    crash = {"rollout": 1, "rank": 1, "phase": "peft-export", "action": "raise"}
    crashed = on.run(on.command(bf16=False), crash=crash)
    errors = failures(crashed)
    assert all("CheckpointError" in e and "peft-export" in e and "injected fault" in e for e in errors), errors[0]
    assert [r.result["rollouts"] for r in crashed] == [[0, 1]] * 2
    generations = on.generations()
    assert [verify_generation(g).manifest.iteration for g in generations] == [0]
    assert holds_peft(generations[0]) and not list((on.save / "lora").glob(".staging-*"))
    loads_in_peft(generations[0] / "peft", hf)
    loads_in_peft(on.hf_out / "0" / "adapter" / "latest", hf)
    same = adapter_tensors(generations[0] / "peft"), adapter_tensors(on.hf_out / "0" / "adapter" / "latest")
    assert sorted(same[0]) == sorted(same[1]) and all(torch.equal(same[0][k], same[1][k]) for k in same[0])
    assert all(r.result["bridge_context_entries"] == 3 for r in crashed)
    manifest = verify_generation(generations[0]).manifest
    assert manifest.metadata["peft"]["bridge_helpers"] == ["convert", "target_modules", "rank_pattern", "build_config"]

    resumed = ok(on.run(on.command(bf16=False)))
    for report in resumed:  # the real 0.6.2 built the model: Bridge's own LoRA wraps the fused QKV
        assert report["real_bridge"]["version"].startswith(bridge_shims.BRIDGE_VERSION), report["real_bridge"]
        assert not report["real_bridge"]["is_double"]
        assert report["real_bridge"]["qkv_wrapper"].startswith("megatron.bridge.peft."), report["real_bridge"]
    assert all(r["start_rollout_id"] == 1 and r["rollouts"] == [1, 2] for r in resumed)
    assert [verify_generation(g).manifest.iteration for g in on.generations()] == [2, 1, 0]
    assert all(holds_peft(g) for g in on.generations())
    for rollout in (1, 2):
        loads_in_peft(on.hf_out / str(rollout) / "adapter" / "latest", hf)


# The real Megatron-Bridge: `prepare` building the real AutoBridge from a tiny HF base, and refusing a
# per-slot export with 0.6.2, runs in a harness worker of the Bridge tier (Bridge imports only there,
# with sim.bridge_shims): tests/test_bridge_real.py, test_at_startup_the_real_bridge_is_built_...
