"""The structural rules of a format-v3 global layout, and each file's binding to its layout entries.

A format-v3 manifest records where every saved element lies in the global model: metadata
`global_layout` (each parameter's `Block` per coordinate, each adapter file's writer and names)
and each DistributedOptimizer child's `layout.positions`. A resharding load places weights,
masters and moments by them alone, so `verify` and every loader check them first (`check`):

- blocks lie inside their global shape, agree on it and its dtype, and tile it exactly;
- each adapter file entry names a listed file bound to its coordinate, holding its tensors;
- positions lie inside their bucket, name a described parameter, and never overlap;
- in any format, every optimizer child's layout is its family's shape (`core.child_layouts`), and
  every DistributedOptimizer child's slices tile each bucket (`check_slices`).

`check_file_tensors` holds each file's content to its entry. A resealed layout edit that keeps all
this, such as two TP ranks' offsets swapped, fails each file's own stamp (`stamp`, `check_stamp`).
Files written before the stamp carry none (docs/guarantees.md, "What only the signing key
catches"). Every failure is `GenerationDamaged` naming the file. Imports neither megatron nor Miles.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from miles_lora_ckpt.core import partial_reads, safetensors_format
from miles_lora_ckpt.core.child_layouts import ChildLayout, DistributedLayout, SliceEntry, parse_layout
from miles_lora_ckpt.core.errors import GenerationDamaged, Problem
from miles_lora_ckpt.core.family_kind import FamilyKind
from miles_lora_ckpt.core.global_layout import Block
from miles_lora_ckpt.core.layout import MANIFEST, Manifest

__all__ = [
    "STAMP_KEY",
    "check",
    "check_file_tensors",
    "check_stamp",
    "damaged",
    "file_entries",
    "saved_blocks",
    "saved_child_layouts",
    "slice_problem",
    "stamp",
]

STAMP_KEY = "global_layout"  # a tensor file's safetensors metadata: `sha256:<hex>` of its layout entries
_COORDINATE = re.compile(r"(tp[0-9]+)_(pp[0-9]+)_(ep[0-9]+)_(etp[0-9]+)")
_ADAPTER = re.compile(r"adapter/(dense|expert)_[a-z0-9_]+\.safetensors")
MASTER_STATE_KEY = "param"  # such a file's fp32 master, next to its state keys


def damaged(manifest: Manifest, file: str, reason: str) -> GenerationDamaged:
    """The damage exception for one problem of `manifest`'s generation, naming `file`."""
    return GenerationDamaged(f"generation {manifest.generation}", [Problem(file, reason)])


def has_layout(manifest: Manifest) -> bool:
    """Whether the manifest records a global layout (format v3 and later)."""
    return manifest.format_version >= 3 and "global_layout" in manifest.metadata


def check(manifest: Manifest) -> None:
    """Check every structural rule of the manifest's optimizer layouts, global layout and positions.

    Every child's layout is its family's shape (`saved_child_layouts`), its slices tile their buckets
    in any format, the global layout in format v3. Raises GenerationDamaged naming the file and the
    first problem.
    """
    layouts = saved_child_layouts(manifest)  # parsed once for both checks
    check_slices(manifest, layouts)
    if has_layout(manifest):
        saved_blocks(manifest, layouts)


def saved_child_layouts(manifest: Manifest) -> dict[str, ChildLayout]:
    """`{child index: its layout}` of every optimizer child the manifest records with a layout, as its
    family's record (`core.child_layouts`); GenerationDamaged naming the manifest where one is not
    its family's shape."""
    children = manifest.metadata.get("optimizer_children")
    if not isinstance(children, dict):
        return {}
    layouts = {}
    for index, child in sorted(children.items()):
        if not isinstance(child, dict):
            continue
        try:
            layout = parse_layout(child.get("family"), child.get("layout"), index)
        except GenerationDamaged as exc:  # named again, by its generation
            raise damaged(manifest, MANIFEST, exc.problems[0].reason) from None
        if layout is not None:
            layouts[index] = layout
    return layouts


