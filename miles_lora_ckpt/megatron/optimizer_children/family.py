"""The interface every child family implements (`ChildFamily`), and the records its phases pass.

Each rank describes its children as `ChildDescription`s, each with its family's `Held` record.
The manifest's record of a child is a `SavedChild`, its family's plan of the saved files a
`core.child_layouts` record. All are JSON only at their boundary.

Every optimizer file is bound (format v2) to what it is: `file_binding` names role `optimizer`,
the child's leaf index and the writer's coordinate. The protocol stamps the binding into the file
and the manifest records it. Every preflight reads through `ReadContext.tensors(relpath, binding)`,
which refuses a file bound to anything else (a file of another child or coordinate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from miles_lora_ckpt.core.child_layouts import ChildLayout, layout_damaged, parse_layout
from miles_lora_ckpt.core.errors import IncompatibleCheckpoint
from miles_lora_ckpt.core.family_kind import FamilyKind
from miles_lora_ckpt.megatron.optimizer_children.child import Child
from miles_lora_ckpt.megatron.topology import Coordinates

__all__ = [
    "ROLE_OPTIMIZER",
    "ChildDescription",
    "ChildFamily",
    "Collected",
    "Held",
    "OptimizerFile",
    "RankView",
    "ReadContext",
    "ReshardContext",
    "SavedChild",
    "file_binding",
    "saved_state_at",
]

ROLE_OPTIMIZER = "optimizer"


def file_binding(index: int, coordinate: str) -> dict[str, str]:
    """The binding of an optimizer file: child `index`'s state written by the rank at `coordinate`."""
    return {"role": ROLE_OPTIMIZER, "coordinate": coordinate, "child": str(index)}


@dataclass(frozen=True)
class OptimizerFile:
    """One file a rank writes for a child: its binding (`file_binding`) and its tensors.

    Tensors may be `safetensors_write.LazyTensor`s, produced as they are written. `partial_reads`
    records per-block digests, so loaders at another DP size read and verify only what they need.
    """

    binding: dict[str, str]
    tensors: dict[str, Any]
    partial_reads: bool = False


@dataclass(frozen=True)
class SavedChild:
    """The checkpoint's record of one optimizer child (manifest `optimizer_children["<i>"]`).

    `chain.plan` makes it. It is JSON only at the manifest boundary (`parse`, `to_json`); its
    `layout` is its family's record (`core.child_layouts`), parsed once, here.
    """

    family: str  # a `FamilyKind` (a str); the manifest's string as is where it names none (refused)
    class_name: str  # the megatron class (`class`)
    kind: str  # the optimizer (`optimizer_kind`: adam, lion, muon, ...)
    keys: tuple[str, ...]  # the per-element state keys, in their saved order
    stepped: bool  # saved with its state (masters and moments)
    # the family's plan (`ChildFamily.plan`: files and what they hold); None unless stepped, and
    # for a family this package does not know
    layout: ChildLayout | None

    @classmethod
    def parse(cls, data: dict, index) -> SavedChild:
        """Child `index` from the manifest's JSON (or `to_json`'s). GenerationDamaged naming the
        manifest where its layout is not its family's shape, or a child saved with state has none."""
        family = FamilyKind.parse(data["family"]) or data["family"]
        stepped = data["stepped"]
        layout = parse_layout(family, data.get("layout"), index) if stepped else None
        if stepped and layout is None and isinstance(family, FamilyKind):
            raise layout_damaged(f"optimizer child {index} was saved with state, but the manifest records no layout")
        return cls(family, data["class"], data["kind"], tuple(data.get("keys", ())), stepped, layout)

    def to_json(self) -> dict:
        """The manifest's JSON of this child (its layout `{}` where it has none)."""
        return {
            "family": self.family,
            "class": self.class_name,
            "kind": self.kind,
            "keys": list(self.keys),
            "stepped": self.stepped,
            "layout": {} if self.layout is None else self.layout.to_json(),
        }


class Held(Protocol):
    """A family's record of what one rank holds of a child (`ChildFamily.describe`)."""

    params: tuple[str, ...]  # the chunk-qualified names of the parameters it holds state for

    def to_json(self) -> dict:
        """Its fields as JSON, beside `ChildDescription`'s own (the plan's consensus payload)."""


