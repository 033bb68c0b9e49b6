"""Each trainable parameter's global block (megatron.param_blocks), on a tiny module tree in one
process: megatron's parallel state is replaced by fixed answers (no process group is needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from miles_lora_ckpt.core.global_layout import Block
from miles_lora_ckpt.megatron import param_blocks


class FakeColumn(torch.nn.Module):
    """Stands for a megatron column-parallel linear on TP rank 1 of 2: `sharded_state_dict` says the
    local [2, 4] weight is rows 2..4 of a [4, 4] global tensor (what megatron's ShardedTensor says)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, 4))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        entry = SimpleNamespace(global_shape=(4, 4), global_offset=(2, 0), local_shape=(2, 4), prepend_axis_num=0)
        return {f"{prefix}weight": entry}


FakeColumn.__module__ = "megatron.core.tensor_parallel.fake"  # only megatron's modules are asked


class Expert(torch.nn.Module):
    def __init__(self, gated: bool):
        super().__init__()
        self.config = SimpleNamespace(gated_linear_unit=gated)
        self.linear_fc1 = FakeColumn()


class Layer(torch.nn.Module):
    def __init__(self, number: int, gated: bool):
        super().__init__()
        self.layer_number = number  # megatron's TransformerLayer: global, from 1
        self.proj = torch.nn.Linear(4, 3, bias=False)  # replicated: no sharded_state_dict
        self.frozen = torch.nn.Linear(3, 3, bias=False).requires_grad_(False)
        self.mlp = torch.nn.Module()
        self.mlp.local_expert_indices = [2, 3]  # megatron's MoE layer: EP rank 1 of 2, two local experts
        self.mlp.experts = torch.nn.Module()
        self.mlp.experts.local_experts = torch.nn.ModuleList([Expert(gated), Expert(gated)])
        self.shared = torch.nn.Linear(2, 2, bias=False)  # an expert parameter without a global number
        self.shared.weight.allreduce = False


def _model(gated: bool = False) -> torch.nn.Module:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Layer(7, gated)])  # chunk-local layer 0 is global layer 6
    return model


