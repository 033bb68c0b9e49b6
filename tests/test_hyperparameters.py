"""Pure units of the two unkeyed cross-checks at resume: the checkpoint's hyperparameters against
the launch's (`core.hyperparameters`), the adapter against its fp32 masters (`masters`), and the
policy a Miles launch picks (`integration.resume.hyperparameter_policy`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from miles_lora_ckpt.core.errors import IncompatibleCheckpoint
from miles_lora_ckpt.core.hyperparameters import Reconciler
from miles_lora_ckpt.integration.config import ConfigError, defaults, load_config
from miles_lora_ckpt.integration.resume import hyperparameter_policy
from miles_lora_ckpt.megatron.optimizer_children.masters import AdapterSource, check_master


def live() -> list[dict]:
    return [{"params": [], "lr": 1e-5, "weight_decay": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "max_lr": 1e-4}]


def saved(**changes) -> list[dict]:
    group = {"lr": 3e-5, "weight_decay": 0.01, "step": 7, "betas": (0.9, 0.999), "eps": 1e-8, "max_lr": 1e-4}
    return [{**group, **changes}]


def test_scheduled_values_and_the_step_counter_are_not_differences():
    reconciler = Reconciler("refuse")
    reconciler.param_groups("child 0", saved(), live())
    reconciler.settle()
    assert reconciler.differences == [] and reconciler.notes == []


@pytest.mark.parametrize("policy", [None, "checkpoint", "launch", "refuse"])
def test_an_unknown_key_is_refused_under_every_policy(policy):
    with pytest.raises(ValueError, match=r"child 0 param group 0: .* does not have: \['surprise'\]"):
        Reconciler(policy).param_groups("child 0", saved(surprise=1.0), live())


def test_another_number_of_param_groups_is_refused():
    with pytest.raises(ValueError, match="the checkpoint has 2 param groups, this run's optimizer 1"):
        Reconciler().param_groups("child 0", saved() * 2, live())


@pytest.mark.parametrize(
    "policy, betas, outcome",
    [
        (None, (0.5, 0.999), "the checkpoint's restored (megatron's behaviour)"),
        ("checkpoint", (0.5, 0.999), "the checkpoint's restored"),
        ("launch", (0.9, 0.999), "the launch's kept"),
    ],
)
def test_each_difference_names_both_values_and_is_settled_by_the_policy(policy, betas, outcome):
    groups = saved(betas=(0.5, 0.999), max_lr=2e-4)
    reconciler = Reconciler(policy)
    reconciler.param_groups("child 0", groups, live())
    reconciler.settle()
    assert reconciler.differences == [
        f"child 0 param group 0: betas differs: checkpoint (0.5, 0.999), launch (0.9, 0.999) ({outcome})",
        f"child 0 param group 0: max_lr differs: checkpoint 0.0002, launch 0.0001 ({outcome})",
    ]
    assert groups[0]["betas"] == betas


def test_refuse_names_every_difference_and_the_flags():
    reconciler = Reconciler("refuse")
    reconciler.param_groups("child 0", saved(eps=1e-6), live())
    sched = {"max_lr": 2e-4, "min_lr": 0.0, "num_steps": 40, "lr_decay_style": "linear"}
    reconciler.scheduler(sched, {"max_lr": 1e-4, "min_lr": 0.0, "num_steps": 0, "lr_decay_style": "cosine"})
    with pytest.raises(IncompatibleCheckpoint) as raised:
        reconciler.settle()
    text = str(raised.value)
    assert "child 0 param group 0: eps differs: checkpoint 1e-06, launch 1e-08 (refused)" in text
    assert "scheduler: max_lr differs: checkpoint 0.0002, launch 0.0001" in text
    assert "scheduler: lr_decay_style differs: checkpoint 'linear', launch 'cosine'" in text
    assert "num_steps" not in text and "--use-checkpoint-opt-param-scheduler" in text


def test_launch_policy_puts_the_launch_schedule_into_the_saved_state():
    sched = {"max_lr": 2e-4, "num_steps": 40}
    Reconciler("launch").scheduler(sched, {"max_lr": 1e-4, "num_steps": 0})
    assert sched == {"max_lr": 1e-4, "num_steps": 40}


def test_a_key_the_checkpoint_lacks_keeps_the_launch_value():
    groups = [{k: v for k, v in saved()[0].items() if k != "eps"}]
    reconciler = Reconciler("refuse")
    reconciler.param_groups("child 0", groups, live())
    reconciler.settle()
    assert groups[0]["eps"] == 1e-8 and "has no 'eps', the launch's 1e-08 kept" in reconciler.notes[0]


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="not one of"):
        Reconciler("newest")


@pytest.mark.parametrize(
    "setting, strict, flags, expected",
    [
        ("auto", True, {}, "refuse"),
        ("auto", False, {}, "checkpoint"),
        ("auto", True, {"use_checkpoint_opt_param_scheduler": True}, "checkpoint"),
        ("auto", True, {"override_opt_param_scheduler": True}, "launch"),
        ("launch", True, {"use_checkpoint_opt_param_scheduler": True}, "launch"),
        ("refuse", False, {}, "refuse"),
    ],
)
def test_a_miles_launch_picks_its_policy_from_the_config_and_megatron_flags(setting, strict, flags, expected):
    config = defaults()
    config = type(config)({**config.values, "resume.hyperparameters": setting, "resume.strict": strict})
    assert hyperparameter_policy(config, SimpleNamespace(**flags)) == expected


def test_the_config_key_accepts_only_the_policies():
    assert load_config({"MILES_LORA_CKPT_HYPERPARAMETERS": "launch"})["resume.hyperparameters"] == "launch"
    with pytest.raises(ConfigError, match="resume.hyperparameters must be one of"):
        load_config({"MILES_LORA_CKPT_HYPERPARAMETERS": "newest"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_adapter_must_be_the_cast_of_its_master(dtype):
    master = torch.linspace(-1, 1, 12, dtype=torch.float32).reshape(3, 4) / 3
    source = AdapterSource("chunk0.lora_A.weight", master.to(dtype), "adapter/dense_tp000_pp000.safetensors")
    check_master(source, master, "optimizer/child0.safetensors")
    check_master(source, master.reshape(-1)[5:9], "optimizer/child0.safetensors (a shard)", first=5)
    other = master.clone()
    other[2, 1] += 0.25
    with pytest.raises(ValueError) as raised:
        check_master(source, other, "optimizer/child0.safetensors (optimizer child 0)")
    name = str(dtype).removeprefix("torch.")
    assert str(raised.value).startswith(
        f"chunk0.lora_A.weight: the adapter in adapter/dense_tp000_pp000.safetensors is not the {name} cast of its "
        "fp32 master in optimizer/child0.safetensors (optimizer child 0) (element 9: adapter"
    ), raised.value
    with pytest.raises(ValueError, match=r"holds master elements \[10, 14\)"):
        check_master(source, master.reshape(-1)[:4], "optimizer/child0.safetensors", first=10)
