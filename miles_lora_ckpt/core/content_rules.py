"""The content rules of a generation's files: the one place every reader's checks live.

`verify` and every loader apply exactly these rules, after `checked_reads` or `partial_reads`
checked the bytes. So `verify` refuses what a loader refuses, for the same reason. By file:

- a format v2 tensor file carries its stamp: generation, path and binding (`check_stamps`);
- a `distributed` child's optimizer file holds float32 tensors only (`check_tensor_dtypes`);
- `training-state`, `rng-state` and `rollout-data-state` files pass their modules' `check`.

On the manifest (`check_manifest`): a consistent global layout (`layout_rules.check`), an honest
`optimizer_saved: false` (`check_optimizer_claim`), and bounded RNG files. Rules are chosen by a
file's role, so a file named like a single-LoRA file must carry the binding its name implies
(`binding_problems`). Imports neither megatron nor Miles: loaders' requirements are stated as
data the manifest carries.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from miles_lora_ckpt.core import data_state, layout_rules, rng_state, training_state
from miles_lora_ckpt.core.errors import GenerationDamaged
from miles_lora_ckpt.core.family_kind import FamilyKind
from miles_lora_ckpt.core.layout import ROLE_TRAINING_STATE, STAMP_KEYS, Manifest

ROLE_OPTIMIZER = "optimizer"
DISTRIBUTED_DTYPE = "F32"

__all__ = [
    "BOUND_SAVERS",
    "binding_problems",
    "check_json_file",
    "check_manifest",
    "check_optimizer_claim",
    "check_tensor_file",
    "named_binding",
]

# The savers that write the single-LoRA files (`savers.single_lora.SAVER`,
# `savers.multi_lora.SLOT_SAVER`), and the binding each of their file names implies. Their
# loaders require these of each file they read (`savers/single_lora/common.py`,
# `megatron/optimizer_children`).
BOUND_SAVERS = ("single-lora", "multi-lora-slot")
_COORDINATE = r"tp[0-9]+_pp[0-9]+_ep[0-9]+_etp[0-9]+"
_NAMED_BINDINGS: tuple[tuple[re.Pattern, Callable[[re.Match], dict[str, str]]], ...] = (
    (re.compile(r"training_state\.json\Z"), lambda m: {"role": ROLE_TRAINING_STATE}),
    (re.compile(r"rng/rank[0-9]{5}\.(?:json|safetensors)\Z"), lambda m: rng_state.named_binding(m[0])),
    (re.compile(r"rollout_data_state\.json\Z"), lambda m: {"role": data_state.ROLE_DATA_STATE}),
    (
        re.compile(r"adapter/dense_(tp[0-9]+_pp[0-9]+)\.safetensors\Z"),
        lambda m: {"role": "dense-adapter", "coordinate": m[1]},
    ),
    (
        re.compile(r"adapter/expert_(pp[0-9]+_ep[0-9]+_etp[0-9]+)\.safetensors\Z"),
        lambda m: {"role": "expert-adapter", "coordinate": m[1]},
    ),
    (
        re.compile(
            rf"optimizer/child([0-9]+)_({_COORDINATE}(?:_dp[0-9]+_cp[0-9]+)?)(?:_s([0-9]+)of([0-9]+))?\.safetensors\Z"
        ),
        lambda m: {
            "role": ROLE_OPTIMIZER,
            "coordinate": m[2],
            "child": m[1],
            **({"slice": f"{int(m[3])}/{int(m[4])}"} if m[3] is not None else {}),
        },
    ),
)


def check_tensor_file(
    relpath: str,
    manifest: Manifest,
    metadata: dict[str, str],
    dtypes: dict[str, str],
    shapes: dict[str, list[int]] | None = None,
) -> None:
    """Apply every rule for the listed tensor file `relpath`; GenerationDamaged if one fails.

    `metadata` is its safetensors metadata and `dtypes` its `{tensor: dtype tag}`, from its header
    or the checked block index. `shapes` is `{tensor: shape}` where the header was read.
    """
    if manifest.format_version >= 2:
        check_stamps(relpath, manifest, metadata)
    layout_rules.check_stamp(relpath, manifest, metadata)
    layout_rules.check_file_tensors(relpath, manifest, dtypes, shapes)
    check_tensor_dtypes(relpath, manifest, dtypes)
    if manifest.role_of(relpath) == rng_state.ROLE_RNG:
        try:
            rng_state.check_tensors({name: (tag, (shapes or {}).get(name)) for name, tag in dtypes.items()})
        except ValueError as exc:  # the RNG rules' refusals are damage
            raise GenerationDamaged(f"{relpath}: {exc}") from None


def check_json_file(relpath: str, manifest: Manifest, value: Any) -> None:
    """Apply every rule for the listed non-tensor file `relpath`; GenerationDamaged if one fails.

    `value` is its parsed JSON, or None for a file that is not JSON.
    """
    if manifest.role_of(relpath) == ROLE_TRAINING_STATE:
        try:
            training_state.check(
                value,
                iteration=manifest.iteration,
                generation=manifest.generation,
                format_version=manifest.format_version,
            )
        except ValueError as exc:  # its rules' refusals are damage
            raise GenerationDamaged(str(exc)) from None
    elif manifest.role_of(relpath) == rng_state.ROLE_RNG:
        try:
            rng_state.check(value, _bound_rank(manifest, relpath))
        except ValueError as exc:  # the RNG rules' refusals are damage too
            raise GenerationDamaged(f"{relpath}: {exc}") from None
    elif manifest.role_of(relpath) == data_state.ROLE_DATA_STATE:
        try:
            data_state.check(value, iteration=manifest.iteration)
        except ValueError as exc:  # the data state's rules' refusals are damage too
            raise GenerationDamaged(f"{relpath}: {exc}") from None


def check_manifest(manifest: Manifest) -> None:
    """Apply every rule on a manifest's own content, beyond its fields' shapes; GenerationDamaged.

    That is the optimizer claim, the RNG file sizes and a format-v3 global layout's structure.
    """
    check_optimizer_claim(manifest)
    check_rng_sizes(manifest)
    layout_rules.check(manifest)


def check_rng_sizes(manifest: Manifest) -> None:
    """Refuse (GenerationDamaged) a listed `rng-state` file recorded above `MAX_RNG_FILE_BYTES`."""
    for relpath, record in sorted(manifest.files.items()):
        if manifest.role_of(relpath) == rng_state.ROLE_RNG:
            try:
                rng_state.check_size(relpath, record.bytes)
            except ValueError as exc:  # an oversized RNG file is damage, refused before it is read
                raise GenerationDamaged(str(exc)) from None


def _bound_rank(manifest: Manifest, relpath: str) -> int:
    rank = manifest.files[relpath].binding.get("rank", "")
    if not rank.isdigit():
        raise ValueError(f"{relpath}: an rng-state file whose binding names no rank ({rank!r:.20})")
    return int(rank)


def named_binding(saver: str, relpath: str) -> dict[str, str] | None:
    """The binding a file of `saver` named `relpath` carries, or None when no name rule applies."""
    if saver not in BOUND_SAVERS:
        return None
    for pattern, binding in _NAMED_BINDINGS:
        if match := pattern.fullmatch(relpath):
            return binding(match)
    return None


def binding_problems(manifest: Manifest) -> list[tuple[str, str]]:
    """`(relpath, reason)` for every listed file whose binding is not the one its name implies.

    It applies to format v2 and later generations of the `BOUND_SAVERS`. A resealed manifest may
    drop or alter a role, and the content rules are chosen by role. The saver's loader refuses such
    a file, so every reader must, before reading it.
    """
    if manifest.format_version < 2:
        return []
    problems = []
    for relpath, record in sorted(manifest.files.items()):
        expected = named_binding(manifest.saver, relpath)
        if expected is not None and record.binding != expected:
            found = dict(record.binding) or "nothing"
            problems.append(
                (
                    relpath,
                    f"the manifest binds it to {found}, expected {expected} (the binding a {manifest.saver} file "
                    "of this name carries: dropped or altered in the manifest?)",
                )
            )
    return problems


def check_optimizer_claim(manifest: Manifest) -> None:
    """Refuse (GenerationDamaged) a manifest whose `optimizer_saved` claim was edited.

    `false` must mean no listed optimizer file and no optimizer child recorded as stepped. When
    present, the value must be a boolean: loaders restore optimizer state only for `true`, so a
    `null` or `0` would drop it unnoticed.
    """
    metadata = manifest.metadata
    if "optimizer_saved" in metadata and not isinstance(metadata["optimizer_saved"], bool):
        raise GenerationDamaged(
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
        raise GenerationDamaged(
            f"the manifest says optimizer_saved is false, yet lists optimizer state ({first}): edited?"
        )


def check_stamps(relpath: str, manifest: Manifest, metadata: dict[str, str]) -> None:
    """Refuse (GenerationDamaged) a tensor file whose stamp is missing or not its manifest's."""
    record = manifest.files[relpath]
    keys = (*STAMP_KEYS, *sorted(record.binding))
    missing = [k for k in keys if k not in metadata]
    if missing:
        raise GenerationDamaged(
            f"safetensors metadata has no {', '.join(repr(k) for k in missing)} (a format v2 tensor file "
            "carries its generation, its path and its binding)"
        )
    stamped = {k: metadata[k] for k in keys}
    listed = {"generation": manifest.generation, "file": relpath, **record.binding}
    if stamped != listed:
        raise GenerationDamaged(
            f"the file says it is {_identity(stamped)}, but the manifest lists it as {_identity(listed)} "
            "(copied from another generation, or swapped with another file)"
        )