def check_slices(manifest: Manifest, layouts: dict[str, ChildLayout] | None = None) -> None:
    """Check every child's layout (`saved_child_layouts`, or `layouts` already parsed from it) and
    every DistributedOptimizer child's `slices` (format v2 and later); GenerationDamaged.

    Per coordinate, the files `optimizer/child{i}_{coordinate}_s{r:03d}of{n:03d}.safetensors` of
    ranks 0..n-1 are listed where they hold elements. Their bounds lie inside each bucket's
    `numel_unpadded` and tile it. Every load's `saved_pieces` requires this, so `verify` does too.
    """
    layouts = saved_child_layouts(manifest) if layouts is None else layouts
    for index, layout in layouts.items():
        if not isinstance(layout, DistributedLayout) or layout.slices is None:
            continue
        for key, entries in sorted(layout.slices.items()):
            problem = slice_problem(index, key, entries, layout.numel_unpadded.get(key), manifest.files)
            if problem is not None:
                raise damaged(manifest, *problem)


def slice_problem(index, key, entries: tuple[SliceEntry, ...] | None, current, listed=None) -> tuple[str, str] | None:
    """`(file, reason)` of the first problem of one coordinate's optimizer slices, or None.

    Each slice is named by its place, with bounds inside `current`, the unpadded bucket sizes; the
    slices tile every bucket exactly. With `listed`, the manifest's files, a slice holding elements
    must be listed. Loaders plan their reads by the same rule (`distributed.saved_pieces`).
    """
    where = f"optimizer child {index} at {str(key)[:80]}"
    sizes_ok = isinstance(current, dict) and all(
        isinstance(n, list) and all(type(v) is int and v >= 0 for v in n) for n in current.values()
    )
    if not sizes_ok:
        return MANIFEST, f"{where}: the slices have no bucket layout ('numel_unpadded')"
    if not entries:
        return MANIFEST, f"{where}: the manifest lists no slices"
    covered = {buf: [[] for _ in numels] for buf, numels in current.items()}
    size = len(entries)
    for rank, entry in enumerate(entries):
        expected = f"optimizer/child{index}_{key}_s{rank:03d}of{size:03d}.safetensors"
        if entry.file != expected or entry.slice != f"{rank}/{size}":
            return MANIFEST, f"{where}: slice {rank} of {size} is listed as {str(entry.to_json())[:200]}"
        bounds = entry.bounds
        if set(bounds) != set(current):
            return expected, f"slice bounds {str(bounds)[:200]} do not name the buffers {sorted(current)}"
        for buf, per_bucket in bounds.items():
            if len(per_bucket) != len(current[buf]):
                return expected, f"slice bounds of {buf} are {str(per_bucket)[:200]}, one [lo, hi] per bucket expected"
            for b, pair in enumerate(per_bucket):  # `[lo, hi]`, two ints (`SliceEntry.parse`)
                if not 0 <= pair[0] <= pair[1] <= current[buf][b]:
                    return (
                        expected,
                        f"slice bounds {str(pair)[:80]} of {buf} bucket {b} are out of [0, {current[buf][b]}]",
                    )
                if pair[1] > pair[0]:
                    if listed is not None and expected not in listed:
                        return (
                            expected,
                            f"{where}: it holds elements [{pair[0]}, {pair[1]}) of {buf} bucket {b}, but is not listed",
                        )
                    covered[buf][b].append((pair[0], pair[1], expected))
    for buf, buckets in covered.items():
        for b, spans in enumerate(buckets):
            cursor = 0
            for lo, hi, file in sorted(spans):
                if lo != cursor:
                    what = "overlap" if lo < cursor else "gap"
                    return (
                        file,
                        f"slice bounds [{lo}, {hi}) of {buf} bucket {b} leave a {what} at element {min(lo, cursor)}",
                    )
                cursor = hi
            if cursor != current[buf][b]:
                return MANIFEST, f"{where}: the slices of {buf} bucket {b} end at {cursor}, not {current[buf][b]}"
    return None