@dataclass(frozen=True)
class ChildDescription:
    """One rank's description of one selected optimizer child (`chain.describe`).

    Every rank contributes one per child to the save's or load's plan (`common.RankPlan`); it
    crosses the consensus as JSON (`to_json`, `chain.parse_description`). `held` is the family's own record.
    """

    index: int  # the child's leaf index in the chain
    family: str  # a `FamilyKind` (a str: its JSON form)
    class_name: str  # the megatron class (`class`)
    kind: str  # the optimizer (`optimizer_kind`: adam, lion, muon, ...)
    keys: tuple[str, ...]  # the per-element state keys this rank's optimizer keeps
    has_state: bool  # it holds optimizer state here (it stepped)
    never_stepped: bool  # it never stepped (`child.never_stepped`)
    held: Held  # what this rank holds of it, in its family's terms

    @property
    def params(self) -> tuple[str, ...]:
        """The names of the parameters this rank holds state for."""
        return self.held.params

    def to_json(self) -> dict:
        """The consensus payload: the common fields and the family's, flat, as before records."""
        return {
            "index": self.index,
            "family": str(self.family),
            "class": self.class_name,
            "kind": self.kind,
            "keys": list(self.keys),
            "has_state": self.has_state,
            "never_stepped": self.never_stepped,
            **self.held.to_json(),
        }

    @classmethod
    def parse(cls, data: dict, parse_held: Callable[[dict], Held]) -> ChildDescription:
        """From `to_json`'s payload; `parse_held` (the family's `parse_held`) reads its own fields.

        `chain.parse_description` picks the family named in the payload.
        """
        return cls(
            index=data["index"],
            family=data["family"],
            class_name=data["class"],
            kind=data["kind"],
            keys=tuple(data["keys"]),
            has_state=data["has_state"],
            never_stepped=data["never_stepped"],
            held=parse_held(data),
        )


@dataclass(frozen=True)
class RankView:
    """What a family needs to know about this rank and the run: every rank's coordinates, param names."""

    rank: int
    ranks: list[Coordinates]  # every rank's coordinates, this run
    names: dict[int, str]  # id(model parameter) -> chunk-qualified name (`chunk0.layers.0...`)

    @property
    def coords(self) -> Coordinates:
        return self.ranks[self.rank]


@dataclass
class Collected:
    """What `collect` took from one child on this rank: local tensors, and non-tensor state to record."""

    local: Any  # family-specific; only `exchange_for_save` reads it
    state_key: str | None = None  # where this rank's JSON state goes in the training state, if anywhere
    state: Any = None  # JSON-able (param groups, steps, grad scaler)


@dataclass(frozen=True)
class ReadContext:
    """What preflight reads from an opened generation: this rank's files and the per-child JSON state."""

    # (relpath, expected binding) -> {name: tensor}: the file's content already checked (digest,
    # header, stamps); raises ValueError when the manifest binds the file to anything else
    tensors: Callable[[str, dict[str, str]], dict[str, torch.Tensor]]
    states: dict  # the training state's per-child JSON, keyed as `Collected.state_key`
    keys: tuple[str, ...]  # the per-element state keys the checkpoint holds for this child
    # (relpath, expected binding) -> {(tensor name, first, stop): 1-D tensor}: the element ranges
    # this rank asked for with a `protocol.PartialRead` (or cut from a file it read whole), checked
    ranges: Callable[[str, dict[str, str]], dict] | None = None
    # model parameter -> the saved adapter tensor restored into it (`masters.AdapterLookup`): every
    # master a family restores must be the one that adapter tensor was cast from (`masters.check_master`)
    adapter: Callable[[torch.Tensor], Any] | None = None
    # the checkpoint's param groups against the launch's (`core.hyperparameters.Reconciler`): each
    # family hands it the saved groups (decoded; settled in place) and the live ones, in order
    hyperparameters: Any = None


@dataclass(frozen=True)
class ReshardContext:
    """What a resharding load (`megatron.reshard`) knows of the saved and the running layout.

    A family's `plan_reshard` gets every saved parameter's block per coordinate, this rank's
    blocks, and the copies that give a wanted block from saved ones.
    """

    manifest: Any  # the generation's `core.layout.Manifest` (damage is reported against it)
    saved: dict  # saved coordinate -> {chunk-qualified name: `core.global_layout.Block`}
    names: dict[int, str]  # id(model parameter) -> this run's chunk-qualified name
    # (wanted block, [saved blocks]) -> `core.global_layout.plan_copies` of the whole wanted block;
    # cached, so an adapter weight and its optimizer shard's part of it are planned once
    copies: Callable[[Any, list], list]
    # this run's parameter name -> its block on this rank; raises IncompatibleCheckpoint where
    # megatron's layout does not say where it lies in the global model
    block_of: Callable[[str], Any]
    # this rank and every rank's coordinates, this run (a family prefers the saved copies its own
    # coordinate wrote: at the saved layout it then reads its own files only); None: no preference
    view: RankView | None = None
    # child index -> every rank's description of it (`chain.by_index`: None where a stub)
    described: dict = field(default_factory=dict)
    # at the saved layout: a child that never stepped on any rank has its moments verified at open
    # but not kept, and read again at install (the same-layout load's memory bound); elsewhere
    # every range is read once and kept
    defer_moments: bool = False
    # the load is at the saved model-parallel layout: a family may place what the saved record
    # lacks as this run describes it, where it checks that this is the saved layout's
    saved_layout: bool = False


