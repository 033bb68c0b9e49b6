"""Storage layer: our safetensors writer/reader against the real safetensors library, atomic files."""

from __future__ import annotations

import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_lora_ckpt.core import storage
from miles_lora_ckpt.core.digest import digest_bytes

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate(DTYPES):
        base = torch.randn(5, 3, generator=gen) * 10
        out[f"t{i}.{str(dtype)[6:]}"] = base.to(dtype)
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.empty(0, 4)
    out["noncontig"] = torch.randn(4, 6, generator=gen).t()
    return out


def test_our_file_loads_in_real_safetensors(tmp_path):
    tensors = sample_tensors()
    record = storage.save_tensors(tmp_path / "a.safetensors", tensors, metadata={"k": "v"})
    loaded = load_file(tmp_path / "a.safetensors")
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    raw = (tmp_path / "a.safetensors").read_bytes()
    assert record.bytes == len(raw) and record.digest == digest_bytes(raw)


def test_real_safetensors_file_loads_in_ours(tmp_path):
    tensors = {k: v.contiguous() for k, v in sample_tensors().items()}
    save_file(tensors, tmp_path / "b.safetensors", metadata={"x": "y"})
    loaded, metadata = storage.load_tensors(tmp_path / "b.safetensors")
    assert metadata == {"x": "y"}
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name


def test_atomic_write_leaves_no_temp_and_failure_leaves_nothing(tmp_path):
    storage.write_json(tmp_path / "ok.json", {"a": 1})
    assert sorted(os.listdir(tmp_path)) == ["ok.json"]

    def failing_chunks():
        yield b"partial"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        storage.write_file_atomic(tmp_path / "bad.bin", failing_chunks())
    assert sorted(os.listdir(tmp_path)) == ["ok.json"]


def test_save_refuses_non_finite_when_asked(tmp_path):
    with pytest.raises(ValueError, match="NaN or Inf"):
        storage.save_tensors(tmp_path / "n.safetensors", {"w": torch.tensor([1.0, float("nan")])}, finite=True)
    storage.save_tensors(tmp_path / "n.safetensors", {"w": torch.tensor([1.0, float("inf")])}, finite=False)


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda b: b[:4], "too short"),
        (lambda b: struct.pack("<Q", 10**9) + b[8:], "exceeds the file"),
        (lambda b: b + b"\0\0\0\0", "ends at byte"),
        (lambda b: b[:-4], "ends at byte"),
        (lambda b: b"\x80\x04\x95" + b[3:], "exceeds the file"),
    ],
)
def test_strict_header_parser_rejects(tmp_path, mutate, reason):
    storage.save_tensors(tmp_path / "c.safetensors", {"a": torch.ones(4), "b": torch.zeros(2, 2)})
    raw = mutate((tmp_path / "c.safetensors").read_bytes())
    with pytest.raises(ValueError, match=reason):
        storage.parse_safetensors_header(raw)


def test_strict_json_rejects_nan():
    with pytest.raises(ValueError, match="non-finite"):
        storage.parse_json(b'{"a": NaN}')
    with pytest.raises(ValueError):
        storage.json_bytes({"a": float("nan")})


def test_digest_mismatch_is_reported(tmp_path):
    record = storage.write_json(tmp_path / "d.json", {"a": 1})
    data = bytearray((tmp_path / "d.json").read_bytes())
    data[2] ^= 1
    (tmp_path / "d.json").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="digest mismatch"):
        storage.read_file_verified(tmp_path / "d.json", record)


def test_finiteness_check_is_exact_even_when_a_sum_overflows(tmp_path):
    huge = torch.full((8,), 3.0e38)  # finite values whose float32 sum overflows
    storage.save_tensors(tmp_path / "h.safetensors", {"w": huge}, finite=True)
    for bad in (float("nan"), float("inf"), float("-inf")):
        tensor = huge.clone()
        tensor[3] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            storage.save_tensors(tmp_path / "x.safetensors", {"w": tensor}, finite=True)
    mixed = torch.tensor([float("inf"), float("-inf")])  # the sum is NaN, still caught
    with pytest.raises(ValueError, match="NaN or Inf"):
        storage.save_tensors(tmp_path / "y.safetensors", {"w": mixed}, finite=True)