def saved_blocks(
    manifest: Manifest, layouts: dict[str, ChildLayout] | None = None
) -> dict[str, dict[str, Block | None]]:
    """`{coordinate: {parameter: Block or None}}` of the manifest's global layout.

    Every rule of the module docstring is checked, and the resharding loader plans from this.
    `layouts` are the children's layouts where already parsed (`saved_child_layouts`). Raises
    GenerationDamaged.
    """
    layout = manifest.metadata.get("global_layout")
    if not isinstance(layout, dict) or not isinstance(layout.get("params"), dict):
        raise damaged(manifest, MANIFEST, "metadata global_layout has no params")
    blocks: dict[str, dict[str, Block | None]] = {}
    for key, described in layout["params"].items():
        if not isinstance(key, str) or not _COORDINATE.fullmatch(key) or not isinstance(described, dict):
            raise damaged(manifest, MANIFEST, f"global_layout params has an entry {str(key)[:80]!r} of no coordinate")
        blocks[key] = {}
        for name, data in described.items():
            where = f"global_layout params {key} {str(name)[:80]}"
            try:
                blocks[key][name] = None if data is None else Block.from_dict(data, where)
            except ValueError as exc:
                raise damaged(manifest, MANIFEST, str(exc)) from None
    _check_tiling(manifest, blocks)
    _check_adapter_files(manifest, layout.get("adapter_files", {}), blocks)
    _check_positions(manifest, blocks, saved_child_layouts(manifest) if layouts is None else layouts)
    return blocks


def _check_tiling(manifest: Manifest, blocks: dict) -> None:
    """Check that one global tensor's blocks agree on its shape and dtype, and tile it.

    Skipped where any block is unknown (None): such a generation is never resharded, and an unknown
    block's global tensor cannot be named.
    """
    if any(block is None for described in blocks.values() for block in described.values()):
        return
    regions: dict[str, dict] = {}
    first: dict[str, tuple[str, Block]] = {}
    for key, described in sorted(blocks.items()):
        for name, block in described.items():
            seen = first.setdefault(block.name, (f"{key} {name}", block))
            if (seen[1].global_shape, seen[1].dtype) != (block.global_shape, block.dtype):
                raise damaged(
                    manifest,
                    MANIFEST,
                    f"global_layout: {block.name} is {block.dtype}{list(block.global_shape)} at {key} {name}, "
                    f"{seen[1].dtype}{list(seen[1].global_shape)} at {seen[0]}",
                )
            regions.setdefault(block.name, {}).setdefault(block.region, f"{key} {name}")
    for global_name, distinct in regions.items():
        boxes = list(distinct.items())
        total = math.prod(first[global_name][1].global_shape)
        for i, ((offset, shape), where) in enumerate(boxes):
            for (other_offset, other_shape), other in boxes[i + 1 :]:
                if _overlap(offset, shape, other_offset, other_shape):
                    raise damaged(
                        manifest,
                        MANIFEST,
                        f"global_layout: the blocks of {global_name} at {where} and at {other} overlap "
                        f"(offsets {list(offset)} and {list(other_offset)})",
                    )
        covered = sum(math.prod(shape) for (_, shape), _ in boxes)
        if covered != total:
            raise damaged(
                manifest,
                MANIFEST,
                f"global_layout: the blocks of {global_name} hold {covered} of its {total} elements",
            )


def _overlap(a_offset, a_shape, b_offset, b_shape) -> bool:
    return all(
        max(oa, ob) < min(oa + sa, ob + sb) for oa, sa, ob, sb in zip(a_offset, a_shape, b_offset, b_shape, strict=True)
    )


