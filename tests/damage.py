"""Helpers that damage a committed generation in controlled ways (for negative tests)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from miles_lora_ckpt.core import storage
from miles_lora_ckpt.core.digest import digest_bytes
from miles_lora_ckpt.core.layout import MANIFEST, seal_manifest


def edit_manifest(gen: Path, change) -> None:
    """Apply `change(body)` to the manifest and reseal it (a consistent-looking manifest)."""
    body = json.loads((gen / MANIFEST).read_text())
    body.pop("manifest_digest")
    change(body)
    (gen / MANIFEST).write_bytes(seal_manifest(body))


def reseal_file(gen: Path, rel: str, data: bytes, *, finite: bool | None = None) -> None:
    """Replace a file and make the manifest agree with it (a forgery only the loader can catch)."""
    (gen / rel).write_bytes(data)

    def change(body):
        body["files"][rel].update(bytes=len(data), digest=digest_bytes(data))
        if finite is False:
            body["files"][rel].pop("finite", None)

    edit_manifest(gen, change)


def rewrite_tensors(gen: Path, rel: str, change, *, finite: bool | None = None) -> None:
    """Load a safetensors file of the generation, `change(dict)` it, write it back resealed."""
    tensors, _ = storage.load_tensors(gen / rel)
    tensors = {k: v.clone() for k, v in tensors.items()}
    change(tensors)
    with tempfile.TemporaryDirectory() as tmp:
        storage.save_tensors(Path(tmp) / "x.safetensors", tensors)
        reseal_file(gen, rel, (Path(tmp) / "x.safetensors").read_bytes(), finite=finite)


def drop_file(gen: Path, rel: str) -> None:
    """Delete a file and its manifest entry: a torn generation whose manifest still verifies."""
    (gen / rel).unlink()
    edit_manifest(gen, lambda body: body["files"].pop(rel))


def torch_pickle_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        torch.save({"param": torch.ones(3)}, Path(tmp) / "p.pt")
        return (Path(tmp) / "p.pt").read_bytes()
