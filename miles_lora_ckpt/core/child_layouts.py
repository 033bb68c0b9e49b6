"""What the manifest records of each optimizer child's saved files (`optimizer_children[i].layout`).

A child family's `plan` (`megatron.optimizer_children`) makes one of these records at save; the
manifest holds its JSON (`to_json`, the same bytes as when plans were plain dicts). Loaders,
`verify` and `layout_rules` read it back with `parse` (`parse_layout` picks the record of a child's
family), which checks the JSON's shape and raises GenerationDamaged naming the manifest. What the
values must mean together (slices tiling their buckets, positions inside them) is checked where it
is used: `layout_rules` and the families. Imports neither megatron nor Miles.

    family                  record              manifest keys
    distributed             DistributedLayout   numel_unpadded, slices, positions
    replicated, layer-wise  WholeParamLayout    entries, files, state_reporters
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_lora_ckpt.core import bounded
from miles_lora_ckpt.core.errors import GenerationDamaged, Problem
from miles_lora_ckpt.core.family_kind import FamilyKind
from miles_lora_ckpt.core.layout import MANIFEST

__all__ = [
    "ChildLayout",
    "DistributedLayout",
    "SliceEntry",
    "WholeParamEntry",
    "WholeParamLayout",
    "layout_damaged",
    "parse_layout",
]

_POSITION_SHAPE = "[buffer, bucket, start, numel]"


def layout_damaged(reason: str) -> GenerationDamaged:
    """The damage exception for a child layout whose JSON is not its family's shape (names the manifest)."""
    return GenerationDamaged("the generation", [Problem(MANIFEST, reason)])


def _text(value) -> str:
    """A value read from the manifest, cut short for a message: a name to 120 characters (a
    parameter's fits), anything else as `bounded.show` sketches it."""
    return value[:120] if isinstance(value, str) else bounded.show(value)


def _is_count(value) -> bool:
    return type(value) is int and value >= 0


def _is_pair(value) -> bool:
    """`[lo, hi]`: two ints (where they lie is `layout_rules.slice_problem`'s to check)."""
    return isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)


def _mapping(value, what: str) -> dict:
    """`value` if it is a JSON object (string keys), else damage naming `what`."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise layout_damaged(f"{what} is {_text(value)}, not a mapping")
    return value


# --------------------------------------------------------------------------- distributed


@dataclass(frozen=True)
class SliceEntry:
    """One DP rank's slice file of a DistributedOptimizer child at one coordinate (`slices`)."""

    file: str  # `optimizer/child{i}_{coordinate}_s{r:03d}of{n:03d}.safetensors`
    slice: str  # `"r/n"`: DP rank r of n wrote it
    bounds: dict[str, list[list[int]]]  # `{"buf{g}": [[lo, hi] per bucket]}`: its part of each world tensor

    @classmethod
    def parse(cls, data, where: str) -> SliceEntry:
        """From the manifest's JSON; `where` names it (`optimizer child 0 at <coordinate>: slice 1 of 2`)."""
        ok = isinstance(data, dict) and isinstance(data.get("file"), str) and isinstance(data.get("slice"), str)
        if not ok or not isinstance(data.get("bounds"), dict):
            raise layout_damaged(f"{where} is listed as {_text(data)}")
        for buf, pairs in data["bounds"].items():
            if not isinstance(buf, str) or not isinstance(pairs, list) or not all(map(_is_pair, pairs)):
                raise layout_damaged(
                    f"{where}: its bounds of {_text(buf)} are {_text(pairs)}, not [[lo, hi] per bucket]"
                )
        return cls(data["file"], data["slice"], data["bounds"])

    def to_json(self) -> dict:
        """The manifest's JSON of this slice."""
        return {"file": self.file, "slice": self.slice, "bounds": self.bounds}