def coordinate_binding(kind: str, coordinate: str) -> dict[str, str] | None:
    """The manifest binding of the `kind` ("dense" | "expert") adapter file written at `coordinate`.

    `coordinate` is like `tp000_pp000_ep000_etp000`. Dense files are keyed by TP and PP, expert
    files by PP, EP and expert TP. None for no coordinate.
    """
    match = _COORDINATE.fullmatch(coordinate) if isinstance(coordinate, str) else None
    if match is None:
        return None
    tp, pp, ep, etp = match.groups()
    key = f"{tp}_{pp}" if kind == "dense" else f"{pp}_{ep}_{etp}"
    return {"role": f"{kind}-adapter", "coordinate": key}


def _check_adapter_files(manifest: Manifest, files: Any, blocks: dict) -> None:
    if not isinstance(files, dict):
        raise damaged(manifest, MANIFEST, "metadata global_layout adapter_files is not a mapping")
    for relpath, entry in files.items():
        match = _ADAPTER.fullmatch(relpath) if isinstance(relpath, str) else None
        if match is None or relpath not in manifest.files:
            raise damaged(manifest, MANIFEST, f"global_layout names adapter file {str(relpath)[:120]!r}, not listed")
        if not isinstance(entry, dict) or set(entry) != {"coordinate", "names"} or not isinstance(entry["names"], list):
            raise damaged(manifest, relpath, "its global_layout entry is not {coordinate, names}")
        coordinate = entry["coordinate"]
        expected = coordinate_binding(match[1], coordinate)
        bound = manifest.files[relpath].binding
        if expected is None or coordinate not in blocks or dict(bound) != expected:
            raise damaged(
                manifest,
                relpath,
                f"the global layout says coordinate {str(coordinate)[:80]} wrote it, but the file is bound to "
                f"{dict(bound)} (the layout's coordinate and the file's own binding disagree: edited?)",
            )
        index = manifest.files[relpath].blocks
        if len(set(entry["names"])) != len(entry["names"]):
            raise damaged(manifest, relpath, "its global_layout entry names a parameter twice")
        for name in entry["names"]:
            if not isinstance(name, str) or name not in blocks[coordinate]:
                raise damaged(
                    manifest, relpath, f"the global layout at {coordinate} has no block for {str(name)[:120]}"
                )
            block = blocks[coordinate][name]
            if block is None:
                continue  # megatron could not describe it (a multi-LoRA slot's adapter): never resharded
            indexed = None if index is None else partial_reads.indexed_tensor(index, name)
            if index is not None and (
                indexed is None or indexed[1] != block.numel or (block.dtype and f"torch.{indexed[0]}" != block.dtype)
            ):
                held = "no such tensor" if indexed is None else f"torch.{indexed[0]}[{indexed[1]} elements]"
                raise damaged(
                    manifest,
                    relpath,
                    f"{name[:120]} holds {held}, its global layout block {block.dtype}{list(block.shape)}",
                )


def _check_positions(manifest: Manifest, blocks: dict, layouts: dict[str, ChildLayout]) -> None:
    """Every DistributedOptimizer child's positions: inside their buckets, one parameter each."""
    for index, layout in layouts.items():
        if not isinstance(layout, DistributedLayout) or layout.positions is None:
            continue
        for key, named in sorted(layout.positions.items()):
            buckets = layout.numel_unpadded.get(key)
            if buckets is None:
                raise damaged(manifest, MANIFEST, f"optimizer child {index}: positions at {key} of no bucket layout")
            spans: dict[tuple, list] = {}
            for name, where in sorted(named.items()):
                spans.setdefault(_position(manifest, index, key, name, where, buckets, blocks), []).append(
                    (where[2], where[2] + where[3], name)
                )
            for (buf, bucket), found in spans.items():
                found.sort()
                for (_, end, name), (start, _, other) in zip(found, found[1:], strict=False):
                    if start < end:
                        raise damaged(
                            manifest,
                            MANIFEST,
                            f"optimizer child {index} at {key}: {name} and {other} overlap in buf{buf} bucket "
                            f"{bucket} (elements from {start} to {end})",
                        )


