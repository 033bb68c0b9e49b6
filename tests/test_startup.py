"""Startup validation names the flag to change."""

from __future__ import annotations

from argparse import Namespace
from types import SimpleNamespace

import pytest

from miles_lora_ckpt.integration.startup import UnsupportedConfiguration, validate_startup


def test_good_args_pass():
    validate_startup(Namespace(use_distributed_optimizer=True, disable_gloo_process_groups=False))


def test_distributed_optimizer_without_gloo_is_rejected():
    with pytest.raises(UnsupportedConfiguration, match="--disable-gloo-process-groups"):
        validate_startup(Namespace(use_distributed_optimizer=True, disable_gloo_process_groups=True))


def test_every_problem_is_listed():
    args = Namespace(
        use_distributed_optimizer=True,
        enable_gloo_process_groups=False,
        use_precision_aware_optimizer=True,
        optimizer_cpu_offload=True,
    )
    with pytest.raises(UnsupportedConfiguration) as info:
        validate_startup(args)
    assert str(info.value).count("\n  - ") == 3


def test_unsupported_optimizer_wrappers_are_rejected():
    plain = SimpleNamespace(optimizer=object(), param_groups=[])  # e.g. FP32Optimizer: no buckets
    nvme = SimpleNamespace(optimizer=object(), gbuf_ranges=[], model_param_group_index_map={}, _nvme_state_store=1)
    no_gloo = SimpleNamespace(
        optimizer=object(), gbuf_ranges=[], model_param_group_index_map={}, data_parallel_group_gloo=None
    )
    stub = SimpleNamespace(optimizer=None, is_stub_optimizer=True)
    chained = SimpleNamespace(chained_optimizers=[stub, plain, nvme, no_gloo])
    with pytest.raises(UnsupportedConfiguration) as info:
        validate_startup(optimizer=chained)
    text = str(info.value)
    assert "child 1" in text and "--use-distributed-optimizer" in text
    assert "child 2" in text and "NVMe" in text and "child 3" in text and "child 0" not in text