@pytest.fixture(autouse=True)
def parallel_state(monkeypatch):
    from megatron.core import parallel_state as mpu

    monkeypatch.setattr(mpu, "get_data_parallel_group", lambda **kw: None)
    monkeypatch.setattr(mpu, "get_expert_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(mpu, "get_expert_model_parallel_world_size", lambda: 2)


def _blocks(model) -> dict:
    return {n: None if b is None else Block.from_dict(b, n) for n, b in param_blocks.describe(model).items()}


def test_layers_and_experts_get_global_numbers_and_megatron_says_the_split():
    blocks = _blocks(_model())
    assert sorted(blocks) == [
        "chunk0.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
        "chunk0.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
        "chunk0.layers.0.proj.weight",
        "chunk0.layers.0.shared.weight",
    ]  # the frozen weight is not described
    assert blocks["chunk0.layers.0.proj.weight"] == Block(
        "layers.6.proj.weight", (3, 4), (0, 0), (3, 4), "torch.float32"
    )
    fc1 = blocks["chunk0.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert fc1 == Block(
        "layers.6.mlp.experts.local_experts.3.linear_fc1.weight", (4, 4), (2, 0), (2, 4), "torch.float32"
    )
    # one expert per EP rank, no global number: named with its EP rank (it cannot move across EP ranks)
    assert blocks["chunk0.layers.0.shared.weight"].name == "layers.6.shared.weight@ep1/2"


def test_what_megatron_cannot_describe_as_one_block_is_unknown():
    # swiglu: a gated linear_fc1 whose sharded_state_dict entry megatron's swiglu factory cannot take
    gated = _blocks(_model(gated=True))
    assert gated["chunk0.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"] is None
    assert gated["chunk0.layers.0.proj.weight"] is not None
    # a layer without megatron's layer_number: its global index is unknown
    model = _model()
    del model.layers[0].layer_number
    assert all(b is None for b in _blocks(model).values())


def test_a_slot_remaps_model_view_is_described_through_its_chunk():
    """A model view (`savers.multi_lora.remap`) shows the chunk's parameters under other names:
    each is described by its own module's split, under the global name of the name shown. Before,
    every parameter of a view was unknown, and a slot load through `rename_slot` was not planned."""
    import re

    from miles_lora_ckpt.savers.multi_lora.remap import SlotRemap, model_view, rename_by_pattern

    model = _model()
    model.layers[0].mlp.experts.local_experts[1].linear_fc1.weight = torch.nn.Parameter(torch.zeros(2, 4).bfloat16())
    swap = SlotRemap(saved=0, slot=1, rename=rename_by_pattern(re.compile(r"local_experts\.(\d+)\.")))
    real, viewed = _blocks(model), _blocks(model_view(model, swap))
    one = "chunk0.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    assert sorted(viewed) == sorted(real)
    # local expert 1's parameter (bf16) shown as local expert 0: its split, the global number of 0
    assert viewed[one.format(0)] == Block(
        "layers.6.mlp.experts.local_experts.2.linear_fc1.weight", (4, 4), (2, 0), (2, 4), "torch.bfloat16"
    )
    assert real[one.format(0)].dtype == "torch.float32"  # negative control: unmapped, expert 0's own
    assert viewed["chunk0.layers.0.proj.weight"] == real["chunk0.layers.0.proj.weight"]  # not renamed

    class Reordered:  # a view that does not show its chunk's parameters in order: unknown, not guessed
        viewed_chunk = model

        def named_parameters(self):
            return reversed(list(model.named_parameters()))

    assert set(_blocks(Reordered()).values()) == {None}


class RealColumn(torch.nn.Module):
    """A column-parallel linear on TP rank `rank` of `tp` whose `sharded_state_dict` is megatron's
    own `ShardedTensor` (global [8, 3], split on axis 0)."""

    def __init__(self, rank: int, tp: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(8 // tp, 3))
        self.rank, self.tp = rank, tp

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        entry = ShardedTensor.from_rank_offsets(f"{prefix}weight", self.weight, (0, self.rank, self.tp))
        return {f"{prefix}weight": entry}


RealColumn.__module__ = "megatron.core.tensor_parallel.fake"


class Adapter(torch.nn.Module):  # Bridge-style: linear_in (replicated here) and linear_out
    def __init__(self, rank: int, tp: int):
        super().__init__()
        self.linear_in = torch.nn.Linear(3, 3, bias=False)
        self.linear_out = RealColumn(rank, tp)


def _gated_mlp(gated: bool, rank: int, tp: int) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.layer_number = 1
    layer.mlp = torch.nn.Module()
    layer.mlp.config = SimpleNamespace(gated_linear_unit=gated)
    layer.mlp.linear_fc1 = torch.nn.Module()
    layer.mlp.linear_fc1.adapter = Adapter(rank, tp)
    layer.mlp.linear_fc2 = torch.nn.Module()
    layer.mlp.linear_fc2.adapter = Adapter(rank, tp)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer])
    return model


@pytest.mark.parametrize("rank, tp", [(0, 1), (0, 2), (1, 2), (3, 4)])
def test_a_gated_fc1_output_is_one_block_of_gate_and_up_from_megatrons_swiglu_factory(rank, tp):
    blocks = _blocks(_gated_mlp(True, rank, tp))
    out = blocks["chunk0.layers.0.mlp.linear_fc1.adapter.linear_out.weight"]
    # [gate; up] of [8, 3] read as [2, 4, 3]: TP rank r holds gate rows and up rows r*4/tp.. of each half
    half = 4 // tp
    assert out == Block(
        "layers.0.mlp.linear_fc1.adapter.linear_out.weight",
        (2, 4, 3),
        (0, rank * half, 0),
        (2, half, 3),
        "torch.float32",
    )
    assert out.holds((2 * half, 3)) and not out.holds((half, 6))
    # the adapter's input factor and a non-gated linear's output keep megatron's plain ShardedTensor
    plain = blocks["chunk0.layers.0.mlp.linear_fc2.adapter.linear_out.weight"]
    assert plain == Block(plain.name, (8, 3), (rank * 8 // tp, 0), (8 // tp, 3), "torch.float32")
    assert blocks["chunk0.layers.0.mlp.linear_fc1.adapter.linear_in.weight"].global_shape == (3, 3)
    ungated = _blocks(_gated_mlp(False, rank, tp))["chunk0.layers.0.mlp.linear_fc1.adapter.linear_out.weight"]
    assert ungated.global_shape == (8, 3)  # a gated and a non-gated fc1 never look alike