def _position(manifest: Manifest, index, key: str, name: str, where: list[int], buckets: dict, blocks: dict) -> tuple:
    """Check one position `[buffer, bucket, start, numel]` (four counts: `DistributedLayout.parse`
    checked its shape); returns `(buffer, bucket)`."""
    what = f"optimizer child {index} at {key}: the position of {str(name)[:120]}"
    buf, bucket, start, numel = where
    sizes = buckets.get(f"buf{buf}")
    if sizes is None or bucket >= len(sizes):
        raise damaged(manifest, MANIFEST, f"{what} names buf{buf} bucket {bucket}, which the bucket layout lacks")
    if start + numel > sizes[bucket]:
        raise damaged(
            manifest,
            MANIFEST,
            f"{what} is elements [{start}, {start + numel}) of buf{buf} bucket {bucket}, which holds {sizes[bucket]}",
        )
    described = blocks.get(key, {})
    if name not in described:
        raise damaged(manifest, MANIFEST, f"{what}: the global layout at {key} has no such parameter")
    block = described[name]
    if block is not None and block.numel != numel:
        raise damaged(manifest, MANIFEST, f"{what} holds {numel} elements, its block {block.numel}")
    return buf, bucket


def check_file_tensors(relpath: str, manifest: Manifest, dtypes: dict[str, str], shapes: dict | None = None) -> None:
    """Check a listed tensor file's tensors against its layout entry; GenerationDamaged if not.

    An adapter file holds every name of its entry, of its block's dtype and, where `shapes` are
    given, a shape its block holds. The resharding loader requires this, so `verify` does too.
    """
    layout = manifest.metadata.get("global_layout") if has_layout(manifest) else None
    files = layout.get("adapter_files") if isinstance(layout, dict) else None
    entry = files.get(relpath) if isinstance(files, dict) else None
    params = layout.get("params") if isinstance(layout, dict) else None
    if shapes is not None and isinstance(params, dict):
        _check_whole_child_file(relpath, manifest, params, shapes)
    if not isinstance(entry, dict) or not isinstance(params, dict) or not isinstance(entry.get("names"), list):
        return  # no entry (or a malformed one, which `check` reports)
    described = params.get(entry.get("coordinate"))
    for name in entry["names"]:
        data = described.get(name) if isinstance(described, dict) and isinstance(name, str) else None
        try:
            block = None if data is None else Block.from_dict(data, f"global_layout block of {name}")
        except ValueError:
            block = None  # reported by `check`
        if block is None:
            continue
        tag = dtypes.get(name)
        held = None if tag is None else f"torch.{safetensors_format.DTYPES.get(tag, (tag,))[0]}"
        shape = None if shapes is None else shapes.get(name)
        if held is None or (block.dtype and held != block.dtype) or (shape is not None and not block.holds(shape)):
            what = "no such tensor" if held is None else f"{held}{list(shape) if shape is not None else ''}"
            raise damaged(
                manifest,
                relpath,
                f"{name[:120]} is {what}, its global layout block {block.dtype}{list(block.shape)}",
            )


def _check_whole_child_file(relpath: str, manifest: Manifest, params: dict, shapes: dict) -> None:
    """Check a whole-parameter child's file: each parameter's master and state fit its block.

    The file holds tensors `{parameter}.{key}`: the master `param` and the state. Each has a shape
    the block holds, 0-d state aside. Resharding requires it (`WholeParameterFamily.plan_reshard`).
    """
    binding = manifest.files[relpath].binding
    children = manifest.metadata.get("optimizer_children")
    child = children.get(binding.get("child")) if isinstance(children, dict) else None
    if binding.get("role") != "optimizer" or not isinstance(child, dict) or not _whole_parameter(child.get("family")):
        return
    match = _COORDINATE.match(str(binding.get("coordinate", "")))
    described = params.get(match[0]) if match is not None else None
    if not isinstance(described, dict):
        return
    held: dict[str, set] = {}
    for full, shape in sorted(shapes.items()):
        name, _, key = full.rpartition(".")
        held.setdefault(name, set()).add(key)
        data = described.get(name)
        try:
            block = None if data is None else Block.from_dict(data, f"global_layout block of {name}")
        except ValueError:
            block = None  # reported by `check`
        if block is not None and len(shape) > 0 and not block.holds(shape):
            raise damaged(
                manifest, relpath, f"{full[:120]} is {list(shape)}, its global layout block {list(block.shape)}"
            )
    for name, keys in sorted(held.items()):
        if name in described and MASTER_STATE_KEY not in keys:
            raise damaged(manifest, relpath, f"{name[:120]} has no master {name[:120]}.{MASTER_STATE_KEY}")


