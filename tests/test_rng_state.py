"""RNG states as sealed files (`core.rng_state`): the round trip through the protocol, `verify`,
and the refusal of malformed or oversized RNG files. In one process, no megatron: the resume
itself (dropout, layouts, pre-change generations) is in test_single_lora and test_demo*."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy
import pytest
import torch
from damage import reseal_file, rewrite_tensors

from miles_lora_ckpt.core import checked_reads, content_rules, json_files, rng_state
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.layout import Topology
from miles_lora_ckpt.core.protocol import save_generation
from miles_lora_ckpt.core.verify import verify_generation


def _draws() -> tuple:
    return random.random(), random.gauss(0, 1), numpy.random.rand(3).tolist(), torch.rand(4).tolist()


def _save_rng(root: Path, state: rng_state.RngState, rank: int = 0) -> Path:
    """A single-LoRA-named generation holding rank `rank`'s RNG files only, through the protocol."""
    value, tensors = rng_state.encode(state, rank)

    def write(writer):
        writer.write_tensors(rng_state.tensor_file(rank), tensors, binding=rng_state.binding(rank))
        writer.write_json(rng_state.json_file(rank), value, binding=rng_state.binding(rank))

    return save_generation(
        Consensus.single_process(),
        root,
        iteration=1,
        saver="single-lora",
        topology=Topology(),
        write_files=write,
        metadata={"rng_saved": True},
    )


def _read(gen: Path, rank: int = 0) -> rng_state.RngState:
    value = json_files.parse_json((gen / rng_state.json_file(rank)).read_bytes())
    tensors, _ = checked_reads.load_tensors(gen / rng_state.tensor_file(rank))
    return rng_state.decode(value, tensors, rank)


def test_round_trip_through_a_sealed_generation_continues_every_generator(tmp_path):
    random.seed(5), numpy.random.seed(6), torch.manual_seed(7)
    random.gauss(0, 1)  # Python keeps the second Gaussian of a pair: gauss_next is saved too
    tracker = {"model-parallel-rng": torch.Generator().manual_seed(9).get_state()}
    gen = _save_rng(tmp_path / "ckpt", rng_state.capture(tracker))
    expected = _draws()
    assert verify_generation(gen).problems == []
    manifest = json.loads((gen / "manifest.json").read_text())
    assert manifest["files"][rng_state.json_file(0)]["binding"] == {"role": "rng-state", "rank": "0"}
    assert manifest["files"][rng_state.tensor_file(0)]["binding"] == {"role": "rng-state", "rank": "0"}
    random.seed(1), numpy.random.seed(1), torch.manual_seed(1)  # anything else in between
    restored = _read(gen)
    rng_state.restore(restored)
    assert _draws() == expected
    assert restored.tracker["model-parallel-rng"].equal(tracker["model-parallel-rng"])
    assert restored.kinds() == ["python", "numpy", "torch", "tracker(1)"]


@pytest.mark.parametrize(
    "name, change, reason",
    [
        ("python state cut", lambda v: v["python"].update(state=v["python"]["state"][:3]), "rng.python.state"),
        ("python word out of range", lambda v: v["python"]["state"].__setitem__(0, 2**32), "rng.python.state[0]"),
        ("numpy of another generator", lambda v: v["numpy"].update(bit_generator="PCG64"), "MT19937"),
        ("another rank's file", lambda v: v.update(rank=1), "rng.rank is 1, but the file is rank 0's"),
        ("unknown key", lambda v: v.update(pickle="x"), "rng: keys"),
        ("a tensor name not allowed", lambda v: v.update(tensors=["../x"]), "RNG tensor name"),
    ],
)
def test_a_malformed_rng_json_is_refused_by_verify_and_the_loader_alike(tmp_path, name, change, reason):
    gen = _save_rng(tmp_path / "ckpt", rng_state.capture())
    value = json.loads((gen / rng_state.json_file(0)).read_text())
    change(value)
    reseal_file(gen, rng_state.json_file(0), json_files.json_bytes(value))
    problems = [p.reason for p in verify_generation(gen).problems]
    assert len(problems) == 1 and reason in problems[0], (name, problems)
    with pytest.raises(ValueError, match=None) as raised:
        _read(gen)
    assert reason in str(raised.value), name


