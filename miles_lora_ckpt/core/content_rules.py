"""The content rules of a generation's files: the one place every reader's checks live.

`verify` and every loader read a listed file through `verify.check_file_content` (whole) or
`verify.check_file_ranges` (some element ranges), and those apply exactly the rules here, after
`storage` has checked the bytes (size, digests, a strict safetensors header with legal tensor
names, finite floats, bounded UTF-8 JSON). So `verify` refuses what a loader refuses, for the same
reason, and no loader holds a content check of its own that `verify` lacks:

- a format v2 tensor file carries its stamp: its generation, its own path and its manifest
  binding (`check_stamps`);
- an optimizer file of a `distributed` child (a DistributedOptimizer's masters and moments, sliced
  over DP) holds float32 tensors only (`check_tensor_dtypes`): its loader installs them into fp32
  buffers and refuses anything else;
- a `training-state` file satisfies `training_state.check` (scheduler keys and decay styles,
  hyperparameter ranges, tagged values, iteration and generation).

And one rule on the manifest itself (`check_manifest`, applied by `verify.check_structure`, which
every loader runs first): a manifest whose metadata says `optimizer_saved: false` lists no
optimizer file and no optimizer child that stepped (`check_optimizer_claim`; the single-LoRA
loader calls it too).

Imports neither megatron nor Miles: what a saver's loader requires of its files is stated here as
data the manifest carries (roles, bindings, the optimizer children's families).
"""

from __future__ import annotations

from typing import Any

from miles_lora_ckpt.core import training_state
from miles_lora_ckpt.core.layout import ROLE_TRAINING_STATE, STAMP_KEYS, Manifest

ROLE_OPTIMIZER = "optimizer"
DISTRIBUTED_FAMILY = "distributed"
DISTRIBUTED_DTYPE = "F32"


def check_tensor_file(relpath: str, manifest: Manifest, metadata: dict[str, str], dtypes: dict[str, str]) -> None:
    """Every rule for a listed tensor file, given its safetensors metadata and `{tensor: dtype tag}`
    (from its header, or from the manifest's block index that was checked against it)."""
    if manifest.format_version >= 2:
        check_stamps(relpath, manifest, metadata)
    check_tensor_dtypes(relpath, manifest, dtypes)


def check_json_file(relpath: str, manifest: Manifest, value: Any) -> None:
    """Every rule for a listed file that is not a tensor file, given its parsed JSON value (None
    for a file that is not JSON: a training state must be JSON)."""
    if manifest.role_of(relpath) == ROLE_TRAINING_STATE:
        training_state.check(
            value,
            iteration=manifest.iteration,
            generation=manifest.generation,
            format_version=manifest.format_version,
        )


def check_manifest(manifest: Manifest) -> None:
    """Every rule on a manifest's own content (beyond its fields' shapes)."""
    check_optimizer_claim(manifest)


def check_optimizer_claim(manifest: Manifest) -> None:
    """`optimizer_saved: false` must mean no optimizer state: no listed optimizer file (role
    `optimizer`, or under `optimizer/`) and no optimizer child recorded as stepped (in
    `optimizer_children`, or a pre-family generation's `stepped_children`); else it was edited.

    `optimizer_saved`, when present, is a boolean: loaders restore optimizer state only when it is
    `true`, so any other value (`null`, `0`, `"false"`) would otherwise drop the saved optimizer
    state unnoticed, without the refusal that `false` gets."""
    metadata = manifest.metadata
    if "optimizer_saved" in metadata and not isinstance(metadata["optimizer_saved"], bool):
        raise ValueError(
            f"the manifest's optimizer_saved is {metadata['optimizer_saved']!r:.60}, not a boolean (true or false): edited?"
        )
    if metadata.get("optimizer_saved") is not False:
        return
    listed = sorted(
        rel for rel in manifest.files if rel.startswith("optimizer/") or manifest.role_of(rel) == ROLE_OPTIMIZER
    )
    children = metadata.get("optimizer_children")
    if isinstance(children, dict):
        stepped = sorted(str(i) for i, entry in children.items() if isinstance(entry, dict) and entry.get("stepped"))
    else:
        stepped = sorted(str(i) for i in metadata.get("stepped_children") or [])
    if listed or stepped:
        first = listed[0] if listed else f"optimizer_children: child {stepped[0]} stepped"
        raise ValueError(f"the manifest says optimizer_saved is false, yet lists optimizer state ({first}): edited?")


def check_stamps(relpath: str, manifest: Manifest, metadata: dict[str, str]) -> None:
    record = manifest.files[relpath]
    keys = (*STAMP_KEYS, *sorted(record.binding))
    missing = [k for k in keys if k not in metadata]
    if missing:
        raise ValueError(
            f"safetensors metadata has no {', '.join(repr(k) for k in missing)} (a format v2 tensor file "
            "carries its generation, its path and its binding)"
        )
    stamped = {k: metadata[k] for k in keys}
    listed = {"generation": manifest.generation, "file": relpath, **record.binding}
    if stamped != listed:
        raise ValueError(
            f"the file says it is {_identity(stamped)}, but the manifest lists it as {_identity(listed)} "
            "(copied from another generation, or swapped with another file)"
        )


def check_tensor_dtypes(relpath: str, manifest: Manifest, dtypes: dict[str, str]) -> None:
    """An optimizer file of a `distributed` child holds float32 tensors only."""
    if distributed_child(relpath, manifest) is None:
        return
    wrong = sorted(name for name, tag in dtypes.items() if tag != DISTRIBUTED_DTYPE)
    if wrong:
        raise ValueError(
            f"tensor {wrong[0][:80]!r} is {dtypes[wrong[0]]}, but an optimizer file of a DistributedOptimizer "
            f"child holds {DISTRIBUTED_DTYPE} only ({len(wrong)} tensor(s) are not)"
        )


def distributed_child(relpath: str, manifest: Manifest) -> str | None:
    """The child index of an optimizer file whose child the manifest records as a `distributed`
    one (its `optimizer_children[child].family`, or, for a generation written before every child
    family was saved, its `state_keys`, which described DistributedOptimizer children only)."""
    record = manifest.files.get(relpath)
    if record is None or manifest.role_of(relpath) != ROLE_OPTIMIZER or "child" not in record.binding:
        return None
    child, metadata = record.binding["child"], manifest.metadata
    children = metadata.get("optimizer_children")
    if isinstance(children, dict):
        entry = children.get(child)
        family = entry.get("family") if isinstance(entry, dict) else None
        return child if family == DISTRIBUTED_FAMILY else None
    state_keys = metadata.get("state_keys")
    return child if children is None and isinstance(state_keys, dict) and child in state_keys else None


def _identity(stamp: dict[str, str]) -> str:
    return "[" + ", ".join(f"{k} {v[:80]}" for k, v in stamp.items()) + "]"
