"""Shape detection and binding, on synthetic Miles module sets: every shape, refusals, idempotency.

A fake Miles here is a dict of module objects whose functions carry the signatures a shape
declares; consumer modules hold the same function objects, as `from X import f` leaves them.
"""

from __future__ import annotations

import inspect
import sys
from argparse import Namespace
from types import ModuleType

import pytest

from miles_lora_ckpt.core import settings
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.integration import bindings, runtime
from miles_lora_ckpt.integration.install import install
from miles_lora_ckpt.integration.shapes import (
    HF_EXPORT,
    SHAPES,
    SHAPES_BY_NAME,
    UnknownMilesShape,
    detect_shape,
    render_signature,
)

P = inspect.Parameter


@pytest.fixture(autouse=True)
def _clean():
    runtime.set_current(None)
    settings.reset()
    yield
    runtime.set_current(None)
    settings.reset()


def make_function(name: str, signature: str):
    params, kind = [], P.POSITIONAL_OR_KEYWORD
    for part in filter(None, signature.strip("()").split(", ")):
        if part == "*":
            kind = P.KEYWORD_ONLY
        elif part == "/":
            params = [p.replace(kind=P.POSITIONAL_ONLY) for p in params]
        elif part.startswith("**"):
            params.append(P(part[2:], P.VAR_KEYWORD))
        elif part.startswith("*"):
            params.append(P(part[1:], P.VAR_POSITIONAL))
            kind = P.KEYWORD_ONLY
        else:
            pname, _, default = part.partition("=")
            params.append(P(pname, kind, default=None if default else P.empty))

    def function(*args, **kwargs):
        return ("miles", name, args, kwargs)

    function.__name__ = name
    function.__signature__ = inspect.Signature(params)
    return function


def fake_miles(shape_name: str, override: dict[str, str] | None = None) -> dict[str, ModuleType]:
    """Modules of `shape_name`; `override` maps 'module.function' to another signature."""
    shape = SHAPES_BY_NAME[shape_name]
    modules: dict[str, ModuleType] = {}

    def module(name: str) -> ModuleType:
        return modules.setdefault(name, ModuleType(name))

    for target in shape.targets:
        signature = (override or {}).get(target.qualified, target.signature)
        function = make_function(target.name, signature)
        setattr(module(target.module), target.name, function)
        for consumer in target.consumers:
            setattr(module(consumer), target.name, function)
    module(shape.lora_module).is_lora_model = lambda model: True
    return modules


def importer(modules: dict[str, ModuleType]):
    def import_module(name: str) -> ModuleType:
        if name not in modules:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return modules[name]

    return import_module


def attributes(modules: dict[str, ModuleType]) -> dict[str, object]:
    return {f"{name}.{attr}": value for name, m in modules.items() for attr, value in vars(m).items()}


def test_render_signature_shows_names_kinds_and_defaults():
    def f(a, /, b, c=1, *args, d, e=2, **kw): ...

    def g(model, *, optimizer=None): ...

    assert render_signature(f) == "(a, /, b, c=..., *args, d, e=..., **kw)"
    assert render_signature(g) == "(model, *, optimizer=...)"


@pytest.mark.parametrize("name", [shape.name for shape in SHAPES])
def test_every_known_shape_is_detected(name):
    assert detect_shape(importer(fake_miles(name))).name == name


def test_positional_args_shape_without_load_training_state_is_detected():
    modules = fake_miles("positional-args-pr")
    del modules["miles.backends.megatron_utils.lora.utils"]._load_training_state  # PR #1792
    assert detect_shape(importer(modules)).name == "positional-args-pr"


def test_2026_08_tree_without_load_training_state_binds():
    """PR #1792's branch and current working branches: every 2026-08 signature, no
    `_load_training_state`. The plugin replaces load_lora_adapter whole, so the tree binds."""
    modules = fake_miles("lora-utils-2026-08")
    del modules["miles.backends.megatron_utils.lora_utils"]._load_training_state
    shape = detect_shape(importer(modules))
    assert shape.name == "lora-utils-2026-08"
    plan = bindings.plan(shape, importer(modules), modules)
    bound = {b.where for b in plan.bindings}
    assert "miles.backends.megatron_utils.checkpoint.load_lora_adapter" in bound
    assert "miles.backends.megatron_utils.lora_utils._load_training_state: absent, optional: not bound" in plan.notes