def test_an_oversized_rng_file_is_refused_from_the_manifest_before_it_is_read(tmp_path):
    gen = _save_rng(tmp_path / "ckpt", rng_state.capture())
    padded = json_files.json_bytes(json.loads((gen / rng_state.json_file(0)).read_text())) + b" " * (
        rng_state.MAX_RNG_FILE_BYTES
    )
    reseal_file(gen, rng_state.json_file(0), padded)
    problems = [f"{p.file}: {p.reason}" for p in verify_generation(gen).problems]
    assert any(f"more than the {rng_state.MAX_RNG_FILE_BYTES} allowed" in p for p in problems), problems


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda t: t.update({rng_state.CPU: t[rng_state.CPU].float()}), "not uint8"),
        (lambda t: t.update({rng_state.CPU: t[rng_state.CPU].reshape(2, -1)}), "has shape"),
    ],
)
def test_an_rng_tensor_file_holds_1d_uint8_tensors_only(tmp_path, change, reason):
    gen = _save_rng(tmp_path / "ckpt", rng_state.capture())
    rewrite_tensors(gen, rng_state.tensor_file(0), change)
    problems = [p.reason for p in verify_generation(gen).problems]
    assert len(problems) == 1 and reason in problems[0], problems
    with pytest.raises(ValueError, match=reason):
        _read(gen)


def test_a_state_of_another_size_is_refused_before_anything_is_set():
    value, tensors = rng_state.encode(rng_state.capture(), 0)
    tensors[rng_state.CPU] = tensors[rng_state.CPU][:-1]
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match="the generator state here"):
        rng_state.decode(value, tensors, 0)
    assert torch.get_rng_state().equal(before)


def test_rng_files_carry_the_binding_their_name_implies():
    assert content_rules.named_binding("single-lora", "rng/rank00012.json") == {"role": "rng-state", "rank": "12"}
    assert content_rules.named_binding("single-lora", "rng/rank00012.safetensors") == rng_state.binding(12)
    assert content_rules.named_binding("single-lora", "rng/rank12.json") is None


def test_verify_and_inspect_show_the_rng_states(tmp_path, capsys):
    from miles_lora_ckpt.tools.cli import main as cli

    gen = _save_rng(tmp_path / "ckpt", rng_state.capture())
    assert cli(["verify", str(gen)]) == 0
    assert "RNG states of 1 rank(s), restored at this layout only)" in capsys.readouterr().out
    assert cli(["inspect", str(gen)]) == 0
    out = capsys.readouterr().out
    assert "rng         RNG states of 1 rank(s), restored at this layout only" in out
    assert "rng/rank00000.safetensors  [rank=0 role=rng-state]" in out


@pytest.mark.megatron
def test_megatrons_tracker_states_round_trip_and_a_state_of_another_size_is_refused():
    from miles_lora_ckpt_harness.sim.cpu_intercepts import install_typing_override

    install_typing_override()
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from miles_lora_ckpt.megatron import rng_tracker

    tracker = get_cuda_rng_tracker()
    kept = (tracker.get_states(), tracker.is_initialized())
    try:
        tracker.reset()
        assert rng_tracker.capture() is None  # never seeded: nothing to save
        cuda_sized = {"model-parallel-rng": torch.arange(16, dtype=torch.uint8)}  # a CUDA generator's 16 bytes
        tracker.set_states(dict(cuda_sized))
        saved = rng_tracker.capture()
        assert saved.keys() == cuda_sized.keys() and saved["model-parallel-rng"].equal(cuda_sized["model-parallel-rng"])
        tracker.set_states({"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)})
        rng_tracker.check_restorable(saved)
        rng_tracker.restore(saved)
        assert tracker.get_states()["model-parallel-rng"].equal(cuda_sized["model-parallel-rng"])
        with pytest.raises(ValueError, match="has 16 bytes here, the checkpoint's 5056"):
            rng_tracker.check_restorable({"model-parallel-rng": torch.get_rng_state()})  # a CPU state
    finally:
        tracker.reset()
        if kept[1]:
            tracker.set_states(kept[0])
