"""Small pure units: adapter naming across virtual-pipeline chunks, lossless JSON for optimizer state."""

from __future__ import annotations

import pytest
import torch

from miles_lora_ckpt.core.jsoncodec import from_json, to_json
from miles_lora_ckpt.megatron.adapter_shards import adapter_params, is_adapter_param_name, split_by_kind


class Chunk(torch.nn.Module):
    """Each virtual-pipeline chunk numbers its layers from 0, as megatron does."""

    def __init__(self):
        super().__init__()
        self.module = torch.nn.Module()
        self.module.layers = torch.nn.ModuleList([torch.nn.Module()])
        layer = self.module.layers[0]
        layer.base = torch.nn.Linear(4, 4)
        layer.lora_A = torch.nn.Linear(4, 2, bias=False)
        layer.expert_lora_B = torch.nn.Linear(2, 4, bias=False)
        layer.expert_lora_B.weight.allreduce = False


def test_chunks_never_collide_and_wrappers_are_stripped():
    params = adapter_params([Chunk(), Chunk()])
    assert sorted(params) == [
        "chunk0.layers.0.expert_lora_B.weight",
        "chunk0.layers.0.lora_A.weight",
        "chunk1.layers.0.expert_lora_B.weight",
        "chunk1.layers.0.lora_A.weight",
    ]
    dense, expert = split_by_kind(params)
    assert sorted(expert) == ["chunk0.layers.0.expert_lora_B.weight", "chunk1.layers.0.expert_lora_B.weight"]
    assert len(dense) == 2


@pytest.mark.parametrize(
    "name, adapter",
    [
        ("decoder.layers.0.self_attention.linear_qkv.lora_A.weight", True),
        ("decoder.layers.0.mlp.linear_fc1.adapter.linear_in.weight", True),
        ("decoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight", True),
        ("decoder.layers.0.self_attention.linear_qkv.weight", False),
        ("decoder.layers.0.mlp.adapter.bias", False),
    ],
)
def test_adapter_names_follow_miles(name, adapter):
    assert is_adapter_param_name(name) is adapter


def test_optimizer_state_json_round_trip_is_lossless():
    state = {
        "optimizer": {
            "param_groups": [
                {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8, "step": torch.tensor(7.0), "max_lr": float("inf")}
            ]
        },
        "grad_scaler": None,
    }
    back = from_json(to_json(state))
    group = back["optimizer"]["param_groups"][0]
    assert group["betas"] == (0.9, 0.999) and isinstance(group["betas"], tuple)
    assert torch.equal(group["step"], torch.tensor(7.0)) and group["step"].dtype == torch.float32
    assert group["max_lr"] == float("inf") and group["lr"] == 0.001


def test_non_json_state_is_refused_loudly():
    with pytest.raises(TypeError, match="optimizer.param_groups"):
        to_json({"param_groups": object()}, "optimizer")
    with pytest.raises(TypeError, match="cannot be stored"):
        to_json({"t": torch.ones(3)})
