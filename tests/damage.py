"""Helpers that damage a committed generation in controlled ways (for negative tests)."""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import torch

from miles_lora_ckpt.core import checked_reads, safetensors_write
from miles_lora_ckpt.core.digest import digest_bytes
from miles_lora_ckpt.core.layout import MANIFEST, seal_manifest


def edit_manifest(gen: Path, change, *, keep_signature: bool = True) -> None:
    """Apply `change(body)` to the manifest and reseal it (a consistent-looking manifest), as a
    forger without the signing key would: a signature is kept as it was (or dropped)."""
    body = json.loads((gen / MANIFEST).read_text())
    body.pop("manifest_digest")
    signature = body.pop("signature", None)
    change(body)
    sealed = json.loads(seal_manifest(body))
    if signature is not None and keep_signature:
        sealed["signature"] = signature
    (gen / MANIFEST).write_text(json.dumps(sealed, indent=1, sort_keys=True))


def reseal_file(gen: Path, rel: str, data: bytes, *, finite: bool | None = None) -> None:
    """Replace a file and make the manifest agree with it (a forgery only the loader can catch)."""
    (gen / rel).write_bytes(data)

    def change(body):
        body["files"][rel].update(bytes=len(data), digest=digest_bytes(data))
        body["files"][rel].pop("blocks", None)  # a forger drops the block index: the file is then read whole
        if finite is False:
            body["files"][rel].pop("finite", None)

    edit_manifest(gen, change)


def rewrite_tensors(gen: Path, rel: str, change, *, finite: bool | None = None) -> None:
    """Load a safetensors file of the generation, `change(dict)` it, write it back resealed (with
    its own metadata, so its generation stamp still matches: only the tensors are forged)."""
    tensors, metadata = checked_reads.load_tensors(gen / rel)
    tensors = {k: v.clone() for k, v in tensors.items()}
    change(tensors)
    with tempfile.TemporaryDirectory() as tmp:
        safetensors_write.save_tensors(Path(tmp) / "x.safetensors", tensors, metadata=metadata)
        reseal_file(gen, rel, (Path(tmp) / "x.safetensors").read_bytes(), finite=finite)


def rebind(gen: Path, rel: str, **binding: str) -> None:
    """Re-stamp a tensor file with another binding and list it so in the manifest (resealed): stamp
    and manifest agree, so verification passes; only a reader that knows what belongs there refuses."""
    tensors, metadata = checked_reads.load_tensors(gen / rel)
    with tempfile.TemporaryDirectory() as tmp:
        safetensors_write.save_tensors(Path(tmp) / "x.safetensors", tensors, metadata={**metadata, **binding})
        data = (Path(tmp) / "x.safetensors").read_bytes()
    (gen / rel).write_bytes(data)

    def change(body):
        body["files"][rel].update(bytes=len(data), digest=digest_bytes(data))
        body["files"][rel].pop("blocks", None)  # a forger drops the block index: the file is then read whole
        body["files"][rel]["binding"].update(binding)

    edit_manifest(gen, change)


def transplant_tensors(gen: Path, rel: str, donor: Path, donor_rel: str | None = None) -> None:
    """Put the tensors of `donor`'s file (another generation's, or another file's) into `rel`, under
    `rel`'s own stamp, resealed: every digest, stamp and binding agrees; only the content is foreign."""
    foreign, _ = checked_reads.load_tensors(donor / (donor_rel or rel))
    foreign = {k: v.clone() for k, v in foreign.items()}

    def change(tensors):
        tensors.clear()
        tensors.update(foreign)

    rewrite_tensors(gen, rel, change)