def test_the_wheel_shape_rebinds_save_lora_checkpoint_in_model_py():
    """miles-rl 0.0.2's model.py binds save_lora_checkpoint by name (its save_hf_model calls it)."""
    modules = fake_miles("miles-rl-0.0.2")
    shape = detect_shape(importer(modules))
    assert shape.name == "miles-rl-0.0.2"
    plan = bindings.plan(shape, importer(modules), modules)
    assert "miles.backends.megatron_utils.model.save_lora_checkpoint" in {b.where for b in plan.bindings}


def test_an_unknown_signature_is_refused_naming_module_function_and_signature():
    changed = "(model, adapter_path, *, optimizer=..., opt_param_scheduler=..., load_optimizer=..., strict=...)"
    modules = fake_miles(
        "lora-package-2026-09", {"miles.backends.megatron_utils.lora.utils.load_lora_adapter": changed}
    )
    with pytest.raises(UnknownMilesShape) as info:
        detect_shape(importer(modules))
    text = str(info.value)
    assert "patched nothing" in text
    assert f"miles.backends.megatron_utils.lora.utils.load_lora_adapter: found {changed}" in text
    assert "expected (model, adapter_path, *, optimizer=..., opt_param_scheduler=..., load_optimizer=...)" in text
    assert "expected (model, args, adapter_path, *" in text  # the other shape with that module, too
    assert "lora-utils-2026-08" in text  # listed as a shape whose LoRA module is absent


def test_install_refuses_a_changed_signature_and_patches_nothing():
    override = {"miles.backends.megatron_utils.model.save": "(iteration, model, optimizer)"}
    modules = fake_miles("lora-utils-2026-08", override)
    before = attributes(modules)
    with pytest.raises(CheckpointError) as info:
        install(Namespace(lora_rank=4), environ={}, import_module=importer(modules))
    assert "miles.backends.megatron_utils.model.save: found (iteration, model, optimizer)" in str(info.value)
    assert attributes(modules) == before
    assert runtime.installed() is None