# --------------------------------------------------------------------------- the files' stamps


def file_entries(metadata: dict, relpath: str, binding: dict) -> dict | None:
    """The layout entries a resharding load reads file `relpath` by, or None when it has none.

    For an adapter file: its entry and its names' blocks. For an optimizer file: its coordinate's
    blocks and its child's positions. `metadata` is the manifest's; `binding` is the file's. The
    stamp digests the manifest's JSON as it is, checked or not (`check` refuses a malformed one),
    so this reads the JSON, not the records of `saved_child_layouts`: one lookup per file, never raising.
    """
    layout = metadata.get("global_layout")
    if not isinstance(layout, dict):
        return None
    params = layout.get("params") if isinstance(layout.get("params"), dict) else {}
    files = layout.get("adapter_files") if isinstance(layout.get("adapter_files"), dict) else {}
    if relpath in files:
        entry = files[relpath]
        coordinate = entry.get("coordinate") if isinstance(entry, dict) else None
        names = entry.get("names") if isinstance(entry, dict) else None
        described = params.get(coordinate) if isinstance(coordinate, str) else None
        described = described if isinstance(described, dict) else {}
        named = {n: described.get(n) for n in names if isinstance(n, str)} if isinstance(names, list) else None
        return {"file": relpath, "coordinate": coordinate, "names": names, "blocks": named}
    if binding.get("role") != "optimizer" or "child" not in binding:
        return None
    match = _COORDINATE.match(str(binding.get("coordinate", "")))
    if match is None:
        return None
    coordinate = match[0]
    children = metadata.get("optimizer_children")
    child = children.get(binding["child"]) if isinstance(children, dict) else None
    child_layout = child.get("layout") if isinstance(child, dict) else None
    positions = child_layout.get("positions") if isinstance(child_layout, dict) else None
    return {
        "file": relpath,
        "coordinate": coordinate,
        "blocks": params.get(coordinate),
        "positions": positions.get(coordinate) if isinstance(positions, dict) else None,
    }


def stamp(metadata: dict, relpath: str, binding: dict) -> dict[str, str]:
    """The safetensors metadata the writer adds to file `relpath`: `{STAMP_KEY: digest}` or `{}`.

    The digest covers its layout entries (`file_entries`).
    """
    entries = file_entries(metadata, relpath, binding)
    return {} if entries is None else {STAMP_KEY: _digest(entries)}


def check_stamp(relpath: str, manifest: Manifest, metadata: dict[str, str]) -> None:
    """Check a tensor file's layout stamp against the manifest's entries now; GenerationDamaged.

    A file without the stamp, written before it existed, is not checked.
    """
    stamped = metadata.get(STAMP_KEY)
    if stamped is None or not has_layout(manifest):
        return
    record = manifest.files[relpath]
    entries = file_entries(manifest.metadata, relpath, dict(record.binding))
    if entries is None or _digest(entries) != stamped:
        raise damaged(
            manifest,
            relpath,
            "the file was written with other global layout entries than the manifest records for it "
            f"(its stamp {stamped[:80]}): the manifest's layout or positions were edited",
        )


def _digest(entries: dict) -> str:
    text = json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()


def _whole_parameter(family) -> bool:
    """Whether a manifest's `family` field names a family saved as whole local parameters."""
    kind = FamilyKind.parse(family)
    return kind is not None and kind.whole_parameter