def saved_state_at(index: int, coordinates, states: dict):
    """The saved JSON state (param groups, steps, grad scaler) of child `index` at `coordinates`.

    A resharding rank draws from those saved coordinates: their states must all be there (else
    ValueError) and agree (else IncompatibleCheckpoint).
    """
    found = {key: states.get(f"{index}:{key}") for key in coordinates}
    missing = sorted(k for k, v in found.items() if v is None)
    if missing:
        raise ValueError(f"the training state holds no optimizer state for child {index} at {missing}")
    if not found:
        raise ValueError(f"optimizer child {index}: this rank draws from no saved coordinate")
    first_key, state = next(iter(found.items()))
    for key, other in found.items():
        if other != state:
            raise IncompatibleCheckpoint(
                f"optimizer child {index}: the saved param groups and steps at {first_key} and {key} differ, "
                "so no single state fits this rank's merged parameters"
            )
    return state


class ChildFamily(Protocol):
    """One family of optimizer children. Each method runs on every rank that holds the child.

    Every method is local and may raise (the caller agrees on the outcome). `plan` is pure: a
    `core.child_layouts` record, whose JSON goes into the manifest (`SavedChild.layout`). Every
    rank derives the same plan from the same descriptions, and raises the same error where they
    are inconsistent.
    """

    kind: FamilyKind  # its name in the manifest
    dp_elastic: bool  # its saved state restores exactly at another data-parallel size

    def describe(self, child: Child, coords: Coordinates, names: dict[int, str], saving: bool) -> Held:
        """What this rank holds of `child` (its `Held` record): at least `params`."""

    def parse_held(self, data: dict) -> Held:
        """`describe`'s record back from its JSON (`Held.to_json`, in a `ChildDescription`'s)."""

    def plan(self, index: int, described: list[ChildDescription | None], ranks: list[Coordinates]) -> ChildLayout:
        """From every rank's description (None where the child is a stub): files, and what they hold
        (the family's `core.child_layouts` record)."""

    def collect(self, child: Child, view: RankView, plan: ChildLayout, keys: tuple[str, ...]) -> Collected:
        """Local copies of what this rank contributes, and the JSON state it records (if any)."""

    def exchange_for_save(
        self, child: Child, view: RankView, plan: ChildLayout, collected: Collected
    ) -> dict[str, OptimizerFile]:
        """`{relpath: OptimizerFile}` this rank writes (from `collected`; no collectives)."""

    def files_to_read(
        self, index: int, view: RankView, described: list[ChildDescription | None], plan: ChildLayout
    ) -> list:
        """The files this rank needs to restore the child (`plan` is the saved one): relpaths read
        whole, or `protocol.PartialRead`s of some element ranges. Raises
        `IncompatibleCheckpoint` where the checkpoint cannot be restored into this run."""

    def preflight(self, child: Child, view: RankView, described: list, plan: ChildLayout, read: ReadContext) -> Any:
        """Read (binding checked) and check everything against this rank's child; mutates nothing."""

    def plan_reshard(self, child: Child, saved: SavedChild, layout: ReshardContext) -> Any:
        """A resharding load's plan for this rank's part of `child` (`saved`: the checkpoint's record
        of the child, saved with state, of this family): which element ranges of which saved files
        hold it. A frozen record with at least `keys` (the state keys) and `files` (relpaths read
        whole, or `protocol.PartialRead`s); nothing read. Raises IncompatibleCheckpoint naming what
        cannot map, `GenerationDamaged` where the saved layout does not give it."""

    def restore_resharded(self, child: Child, plan: Any, read: ReadContext) -> Any:
        """`plan_reshard`'s plan read and assembled (binding checked) into the same restore
        `preflight` returns, for `allocate` and `install`; mutates nothing. Checks what `preflight`
        checks: param groups (`read.hyperparameters`, if given), every master against its adapter
        (`read.adapter`, if given), the saved states of the coordinates drawn from agreeing."""

    def allocate(self, child: Child, restore: Any) -> None:
        """First mutation: param groups and state allocated, ready to receive."""

    def replaces(self, restore: Any) -> tuple[str, ...]:
        """The state keys `install` puts new tensors under, never writing the old ones (the undo
        record keeps those old tensors instead of copies); () when it writes in place."""

    def install(self, child: Child, restore: Any) -> None:
        """Copy into masters and state (or replace the `replaces` keys' tensors), then read every
        copied tensor back bit for bit."""