def test_install_refuses_a_bad_config_key_and_patches_nothing(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[save]\nkeep = -2\n")
    modules = fake_miles("lora-utils-2026-08")
    before = attributes(modules)
    with pytest.raises(CheckpointError, match="save.keep must be at least 0"):
        install(
            Namespace(lora_rank=4), environ={"MILES_LORA_CKPT_CONFIG": str(config)}, import_module=importer(modules)
        )
    assert attributes(modules) == before


def test_install_rebinds_every_consumer_and_a_second_install_changes_nothing(monkeypatch):
    modules = fake_miles("lora-package-2026-09")
    lora = modules["miles.backends.megatron_utils.lora.utils"]
    original = lora.save_lora_checkpoint
    # a module nobody declared that bound the function by name, and an imported late consumer
    stray = ModuleType("miles.utils.debug_utils.some_tool")
    stray.save_lora_checkpoint = original
    hf_export = ModuleType(HF_EXPORT)
    hf_export.save_lora_checkpoint = original
    monkeypatch.setitem(sys.modules, stray.__name__, stray)
    monkeypatch.setitem(sys.modules, HF_EXPORT, hf_export)

    rt = install(
        Namespace(lora_rank=4, custom_megatron_post_save_hook_path=None), environ={}, import_module=importer(modules)
    )
    assert rt.shape.name == "lora-package-2026-09"
    replacement = lora.save_lora_checkpoint
    assert replacement is not original and bindings.original_of(replacement) is original
    assert render_signature(replacement) == render_signature(original)  # wrappers keep Miles' signature
    for holder in (modules["miles.backends.megatron_utils.checkpoint"], stray, hf_export):
        assert holder.save_lora_checkpoint is replacement
    shape = SHAPES_BY_NAME["lora-package-2026-09"]
    for target in shape.targets:
        for name in (target.module, *target.consumers):
            assert bindings.is_replacement(getattr(modules[name], target.name)), f"{name}.{target.name}"
    assert f"{stray.__name__}.save_lora_checkpoint" in rt.bindings

    after_first = attributes(modules)
    again = install(Namespace(lora_rank=4), environ={}, import_module=importer(modules))
    assert attributes(modules) == after_first
    assert bindings.plan(shape, importer(modules)).pending == []
    assert sorted(again.bindings) == sorted(rt.bindings)


def test_a_foreign_wrapper_in_a_consumer_is_refused_and_nothing_is_patched():
    modules = fake_miles("lora-utils-2026-08")

    def someone_elses_wrapper(*args, **kwargs): ...

    modules["miles.backends.megatron_utils.model"].load_checkpoint = someone_elses_wrapper
    before = attributes(modules)
    with pytest.raises(CheckpointError) as info:
        install(Namespace(lora_rank=4), environ={}, import_module=importer(modules))
    assert "miles.backends.megatron_utils.model.load_checkpoint is <function" in str(info.value)
    assert "another plugin" in str(info.value)
    assert attributes(modules) == before


def test_the_post_save_hook_is_routed_through_the_plugin():
    args = Namespace(lora_rank=4, custom_megatron_post_save_hook_path="my_pkg.hooks.after_save")
    rt = install(args, environ={}, import_module=importer(fake_miles("lora-utils-2026-08")))
    assert args.custom_megatron_post_save_hook_path == "miles_lora_ckpt.hooks.post_save"
    assert rt.user_post_save_hook == "my_pkg.hooks.after_save"
    install(args, environ={}, import_module=importer(fake_miles("lora-utils-2026-08")))
    assert runtime.current().user_post_save_hook == "my_pkg.hooks.after_save"  # not wrapped twice


@pytest.mark.parametrize(
    "extra, word",
    [
        ({"non_persistent_ckpt_type": "local"}, "--non-persistent-ckpt-type local"),
        ({"multi_lora_n_adapters": 2}, "--multi-lora-n-adapters"),
        ({"megatron_to_hf_mode": "raw"}, "--megatron-to-hf-mode raw with --lora-rank"),  # native LoRA
        ({"use_precision_aware_optimizer": True}, "--use-precision-aware-optimizer"),
        ({"save": "/ckpt/run", "lora_adapter_path": "/ckpt/run/lora"}, "--lora-adapter-path /ckpt/run/lora"),
    ],
)
def test_startup_refuses_what_cannot_be_checkpointed_naming_the_flag(extra, word):
    modules = fake_miles("lora-utils-2026-08")
    before = attributes(modules)
    with pytest.raises(CheckpointError) as info:
        install(Namespace(lora_rank=4, **extra), environ={}, import_module=importer(modules))
    assert word in str(info.value)
    assert attributes(modules) == before


def test_peft_export_where_it_cannot_work_is_refused_at_startup_naming_key_flag_and_reason():
    """No Megatron-Bridge here, no patch_megatron_model in this fake Miles, no --hf-checkpoint: every
    reason is named, with the key (and where its value came from) and the flag; nothing is patched."""
    modules = fake_miles("lora-utils-2026-08")
    before = attributes(modules)
    args = Namespace(lora_rank=4, save_hf="/out/{rollout_id}")
    with pytest.raises(CheckpointError) as info:
        install(args, environ={"MILES_LORA_CKPT_PEFT_EXPORT": "1"}, import_module=importer(modules))
    text = str(info.value)
    assert "export.peft = true ($MILES_LORA_CKPT_PEFT_EXPORT) and --save-hf /out/{rollout_id}" in text
    assert "import megatron.bridge` fails here" in text
    assert "miles.utils.megatron_bridge_utils cannot be imported" in text
    assert "--hf-checkpoint is not set" in text
    assert "set export.peft = false (or MILES_LORA_CKPT_PEFT_EXPORT=0) and drop --save-hf" in text
    assert attributes(modules) == before


def test_peft_export_checks_run_only_when_a_run_exports():
    modules = fake_miles("lora-utils-2026-08")
    install(Namespace(lora_rank=4), environ={}, import_module=importer(modules))  # export.peft off, no --save-hf
    runtime.set_current(None)
    full_model = Namespace(lora_rank=0, save_hf="/out/{rollout_id}")  # not LoRA: Miles' own export, untouched
    rt = install(full_model, environ={}, import_module=importer(modules))
    assert rt.peft is None
    runtime.set_current(None)
    # export.peft = true in a run that trains no adapter: refused, naming --lora-rank (negative control above)
    before = attributes(modules)
    with pytest.raises(CheckpointError) as info:
        install(full_model, environ={"MILES_LORA_CKPT_PEFT_EXPORT": "1"}, import_module=importer(modules))
    text = str(info.value)
    assert "--lora-rank is not set (this run trains no LoRA adapter" in text and "--save-hf" not in text
    assert "set export.peft = false (or MILES_LORA_CKPT_PEFT_EXPORT=0)." in text
    assert attributes(modules) == before


def test_every_shape_names_miles_context_for_bridge_calls():
    from miles_lora_ckpt.integration import peft

    for shape in SHAPES:
        assert shape.bridge_model_context == "miles.utils.megatron_bridge_utils.patch_megatron_model"
        modules = fake_miles(shape.name)
        context = ModuleType("miles.utils.megatron_bridge_utils")
        context.patch_megatron_model = lambda model: None
        modules[context.__name__] = context
        assert peft.model_context(shape, importer(modules)) == (context.patch_megatron_model, "")


def test_train_fault_tolerance_is_refused_naming_what_the_user_set(tmp_path):
    """Miles' validation sets non_persistent_ckpt_type = "local" itself under --ft-components train
    (2026-08 and later; the miles-rl 0.0.2 wheel has no fault tolerance): the refusal names the flags the
    user passed, not one they never wrote."""
    from miles_lora_ckpt_harness.miles_standin.common import args as standin_args

    argv = [
        "--lora-rank",
        "4",
        "--megatron-to-hf-mode",
        "bridge",
        "--hf-checkpoint",
        str(tmp_path),
        "--num-rollout",
        "2",
    ]
    args = standin_args.build_parser("enable_gloo_process_groups").parse_args(
        argv + ["--use-fault-tolerance", "--ft-components", "train", "rollout"]
    )
    standin_args.validate(args)
    assert args.non_persistent_ckpt_type == "local"  # set by Miles' validation, not by the user
    modules = fake_miles("lora-utils-2026-08")
    before = attributes(modules)
    with pytest.raises(CheckpointError) as info:
        install(args, environ={}, import_module=importer(modules))
    text = str(info.value)
    assert "--use-fault-tolerance --ft-components train (Miles turns it into --non-persistent-ckpt-type local)" in text
    assert "drop 'train' from --ft-components" in text
    assert attributes(modules) == before


@pytest.mark.parametrize(
    "flags", [["--num-experts", "2"], ["--expert-tensor-parallel-size", "2"], ["--num-layers", "4"]], ids=" ".join
)
def test_the_qwen2_shaped_standin_refuses_megatrons_expert_and_layer_flags(tmp_path, flags):
    """Megatron-LM's --num-experts, --expert-tensor-parallel-size and --num-layers shape the stand-in's
    tiny model only: a Qwen2 --hf-checkpoint (fixed layers, no experts) refuses them, naming the flag,
    rather than building another model than the one asked for."""
    import json

    from miles_lora_ckpt_harness.miles_standin.common import args as standin_args
    from miles_lora_ckpt_harness.miles_standin.common.training import sim_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    argv = ["--lora-rank", "4", "--hf-checkpoint", str(tmp_path), "--num-rollout", "2", *flags]
    args = standin_args.build_parser("enable_gloo_process_groups").parse_args(argv)
    with pytest.raises(ValueError, match=f"{flags[0]}: the Qwen2-shaped model has no experts"):
        sim_config(args)