def swap_tensors(gen: Path, first: str, second: str) -> None:
    """Exchange the tensors of two files, each keeping its own stamp and binding (resealed): a swap
    that stamps, bindings and digests all accept."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(gen, Path(tmp) / "copy")
        transplant_tensors(gen, first, Path(tmp) / "copy", second)
        transplant_tensors(gen, second, Path(tmp) / "copy", first)


def drop_file(gen: Path, rel: str) -> None:
    """Delete a file and its manifest entry: a torn generation whose manifest still verifies."""
    (gen / rel).unlink()
    edit_manifest(gen, lambda body: body["files"].pop(rel))


def torch_pickle_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        torch.save({"param": torch.ones(3)}, Path(tmp) / "p.pt")
        return (Path(tmp) / "p.pt").read_bytes()


def swap_files(gen: Path, first: str, second: str) -> None:
    """Exchange two files and reseal the manifest to match (a swap only the stamps reveal)."""
    a, b = (gen / first).read_bytes(), (gen / second).read_bytes()
    reseal_file(gen, first, b)
    reseal_file(gen, second, a)


def edit_training_state(gen: Path, change, rel: str = "training_state.json") -> None:
    """Apply `change(state)` to a JSON training state and reseal it (a forged, consistent state)."""
    state = json.loads((gen / rel).read_text())
    change(state)
    reseal_file(gen, rel, json.dumps(state).encode())


def set_param_group(state: dict, **values) -> None:
    """Set hyperparameters in the first param group of the first optimizer child of a training state."""
    child = next(iter(state["optimizer_children"].values()))
    groups = _find_param_groups(child)
    groups[0].update(values)


def _find_param_groups(node):
    if isinstance(node, dict):
        if isinstance(node.get("param_groups"), list):
            return node["param_groups"]
        for value in node.values():
            found = _find_param_groups(value)
            if found is not None:
                return found
    return None


def rewrite_header(gen: Path, rel: str, change) -> None:
    """Rewrite a safetensors file's header (`change(header)` edits the dict in place, or returns raw
    header bytes) keeping its data, and reseal it: a forgery only the header checks can catch."""
    raw = (gen / rel).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    replaced = change(header)
    header_bytes = replaced if isinstance(replaced, bytes) else json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    reseal_file(gen, rel, struct.pack("<Q", len(header_bytes)) + header_bytes + raw[8 + length :])


def write_manifest_text(gen: Path, change, raw_values: dict[str, str]) -> None:
    """Write a manifest whose JSON text carries raw values (e.g. `1e999`) where `change(body)` put the
    placeholders named in `raw_values`; a self-digest is added over that text."""
    body = json.loads((gen / MANIFEST).read_text())
    body.pop("manifest_digest")
    change(body)
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    for placeholder, raw in raw_values.items():
        text = text.replace(json.dumps(placeholder), raw)
    digest = digest_bytes(text.encode())
    (gen / MANIFEST).write_text(text[:-1] + f',"manifest_digest":"{digest}"}}')


def nested(depth: int) -> bytes:
    """JSON nested `depth` levels deep."""
    return b"[" * depth + b"]" * depth


def to_gathered_layout(gen: Path) -> None:
    """Rewrite a generation's DistributedOptimizer slices into the layout written before slices:
    one file per child and coordinate (`child{i}_{coordinate}.safetensors`, as its DP root wrote
    it) holding `buf{g}.{key}` world tensors, and layouts without `slices` (a legacy generation)."""
    body = json.loads((gen / MANIFEST).read_text())
    for index, child in body["metadata"]["optimizer_children"].items():
        layout = child.get("layout", {})
        if child["family"] != "distributed" or "slices" not in layout:
            continue
        for key, slices in layout.pop("slices").items():
            parts: dict[str, list] = {}
            numels = layout["numel_unpadded"][key]
            for buf, per_bucket in numels.items():
                for b in range(len(per_bucket)):
                    for state_key in ("param", *child["keys"]):
                        name = f"{buf}.bucket{b}.{state_key}"
                        pieces = [checked_reads.load_tensors(gen / s["file"])[0].get(name) for s in slices]
                        parts.setdefault(f"{buf}.{state_key}", []).append(
                            torch.cat([p for p in pieces if p is not None])
                        )
            for entry in slices:
                (gen / entry["file"]).unlink()
                body["files"].pop(entry["file"])
            rel = f"optimizer/child{index}_{key}.safetensors"
            binding = {"role": "optimizer", "coordinate": key, "child": index}
            stamp = {"generation": body["generation"], "file": rel, **binding}
            tensors = {name: torch.cat(p) for name, p in parts.items()}
            record = safetensors_write.save_tensors(gen / rel, tensors, metadata=stamp, finite=True)
            body["files"][rel] = {**record.to_dict(), "binding": binding}
    (gen / MANIFEST).write_text(json.dumps(body))
    edit_manifest(gen, lambda b: None)
