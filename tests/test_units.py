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


def test_scalar_tensor_values_must_fit_their_dtype():
    """A tagged scalar decodes to exactly its value: one its dtype cannot hold (it would decode to
    inf, wrap around or raise) is refused by the check verify and the loader share."""
    from miles_lora_ckpt.core.jsoncodec import check_tags

    for dtype in ("float16", "bfloat16", "float32", "int8", "uint8", "int16", "int32", "int64"):
        torch_dtype = getattr(torch, dtype)
        info = torch.finfo(torch_dtype) if torch_dtype.is_floating_point else torch.iinfo(torch_dtype)
        for extreme in (info.max, info.min):
            encoded = to_json(torch.tensor(extreme, dtype=torch_dtype))
            check_tags(encoded)
            assert from_json(encoded).item() == extreme
        for outside in (info.max * 2, -info.max * 2) if torch_dtype.is_floating_point else (info.max + 1, info.min - 1):
            with pytest.raises(ValueError, match=f"dtype {dtype} holding .*, outside"):
                from_json({"__scalar_tensor__": outside, "dtype": dtype}, "group.step")
    check_tags({"__scalar_tensor__": 1e300, "dtype": "float64"})


def test_non_json_state_is_refused_loudly():
    with pytest.raises(TypeError, match="optimizer.param_groups"):
        to_json({"param_groups": object()}, "optimizer")
    with pytest.raises(TypeError, match="cannot be stored"):
        to_json({"t": torch.ones(3)})


def test_manifest_round_trip_and_field_table():
    import json

    from miles_lora_ckpt.core.layout import FileRecord, Manifest, Topology, seal_manifest

    record = FileRecord(bytes=8, digest="xxh3_128:" + "a" * 32, finite=True, binding={"role": "optimizer"})
    manifest = Manifest("0123456789abcdef", 5, "single-lora", Topology(dp=2), {"x.safetensors": record}, sequence=3)
    parsed = Manifest.from_json_bytes(manifest.to_json_bytes())
    assert parsed == manifest and parsed.role_of("x.safetensors") == "optimizer"
    body = json.loads(manifest.to_json_bytes())
    assert body["format_version"] == 3 and body["sequence"] == 3 and "signature" not in body
    for change, message in (
        (lambda b: b.pop("sequence"), r"missing fields \['sequence'\]"),
        (lambda b: b.update(extra=1), r"unknown fields \['extra'\]"),
        (lambda b: b.update(iteration=True), "iteration is True, not an integer"),
        (lambda b: b["topology"].update(tp=0), r"topology tp is 0, outside"),
    ):
        edited = json.loads(manifest.to_json_bytes())
        edited.pop("manifest_digest")
        change(edited)
        with pytest.raises(ValueError, match=message):
            Manifest.from_json_bytes(seal_manifest(edited))


SCHEDULER_SHAPE = {"lr_decay_steps": 100, "lr_decay_style": "linear"}


def test_a_training_state_at_iteration_0_may_have_stepped_but_a_later_one_must_have():
    """Miles numbers saves by rollout id: the save of rollout 0 comes after its training steps."""
    from miles_lora_ckpt.core import training_state

    def state(iteration, num_steps):
        scheduler = {"num_steps": num_steps, "max_lr": 1e-3, "min_lr": 0.0, "lr_warmup_steps": 0}
        return {"iteration": iteration, "generation": "g", "scheduler": {**scheduler, **SCHEDULER_SHAPE}}

    for iteration, num_steps in ((0, 0), (0, 8), (3, 32)):
        training_state.check(state(iteration, num_steps), iteration=iteration, generation="g", format_version=2)
    with pytest.raises(ValueError, match="scheduler.num_steps is 0 at iteration 7"):
        training_state.check(state(7, 0), iteration=7, generation="g", format_version=2)


