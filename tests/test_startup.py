"""Startup validation names the flag to change."""

from __future__ import annotations

from argparse import Namespace
from types import SimpleNamespace

import pytest

from miles_lora_ckpt.integration.startup import UnsupportedConfiguration, validate_startup


def test_good_args_pass():
    validate_startup(Namespace(use_distributed_optimizer=True, disable_gloo_process_groups=False))


def test_distributed_optimizer_without_megatrons_gloo_groups_passes():
    # the savers never use megatron's gloo groups (consensus builds its own, slices need no collective)
    validate_startup(Namespace(use_distributed_optimizer=True, disable_gloo_process_groups=True))
    validate_startup(Namespace(use_distributed_optimizer=True, enable_gloo_process_groups=False))
    no_gloo = DistributedOptimizer(optimizer=object(), data_parallel_group=object(), data_parallel_group_gloo=None)
    validate_startup(optimizer=SimpleNamespace(chained_optimizers=[no_gloo]))
    no_group = DistributedOptimizer(optimizer=object(), data_parallel_group=None, data_parallel_group_gloo=None)
    with pytest.raises(UnsupportedConfiguration, match="child 0 .*no data-parallel group"):
        validate_startup(optimizer=SimpleNamespace(chained_optimizers=[no_group]))


def test_every_problem_is_listed():
    args = Namespace(
        use_distributed_optimizer=True,
        enable_gloo_process_groups=False,
        use_precision_aware_optimizer=True,
        optimizer_cpu_offload=True,
    )
    with pytest.raises(UnsupportedConfiguration) as info:
        validate_startup(args)
    assert str(info.value).count("\n  - ") == 2  # precision-aware and CPU offload; gloo off is fine


# Stand-ins named like megatron's classes: validate_startup recognises children by class name.
DistributedOptimizer = type("DistributedOptimizer", (SimpleNamespace,), {})
Float16OptimizerWithFloat16Params = type("Float16OptimizerWithFloat16Params", (SimpleNamespace,), {})
FP32Optimizer = type("FP32Optimizer", (SimpleNamespace,), {})
LayerWiseDistributedOptimizer = type("LayerWiseDistributedOptimizer", (SimpleNamespace,), {})


def test_every_child_class_megatron_builds_for_lora_passes():
    dist = DistributedOptimizer(optimizer=object(), data_parallel_group_gloo=object())
    layer_wise = LayerWiseDistributedOptimizer(
        chained_optimizers=[Float16OptimizerWithFloat16Params(optimizer=object()), FP32Optimizer(optimizer=object())]
    )
    stub = DistributedOptimizer(optimizer=None, is_stub_optimizer=True)
    validate_startup(optimizer=SimpleNamespace(chained_optimizers=[stub, dist, layer_wise]))
    validate_startup(optimizer=SimpleNamespace(chained_optimizers=[Float16OptimizerWithFloat16Params(optimizer=1)]))


def test_unsupported_optimizer_children_are_rejected():
    raw = SimpleNamespace(optimizer=object(), param_groups=[])  # e.g. a raw torch optimizer in a chain
    nvme = DistributedOptimizer(optimizer=object(), data_parallel_group_gloo=object(), _nvme_state_store=1)
    fp16 = Float16OptimizerWithFloat16Params(
        optimizer=object(), config=SimpleNamespace(use_precision_aware_optimizer=True)
    )
    dist_in_layer_wise = LayerWiseDistributedOptimizer(chained_optimizers=[DistributedOptimizer(optimizer=object())])
    stub = SimpleNamespace(optimizer=None, is_stub_optimizer=True)
    chained = SimpleNamespace(chained_optimizers=[stub, raw, nvme, fp16, dist_in_layer_wise])
    with pytest.raises(UnsupportedConfiguration) as info:
        validate_startup(optimizer=chained)
    text = str(info.value)
    assert "child 1 is a SimpleNamespace" in text and "supported are DistributedOptimizer" in text
    assert "child 2" in text and "NVMe" in text
    assert "child 3" in text and "--use-precision-aware-optimizer" in text
    assert "child 4 is a DistributedOptimizer" in text and "child 0" not in text


def test_non_distributed_children_under_a_reduce_scattering_ddp_are_rejected():
    """megatron 0.19 builds Lion as Float16 children even when DDP reduce-scatters for a distributed
    optimizer: the DP replicas would diverge (test_optimizer_children shows the saver refusing them)."""
    lion = SimpleNamespace(chained_optimizers=[Float16OptimizerWithFloat16Params(optimizer=object())])
    reduce_scatter = [SimpleNamespace(ddp_config=SimpleNamespace(use_distributed_optimizer=True))]
    all_reduce = [SimpleNamespace(ddp_config=SimpleNamespace(use_distributed_optimizer=False))]
    validate_startup(optimizer=lion, model=all_reduce)
    with pytest.raises(UnsupportedConfiguration, match="use_distributed_optimizer=False"):
        validate_startup(optimizer=lion, model=reduce_scatter)
    layer_wise = SimpleNamespace(
        chained_optimizers=[LayerWiseDistributedOptimizer(chained_optimizers=lion.chained_optimizers)]
    )
    validate_startup(optimizer=layer_wise, model=reduce_scatter)  # megatron 0.19's layout-based LayerWise path
