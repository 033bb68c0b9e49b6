"""The content rules of a generation's files: the one place every reader's checks live.

`verify` and every loader read a listed file through `verify.check_file_content` (whole) or
`verify.check_file_ranges` (some element ranges), and those apply exactly the rules here, after
`checked_reads` (or `partial_reads`) has checked the bytes (size, digests, a strict safetensors header with legal tensor
names, finite floats, bounded UTF-8 JSON). So `verify` refuses what a loader refuses, for the same
reason, and no loader holds a content check of its own that `verify` lacks:

- a format v2 tensor file carries its stamp: its generation, its own path and its manifest
  binding (`check_stamps`); a file stamped with its global layout entries matches the manifest's
  (`layout_rules.check_stamp`);
- an optimizer file of a `distributed` child (a DistributedOptimizer's masters and moments, sliced
  over DP) holds float32 tensors only (`check_tensor_dtypes`): its loader installs them into fp32
  buffers and refuses anything else;
- a `training-state` file satisfies `training_state.check` (scheduler keys and decay styles,
  hyperparameter ranges, tagged values, iteration and generation);
- an `rng-state` file (a rank's RNG states, `rng_state`) is bounded JSON of exactly the fields
  `rng_state.check` allows, for the rank its binding names, or a file of 1-D uint8 tensors only
  (`rng_state.check_tensors`);
- a `rollout-data-state` file satisfies `data_state.check` (its rollout is the generation's, its
  cursor, dataset and buffer are well formed, its tagged values are well formed).

And rules on the manifest itself (applied by `verify.check_structure`, which every loader runs
first): a format-v3 global layout and its optimizer positions are consistent (`layout_rules.check`:
blocks tile their global tensors, adapter files' coordinates agree with their bindings, positions
lie inside their buckets); a manifest whose metadata says `optimizer_saved: false` lists no optimizer file and no
optimizer child that stepped (`check_optimizer_claim`, in `check_manifest`; the single-LoRA loader
calls it too); no `rng-state` file is larger than `rng_state.MAX_RNG_FILE_BYTES` (refused before
it is read: `check_rng_sizes`); and, in a format v2 generation of a saver that writes the single-LoRA files
(`single-lora`, `multi-lora-slot`), every file named like one of them carries exactly the binding
its name implies (`binding_problems`): the checks above hinge on a file's role, so a resealed
manifest that drops or alters it (a `training_state.json` without `role: training-state`) would
otherwise skip them in `verify`, while the saver's loader refuses the file for its binding.

Imports neither megatron nor Miles: what a saver's loader requires of its files is stated here as
data the manifest carries (roles, bindings, the optimizer children's families).
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

# The savers that write the single-LoRA files (`savers.single_lora.SAVER`, `savers.multi_lora.SLOT_SAVER`),
# and the binding each of their file names implies (`savers/single_lora/common.py`,
# `megatron/optimizer_children`: what their loaders require of each file they read).
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
    """Every rule for a listed tensor file, given its safetensors metadata and `{tensor: dtype tag}`
    (from its header, or from the manifest's block index that was checked against it), and
    `{tensor: shape}` where the header was read."""
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
    """Every rule for a listed file that is not a tensor file, given its parsed JSON value (None
    for a file that is not JSON: a training state must be JSON)."""
    if manifest.role_of(relpath) == ROLE_TRAINING_STATE:
        try:
            training_state.check(
                value,
                iteration=manifest.iteration,
                generation=manifest.generation,
                format_version=manifest.format_version,
            )
        except ValueError as exc:  # its rules' refusals (ValueError, as `bounded`'s) are damage
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
    """Every rule on a manifest's own content (beyond its fields' shapes): the optimizer claim, and
    the structural rules of a format-v3 global layout (`layout_rules.check`, raising GenerationDamaged)."""
    check_optimizer_claim(manifest)
    check_rng_sizes(manifest)
    layout_rules.check(manifest)


def check_rng_sizes(manifest: Manifest) -> None:
    """Every listed `rng-state` file is at most `rng_state.MAX_RNG_FILE_BYTES` (as recorded)."""
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
    """The binding a file of `saver` named `relpath` carries (None: no name rule applies)."""
    if saver not in BOUND_SAVERS:
        return None
    for pattern, binding in _NAMED_BINDINGS:
        if match := pattern.fullmatch(relpath):
            return binding(match)
    return None


def binding_problems(manifest: Manifest) -> list[tuple[str, str]]:
    """`(relpath, reason)` for every listed file of a format v2 (and later) single-LoRA or
    multi-LoRA slot generation whose manifest binding is not exactly the one its name implies
    (`named_binding`): its role was dropped or altered in a resealed manifest. The content rules
    (training-state invariants, DistributedOptimizer dtypes) are chosen by role, and the saver's
    loader refuses such a file for its binding: so must every reader, before reading it."""
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
    """`optimizer_saved: false` must mean no optimizer state: no listed optimizer file (role
    `optimizer`, or under `optimizer/`) and no optimizer child recorded as stepped (in
    `optimizer_children`, or a pre-family generation's `stepped_children`); else it was edited.

    `optimizer_saved`, when present, is a boolean: loaders restore optimizer state only when it is
    `true`, so any other value (`null`, `0`, `"false"`) would otherwise drop the saved optimizer
    state unnoticed, without the refusal that `false` gets."""
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
    """An optimizer file of a `distributed` child holds float32 tensors only."""
    if distributed_child(relpath, manifest) is None:
        return
    wrong = sorted(name for name, tag in dtypes.items() if tag != DISTRIBUTED_DTYPE)
    if wrong:
        raise GenerationDamaged(
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
        return child if family == FamilyKind.DISTRIBUTED else None
    state_keys = metadata.get("state_keys")
    return child if children is None and isinstance(state_keys, dict) and child in state_keys else None


def _identity(stamp: dict[str, str]) -> str:
    return "[" + ", ".join(f"{k} {v[:80]}" for k, v in stamp.items()) + "]"