@pytest.mark.parametrize(
    "name",
    [
        "gen-000000001-0123456789abcdef\n",  # `$` would match before the newline
        "gen-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661-0123456789abcdef",  # Arabic-Indic digits
        "gen-\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff11-0123456789abcdef",  # fullwidth digits
        "gen-000000001-0123456789abcdef\x00",
    ],
)
def test_generation_and_staging_names_are_ascii_only(name, tmp_path):
    from miles_lora_ckpt.core.layout import is_staging_dir_name, parse_generation_dir_name
    from miles_lora_ckpt.core.verify import view_root

    assert parse_generation_dir_name("gen-000000001-0123456789abcdef") == (1, "0123456789abcdef")
    assert parse_generation_dir_name(name) is None
    assert not is_staging_dir_name(".staging-0123456789abcdef\n") and is_staging_dir_name(".staging-0123456789abcdef")
    if "\x00" not in name:
        (tmp_path / name).mkdir()  # not a generation: never listed, never loaded or removed as one
        assert view_root(tmp_path).entries == []


def test_names_read_from_disk_elsewhere_are_ascii_only_too():
    from miles_lora_ckpt.integration import resume
    from miles_lora_ckpt.savers.multi_lora.naming import check_reader_name

    assert check_reader_name("step_1") == "step_1"
    for bad in ("step_1\n", "step_\u0661"):
        with pytest.raises(ValueError, match="reader name"):
            check_reader_name(bad)
    assert resume._MEGATRON_ITER_DIR.match("iter_0000001")
    assert not resume._MEGATRON_ITER_DIR.match("iter_0000001\n")
    assert not resume._MEGATRON_ITER_DIR.match("iter_000000\u0661")


def test_native_names_map_miles_native_single_projection_factors_and_refuse_the_rest():
    """`core.native_names`: this run's factor of a linear Miles' native LoRA adapts with a single
    projection is read from the native item (per layer, or stacked on a leading layer axis at the
    layer's index); the fused split / Inkling adapters are refused with the reason; an item that
    could be read from two places is refused, never guessed."""
    from miles_lora_ckpt.core.global_layout import Block
    from miles_lora_ckpt.core.native_names import Source, native_sources, refusal, resolve

    bridge_in = "decoder.layers.3.self_attention.linear_proj.adapter.linear_in.weight"
    assert native_sources(bridge_in) == [
        Source("decoder.layers.3.self_attention.lora_o_adapter.o_A"),
        Source("decoder.layers.self_attention.lora_o_adapter.o_A", 3),
    ]
    fc2_out = "decoder.layers.1.mlp.shared_experts.linear_fc2.adapter.linear_out.weight"
    assert [s.key for s in native_sources(fc2_out)] == [
        "decoder.layers.1.mlp.shared_experts.lora_fc2_adapter.down_B",
        "decoder.layers.mlp.shared_experts.lora_fc2_adapter.down_B",
        "decoder.layers.1.mlp.shared_experts.lora_fc2_adapter.fc2_B",
        "decoder.layers.mlp.shared_experts.lora_fc2_adapter.fc2_B",
    ]
    assert native_sources("layers.0.linear_qkv.lora_B.weight") == []  # split q/k/v: no single item
    assert native_sources("decoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight") == []
    assert resolve(bridge_in, {bridge_in}) == Source(bridge_in)
    assert resolve(bridge_in, {"decoder.layers.self_attention.lora_o_adapter.o_A"}).layer == 3
    assert resolve(bridge_in, set()) is None
    with pytest.raises(ValueError, match="could be read from 2 items"):
        resolve(bridge_in, {bridge_in, "decoder.layers.self_attention.lora_o_adapter.o_A"})
    # a stacked item: this rank's block of layer 3, TP rank 1 of 2 of the row-parallel A
    wanted = Block(bridge_in, (4, 32), (0, 16), (4, 16))
    block = Source("decoder.layers.self_attention.lora_o_adapter.o_A", 3).block(wanted, (6, 4, 32))
    assert (block.global_shape, block.offset, block.shape) == ((6, 4, 32), (3, 0, 16), (1, 4, 16))
    with pytest.raises(ValueError, match=r"global shape \[6, 8, 32\] in the checkpoint, \[6, 4, 32\]"):
        Source("decoder.layers.self_attention.lora_o_adapter.o_A", 3).block(wanted, (6, 8, 32))
    with pytest.raises(ValueError, match="2 layer"):
        Source("decoder.layers.self_attention.lora_o_adapter.o_A", 3).block(wanted, (2, 4, 32))
    assert "split adapter" in refusal("decoder.layers.self_attention.lora_qkv_adapter.q_A")
    assert "linear_fc1" in refusal("decoder.layers.7.mlp.lora_fc1_adapter.gate_B")
    assert "Inkling's fused gate/up" in refusal("decoder.layers.mlp.lora_fc1_adapter.fc1_B")
    assert "grouped-expert" in refusal("decoder.layers.2.mlp.experts.lora_fc2_adapter.w2_A")
    assert "shared-experts" in refusal("decoder.layers.2.mlp.shared_experts.lora_adapter.w1_B")
    assert "lm_head" in refusal("lora_lm_head_adapter.head_A")
    assert refusal("decoder.layers.self_attention.lora_o_adapter.o_A") is None  # it maps
    assert refusal("decoder.layers.0.self_attention.linear_proj.weight") is None