def check_tensor_dtypes(relpath: str, manifest: Manifest, dtypes: dict[str, str]) -> None:
    """Refuse (GenerationDamaged) a `distributed` child's optimizer file holding other than float32.

    Its loader installs the tensors into fp32 buffers.
    """
    if distributed_child(relpath, manifest) is None:
        return
    wrong = sorted(name for name, tag in dtypes.items() if tag != DISTRIBUTED_DTYPE)
    if wrong:
        raise GenerationDamaged(
            f"tensor {wrong[0][:80]!r} is {dtypes[wrong[0]]}, but an optimizer file of a DistributedOptimizer "
            f"child holds {DISTRIBUTED_DTYPE} only ({len(wrong)} tensor(s) are not)"
        )


def distributed_child(relpath: str, manifest: Manifest) -> str | None:
    """The child index of optimizer file `relpath` if its child is a `distributed` one, else None.

    The manifest says so in `optimizer_children[child].family`. Older generations have only
    `state_keys`, which described DistributedOptimizer children alone.
    """
    record = manifest.files.get(relpath)
    if record is None or manifest.role_of(relpath) != ROLE_OPTIMIZER or "child" not in record.binding:
        return None
    child, metadata = record.binding["child"], manifest.metadata
    children = metadata.get("optimizer_children")
    if isinstance(children, dict):
        entry = children.get(child)
        family = entry.get("family") if isinstance(entry, dict) else None
        return child if family == FamilyKind.DISTRIBUTED else None
    state_keys = metadata.get("state_keys")
    return child if children is None and isinstance(state_keys, dict) and child in state_keys else None


def _identity(stamp: dict[str, str]) -> str:
    return "[" + ", ".join(f"{k} {v[:80]}" for k, v in stamp.items()) + "]"
