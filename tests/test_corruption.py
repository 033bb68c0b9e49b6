"""The corruption corpus: every case makes `verify` exit 1 naming the file, and loading refuse.

Each case starts from a freshly committed generation and damages it one way. Loading goes through
`protocol.open_generation`, the only door every loader of this project uses, so a refusal here is
a refusal before any model or optimizer is touched.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from damage import edit_manifest, reseal_file

from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import MANIFEST, Topology
from miles_lora_ckpt.core.protocol import open_generation, save_generation
from miles_lora_ckpt.tools.cli import main as cli

ADAPTER = "adapter/tp00_pp00.safetensors"
OPTIM = "optim/child0.safetensors"
STATE = "state.json"


def make_generation(root: Path, iteration: int = 7) -> Path:
    def write(writer):
        writer.write_tensors(ADAPTER, {"lora_A": torch.randn(4, 8), "lora_B": torch.randn(8, 4).bfloat16()})
        writer.write_tensors(OPTIM, {"param": torch.randn(64), "exp_avg": torch.randn(64)})
        writer.write_json(STATE, {"iteration": iteration, "scheduler": {"num_steps": iteration}})

    return save_generation(
        Consensus.single_process(),
        root,
        iteration=iteration,
        saver="test",
        topology=Topology(),
        write_files=write,
    )


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def tensor_file_with(value: float) -> bytes:
    import tempfile

    from miles_lora_ckpt.core import storage

    with tempfile.TemporaryDirectory() as tmp:
        storage.save_tensors(
            Path(tmp) / "x.safetensors", {"lora_A": torch.tensor([1.0, value]), "lora_B": torch.ones(2)}
        )
        return (Path(tmp) / "x.safetensors").read_bytes()


def pickle_payload() -> bytes:
    return pickle.dumps({"lora_A": [1.0, 2.0]})


def torch_pickle_payload(tmp: Path) -> bytes:
    torch.save({"lora_A": torch.ones(2)}, tmp / "p.pt")
    return (tmp / "p.pt").read_bytes()


CASES = {
    # name: (damage(gen, tmp_path), file the error must name)
    "truncated tensor file": (
        lambda g, t: (g / ADAPTER).write_bytes((g / ADAPTER).read_bytes()[:-9]),
        ADAPTER,
    ),
    "truncated to zero": (lambda g, t: (g / OPTIM).write_bytes(b""), OPTIM),
    "bit flip in tensor data": (lambda g, t: flip_byte(g / ADAPTER, -3), ADAPTER),
    "bit flip in safetensors header": (lambda g, t: flip_byte(g / OPTIM, 12), OPTIM),
    "bit flip in json": (lambda g, t: flip_byte(g / STATE, 3), STATE),
    "deleted tensor file": (lambda g, t: (g / OPTIM).unlink(), OPTIM),
    "deleted json": (lambda g, t: (g / STATE).unlink(), STATE),
    "deleted manifest": (lambda g, t: (g / MANIFEST).unlink(), MANIFEST),
    "extra file": (
        lambda g, t: (g / "adapter" / "stray.safetensors").write_bytes(b"x"),
        "adapter/stray.safetensors",
    ),
    "leftover temp file": (
        lambda g, t: (g / ".state.json.tmp-1234").write_bytes(b"{}"),
        ".state.json.tmp-1234",
    ),
    "renamed file": (lambda g, t: os.rename(g / ADAPTER, g / "adapter/tp01_pp00.safetensors"), ADAPTER),
    "edited manifest (digest not resealed)": (
        lambda g, t: (g / MANIFEST).write_text((g / MANIFEST).read_text().replace('"iteration": 7', '"iteration": 8')),
        MANIFEST,
    ),
    "truncated manifest": (
        lambda g, t: (g / MANIFEST).write_bytes((g / MANIFEST).read_bytes()[:50]),
        MANIFEST,
    ),
    "resealed manifest with a wrong size": (
        lambda g, t: edit_manifest(g, lambda b: b["files"][OPTIM].update(bytes=b["files"][OPTIM]["bytes"] + 4)),
        OPTIM,
    ),
    "resealed manifest with a wrong digest": (
        lambda g, t: edit_manifest(g, lambda b: b["files"][STATE].update(digest="xxh3_128:" + "0" * 32)),
        STATE,
    ),
    "manifest of another generation": (
        lambda g, t: shutil.copy(make_generation(t / "other") / MANIFEST, g / MANIFEST),
        MANIFEST,
    ),
    "file of another generation": (
        lambda g, t: shutil.copy(make_generation(t / "other", iteration=7) / ADAPTER, g / ADAPTER),
        ADAPTER,
    ),
    "symlink escaping the generation": (
        lambda g, t: (
            (g / OPTIM).unlink(),
            (t / "outside").write_bytes(b"x"),
            (g / OPTIM).symlink_to(t / "outside"),
        ),
        OPTIM,
    ),
    "symlinked directory": (lambda g, t: (g / "linkdir").symlink_to(t, target_is_directory=True), "linkdir"),
    "manifest path escaping with ..": (
        lambda g, t: edit_manifest(g, lambda b: b["files"].__setitem__("../escape.json", b["files"].pop(STATE))),
        "../escape.json",
    ),
    "absolute path in manifest": (
        lambda g, t: edit_manifest(g, lambda b: b["files"].__setitem__("/etc/passwd", b["files"].pop(STATE))),
        "/etc/passwd",
    ),
    "pickle payload in place of safetensors": (
        lambda g, t: (g / ADAPTER).write_bytes(pickle_payload()),
        ADAPTER,
    ),
    "resealed torch.save payload in place of safetensors": (
        lambda g, t: reseal_file(g, ADAPTER, torch_pickle_payload(t)),
        ADAPTER,
    ),
    "resealed pickle in place of json": (lambda g, t: reseal_file(g, STATE, pickle_payload()), STATE),
    "resealed NaN where finite values are required": (
        lambda g, t: reseal_file(g, ADAPTER, tensor_file_with(float("nan"))),
        ADAPTER,
    ),
    "resealed Inf where finite values are required": (
        lambda g, t: reseal_file(g, ADAPTER, tensor_file_with(float("-inf"))),
        ADAPTER,
    ),
    "resealed unsupported format version": (
        lambda g, t: edit_manifest(g, lambda b: b.update(format_version=99)),
        MANIFEST,
    ),
    "resealed non-finite JSON constant": (lambda g, t: reseal_file(g, STATE, b'{"iteration": NaN}'), STATE),
}


@pytest.fixture(params=sorted(CASES), ids=lambda name: name.replace(" ", "-"))
def damaged(request, tmp_path):
    damage, named_file = CASES[request.param]
    root = tmp_path / "root"
    gen = make_generation(root)
    damage(gen, tmp_path)
    return gen, named_file


def test_corpus_is_large_enough():
    assert len(CASES) >= 20


def test_verify_exits_1_and_names_the_file(damaged, capsys):
    gen, named_file = damaged
    assert cli(["verify", str(gen)]) == 1
    out = capsys.readouterr().out
    assert f"ERROR {named_file}:" in out, out


def test_loading_refuses(damaged):
    gen, named_file = damaged
    with pytest.raises(CheckpointError) as info:
        open_generation(Consensus.single_process(), gen, lambda manifest: [ADAPTER, OPTIM])
    assert named_file in str(info.value) or "manifest" in str(info.value)


def test_root_falls_back_past_a_damaged_newest_generation(tmp_path, caplog, capsys):
    root = tmp_path / "root"
    older = make_generation(root, iteration=5)
    newest = make_generation(root, iteration=6)
    flip_byte(newest / ADAPTER, -2)
    opened = open_generation(Consensus.single_process(), root, lambda m: [ADAPTER])
    assert opened.path == older
    assert "skipping damaged generation" in caplog.text and newest.name in caplog.text
    assert cli(["verify", str(root)]) == 0
    assert newest.name in capsys.readouterr().err
    assert cli(["verify", str(root), "--all"]) == 1


def test_staging_directory_is_never_a_checkpoint(tmp_path, capsys):
    root = tmp_path / "root"
    make_generation(root)
    staging = root / ".staging-0123456789abcdef"
    staging.mkdir()
    (staging / "x.json").write_text("{}")
    assert cli(["verify", str(staging)]) == 1
    assert "uncommitted staging" in capsys.readouterr().out
    for gen in root.glob("gen-*"):
        shutil.rmtree(gen)
    (root / "latest_generation.json").unlink()
    assert cli(["verify", str(root)]) == 1
    with pytest.raises(CheckpointError, match="no committed generation"):
        open_generation(Consensus.single_process(), root, lambda m: [])