def test_native_dist_recognises_only_torch_dist_adapter_checkpoints(tmp_path):
    """`core.native_dist`: megatron's metadata.json or DCP's .metadata + *.distcp, in a directory
    named torch_dist (itself or below an adapter dir / iter dir); never a base checkpoint or junk."""
    import json

    from miles_lora_ckpt.core import native_dist

    adapter = tmp_path / "save" / "iter_0000003" / "adapter"
    (adapter / "torch_dist").mkdir(parents=True)
    (adapter / "torch_dist" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    assert native_dist.find_native_checkpoint(adapter) == adapter / "torch_dist"
    assert native_dist.find_native_checkpoint(adapter / "torch_dist") == adapter / "torch_dist"
    assert native_dist.native_checkpoints_in(tmp_path / "save") == [adapter / "torch_dist"]
    assert "'torch_dist'" in native_dist.refusal(adapter, adapter / "torch_dist")
    # DCP files alone also count
    dcp = tmp_path / "dcp" / "torch_dist"
    dcp.mkdir(parents=True)
    (dcp / ".metadata").write_bytes(b"x")
    (dcp / "__0_0.distcp").write_bytes(b"x")
    assert native_dist.find_native_checkpoint(dcp.parent) == dcp
    # a base-model checkpoint (iter dir, not torch_dist), bad JSON, JSON without a backend: none
    base = tmp_path / "ref" / "iter_0000000"
    base.mkdir(parents=True)
    (base / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    assert native_dist.find_native_checkpoint(base) is None and native_dist.native_checkpoints_in(base.parent) == []
    for text in ("{not json", json.dumps({"other": 1}), json.dumps([1])):
        junk = tmp_path / f"junk{len(text)}" / "torch_dist"
        junk.mkdir(parents=True)
        (junk / "metadata.json").write_text(text)
        assert native_dist.find_native_checkpoint(junk.parent) is None, text
    assert native_dist.find_native_checkpoint(tmp_path / "missing") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_finds_every_non_finite_value_and_only_those(dtype):
    from miles_lora_ckpt.core.finite import all_finite

    big = torch.finfo(dtype).max
    assert all_finite(torch.empty(0, dtype=dtype))
    assert all_finite(torch.tensor([1.0, -2.5, 0.0], dtype=dtype))
    # finite values whose sum overflows: the exact check decides, not the sum
    assert all_finite(torch.full((8,), big, dtype=dtype))
    assert all_finite(torch.tensor([big, big, -big, -big], dtype=dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        values = torch.zeros(1000, dtype=dtype)
        values[617] = bad
        assert not all_finite(values), bad
        assert not all_finite(values.view(10, 100)[:, 17]), bad  # a strided view holding it
        assert all_finite(values.view(10, 100)[:, 18])  # one that does not
    both = torch.tensor([1.0, float("inf"), float("-inf"), 2.0], dtype=dtype)  # their sum is NaN
    assert not all_finite(both)
    assert not all_finite(torch.tensor([big, big, float("nan")], dtype=dtype))