@dataclass(frozen=True)
class DistributedLayout:
    """A DistributedOptimizer child's saved layout, per model-parallel coordinate of a DP group's root.

    `slices` is None for the gathered layout written before slices (one file per coordinate, by
    the DP root), `positions` None before format v3 (such a child loads at its saved layout only).
    """

    numel_unpadded: dict[str, dict[str, list[int]]]  # coordinate -> `{"buf{g}": [unpadded numel per bucket]}`
    slices: dict[str, tuple[SliceEntry, ...]] | None  # coordinate -> its DP ranks' slices, in rank order
    # coordinate -> `{parameter: [buffer, bucket, start, numel]}`: where each parameter lies in its
    # bucket's world tensor (what a resharding load reads by)
    positions: dict[str, dict[str, list[int]]] | None

    @classmethod
    def parse(cls, data: dict, index) -> DistributedLayout:
        """From the manifest's JSON of child `index` (a mapping); GenerationDamaged where its shape is wrong."""
        where = f"optimizer child {index}"
        numels = data.get("numel_unpadded")
        if not isinstance(numels, dict):
            raise layout_damaged(f"{where}: the manifest's plan has no bucket layout ('numel_unpadded')")
        for key, buffers in numels.items():
            ok = isinstance(buffers, dict) and all(
                isinstance(buf, str) and isinstance(n, list) and all(_is_count(v) for v in n)
                for buf, n in buffers.items()
            )
            if not isinstance(key, str) or not ok:
                raise layout_damaged(
                    f"{where} at {_text(key)}: the bucket layout {_text(buffers)} is not "
                    "{buffer: [unpadded numel per bucket]}"
                )
        slices = None
        if "slices" in data:
            slices = {}
            for key, entries in _mapping(data["slices"], f"{where}: slices").items():
                if not isinstance(entries, list) or not entries:
                    raise layout_damaged(f"{where} at {_text(key)}: the manifest lists no slices")
                size = len(entries)
                slices[key] = tuple(
                    SliceEntry.parse(entry, f"{where} at {_text(key)}: slice {rank} of {size}")
                    for rank, entry in enumerate(entries)
                )
        positions = None
        if "positions" in data:
            positions = _mapping(data["positions"], f"{where}: positions")
            for key, named in positions.items():
                for name, value in _mapping(named, f"{where}: positions at {_text(key)}").items():
                    if not (isinstance(value, list) and len(value) == 4 and all(_is_count(v) for v in value)):
                        raise layout_damaged(
                            f"{where} at {key}: the position of {_text(name)} is {_text(value)}, not {_POSITION_SHAPE}"
                        )
        return cls(numels, slices, positions)

    def to_json(self) -> dict:
        """The manifest's JSON: `slices` and `positions` only where recorded."""
        out: dict = {"numel_unpadded": self.numel_unpadded}
        if self.slices is not None:
            out["slices"] = {key: [entry.to_json() for entry in entries] for key, entries in self.slices.items()}
        if self.positions is not None:
            out["positions"] = self.positions
        return out


# --------------------------------------------------------------------------- whole parameters


@dataclass(frozen=True)
class WholeParamEntry:
    """Where one entry (`{slice}:{name}`: a parameter shard) of a whole-parameter child is saved."""

    file: str  # the optimizer file its writer wrote
    group: int  # its param group

    def to_json(self) -> dict:
        """The manifest's JSON of this entry."""
        return {"file": self.file, "group": self.group}


@dataclass(frozen=True)
class WholeParamLayout:
    """A `replicated` or `layer-wise` child's saved layout (`replicated.WholeParameterFamily.plan`)."""

    entries: dict[str, WholeParamEntry]  # entry name -> its file and param group
    files: dict[str, str]  # file -> its writer's coordinate (`tp000_pp000_ep000_etp000_dp000_cp000`)
    # model-parallel coordinate -> the rank that records its JSON state (param groups, grad scaler);
    # what the save reads, absent where a manifest was written without it
    state_reporters: dict[str, int] | None = None

    @classmethod
    def parse(cls, data: dict, index) -> WholeParamLayout:
        """From the manifest's JSON of child `index` (a mapping); GenerationDamaged where its shape is wrong."""
        where = f"optimizer child {index}"
        entries = {}
        for entry, saved in _mapping(data.get("entries"), f"{where}: entries").items():
            ok = isinstance(saved, dict) and isinstance(saved.get("file"), str) and type(saved.get("group")) is int
            if not ok:
                raise layout_damaged(f"{where}: entry {_text(entry)} is {_text(saved)}, not {{file, group}}")
            entries[entry] = WholeParamEntry(saved["file"], saved["group"])
        files = _mapping(data.get("files"), f"{where}: files")
        wrong = [f for f, coordinate in files.items() if not isinstance(coordinate, str)]
        if wrong:
            raise layout_damaged(f"{where}: file {_text(wrong[0])} has no writer coordinate")
        reporters = data.get("state_reporters")
        if reporters is not None:
            if not all(_is_count(rank) for rank in _mapping(reporters, f"{where}: state_reporters").values()):
                raise layout_damaged(f"{where}: state_reporters {_text(reporters)} are not {{coordinate: rank}}")
        return cls(entries, files, reporters)

    def to_json(self) -> dict:
        """The manifest's JSON: `state_reporters` only where recorded."""
        out: dict = {"entries": {e: saved.to_json() for e, saved in self.entries.items()}, "files": self.files}
        if self.state_reporters is not None:
            out["state_reporters"] = self.state_reporters
        return out


ChildLayout = DistributedLayout | WholeParamLayout  # the record of any family

_RECORDS = {
    FamilyKind.DISTRIBUTED: DistributedLayout,
    FamilyKind.REPLICATED: WholeParamLayout,
    FamilyKind.LAYER_WISE: WholeParamLayout,
}


def parse_layout(family, data, index) -> ChildLayout | None:
    """Child `index`'s layout (`data`, the manifest's JSON) as its family's record.

    None where it has none (`{}` or absent: a child saved without state) or its family is none this
    package knows (the loader refuses such a child by its family). GenerationDamaged naming the
    manifest where the JSON is not the family's shape.
    """
    kind = FamilyKind.parse(family)
    if data is None or data == {} or kind is None:
        return None
    if not isinstance(data, dict):
        raise layout_damaged(f"optimizer child {index}: its layout is {_text(data)}, not a mapping")
    return _RECORDS[kind].parse(data, index)
