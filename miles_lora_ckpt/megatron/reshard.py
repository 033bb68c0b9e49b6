"""A format-v3 load planned from the generation's global layout, at its layout or another.

Another layout may differ in TP, expert TP, EP, PP, VPP or CP.

`ReshardPlan.build` runs before any file is read. From the manifest's `global_layout` (every saved
parameter's `Block` per coordinate, the adapter files and who wrote them) it plans, for this rank:

- Every adapter weight: which runs of which saved tensors make it (`global_layout.plan_copies`).
  A file whose every tensor is wanted whole is read whole. A weight that is one whole saved
  tensor goes into its parameter as read, with no copy. Any other file is read in part: one
  range per saved tensor (`protocol.PartialRead`), or the whole file without a block index.
- Every optimizer child, by its own family (`ChildFamily.plan_reshard`). A DistributedOptimizer
  shard comes from element ranges of the saved slice files. A Float16, FP32 or layer-wise child's
  parameters are assembled whole from the saved blocks.

Saved copies in the files this rank's own coordinate wrote come first. A load at the saved layout
then reads its own files only, as the reader of v1 and v2 generations does. There a
DistributedOptimizer record without `positions` is placed as this run describes it, its buckets
checked to be the saved ones. A slot load through `rename_slot` is planned through its model view
(`param_blocks.describe`), at the saved layout only (`savers.multi_lora.load`).

What cannot map is refused with `IncompatibleCheckpoint`, naming the parameter and both values.
That is other target modules, another global shape or dtype, or another optimizer or child family.
So is a parameter megatron cannot place (an EP change needs globally numbered experts). A
generation with a parameter it cannot place at all (`null` in the manifest) loads at its saved
layout only, by the reader of each rank's own files (`savers.single_lora.load`).

`preflight` then assembles each adapter weight and each child's restore
(`ChildFamily.restore_resharded`). Nothing changes before the load's preflight agreement.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from miles_lora_ckpt.core import layout_rules, partial_reads
from miles_lora_ckpt.core.errors import IncompatibleCheckpoint
from miles_lora_ckpt.core.global_layout import (
    Block,
    distinct,
    plan_copies,
    strided_runs,
    strided_view,
)
from miles_lora_ckpt.core.protocol import PartialRead
from miles_lora_ckpt.megatron import adapter_shards as shards
from miles_lora_ckpt.megatron.optimizer_children import chain, family_of
from miles_lora_ckpt.megatron.optimizer_children.family import ReadContext, ReshardContext
from miles_lora_ckpt.megatron.optimizer_children.masters import AdapterSource
from miles_lora_ckpt.megatron.param_blocks import UNNUMBERED_EXPERT

__all__ = ["ReshardPlan"]

_ADAPTER_FILE = re.compile(r"^adapter/(dense|expert)_([a-z0-9_]+)\.safetensors$")


@dataclass(frozen=True)
class _Source:
    """One saved copy of a global tensor: where it is (an adapter file) and its block."""

    where: str  # the adapter file's relpath
    name: str  # its chunk-qualified name there
    block: Block


class AdapterCopy(NamedTuple):
    """One run of a saved adapter tensor's elements into a wanted adapter weight."""

    source: _Source  # the saved copy it is read from
    copy: Any  # `core.global_layout.plan_copies`' run: `first`, `into`, `count`


class AdapterPlan(NamedTuple):
    """How one adapter weight of this rank is assembled from saved tensors."""

    block: Block  # its block on this rank
    copies: list[AdapterCopy]  # every run that fills it, each element exactly once


@dataclass
class ReshardPlan:
    """What this rank reads and where it goes (see the module docstring)."""

    adapter: dict[str, AdapterPlan] = field(default_factory=dict)  # this run's name -> its plan
    adapter_spans: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)  # (file, tensor) -> read
    children: dict = field(default_factory=dict)  # index -> its family's plan (`ChildFamily.plan_reshard`)
    files: list = field(default_factory=list)
    # (wanted block, saved blocks) -> plan_copies of the whole block: an adapter weight and its
    # optimizer shard's part of it are planned once (`cut_copies`)
    _plans: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, manifest, request, saved_children: dict, restore_optimizer: bool) -> ReshardPlan:
        """This rank's plan for `manifest` (a format-v3 generation). `request` is the load's
        `LoadRequest` (every rank's plans, the model, the selection); `saved_children` the
        manifest's child records ({} when no optimizer state is restored). Returns the plan; nothing
        is read. Raises IncompatibleCheckpoint naming what cannot map (a v1 or v2 generation
        too), GenerationDamaged where the saved layout breaks its rules (`layout_rules`)."""
        current = _topology(request)
        changes = ", ".join(manifest.topology.model_parallel_differences(current))
        layout = manifest.metadata.get("global_layout")
        if manifest.format_version < 3 or not isinstance(layout, dict):
            raise IncompatibleCheckpoint(
                f"exact restore needs the same model-parallel layout; checkpoint -> this run differs in {changes}, "
                f"and generation {manifest.generation} (format v{manifest.format_version}) records no global layout "
                "to reshard from (only the data-parallel size may change)"
            )
        running = [_parsed(plan.global_blocks) for plan in request.plans]  # every rank's blocks, parsed once
        # the layout's structural rules, as `verify` checks them (`layout_rules`: blocks tiling their
        # global tensors, adapter files' coordinates their bindings', positions inside their buckets)
        saved = _gate_up_axis(layout_rules.saved_blocks(manifest), running)
        _check_same_model(
            saved, running, f"cannot reshard ({changes})" if changes else "cannot load at the saved layout"
        )
        plan = cls()
        mine = running[request.rank]
        plan._plan_adapter(layout, saved, request, mine, manifest)
        if restore_optimizer:
            plan._plan_optimizer(saved, request, saved_children, manifest, mine, same_layout=not changes)
        return plan

    def _whole_plan(self, block: Block, saved: list[Block]) -> list:
        key = (block, tuple(saved))
        if key not in self._plans:
            self._plans[key] = plan_copies(block, 0, block.numel, saved)
        return self._plans[key]

    # ----------------------------------------------------------------------- adapter

    def _plan_adapter(self, layout: dict, saved: dict, request, mine: dict, manifest) -> None:
        sources: dict[str, list[_Source]] = {}
        numels: dict[str, dict[str, int]] = {}  # file -> saved tensor -> its element count
        for file, entry in sorted(layout.get("adapter_files", {}).items()):
            for name in entry["names"]:
                block = saved[entry["coordinate"]][name]
                sources.setdefault(block.name, []).append(_Source(file, name, block))
                numels.setdefault(file, {})[name] = block.numel
        # this rank's own files first (those a same-layout load reads): a replica is then read from
        # there, so a load at the saved layout reads its own files only
        own = {shards.dense_file(request.coords), shards.expert_file(request.coords)}
        spans: dict[str, dict[str, list[int]]] = {}  # file -> saved tensor -> [first, stop) this rank reads
        for name in sorted(request.adapter_params()):
            block = _block_of(mine, name)
            found = sorted(sources.get(block.name, []), key=lambda s: s.where not in own)
            if not found:  # the model has it, no saved adapter file does (a slot saved with a narrower filter)
                raise IncompatibleCheckpoint(
                    f"adapter names differ: missing {name}: no saved adapter file holds {block.name}"
                )
            found = [found[i] for i in distinct([s.block for s in found])]
            try:
                copies = self._whole_plan(block, [s.block for s in found])
            except ValueError as exc:
                raise IncompatibleCheckpoint(f"adapter parameter {name}: {exc}") from None
            self.adapter[name] = AdapterPlan(block, [AdapterCopy(found[c.source], c) for c in copies])
            for c in copies:
                source = found[c.source]
                span = spans.setdefault(source.where, {}).setdefault(source.name, [c.first, c.first + c.count])
                span[0], span[1] = min(span[0], c.first), max(span[1], c.first + c.count)
        for file, named in sorted(spans.items()):
            self.adapter_spans.update({(file, name): tuple(span) for name, span in named.items()})
            record = manifest.files.get(file)
            whole = all(named.get(n) == [0, numel] for n, numel in numels[file].items())
            if whole:  # every tensor of the file wanted whole: one read, as at the saved layout
                self.files.append(file)
            elif getattr(record, "blocks", None) is None:  # written before adapter files had a block index
                self.files.append(file)
            else:  # one range per saved tensor: its elements this rank needs, and those between
                self.files.append(PartialRead(file, tuple((n, *span) for n, span in sorted(named.items()))))

    def adapter_tensors(self, opened, params: dict, check_binding) -> list[tuple[dict, dict]]:
        """`[(params, {name: local tensor})]` for `UndoRecord.write_params`. A weight that is one
        whole saved tensor is that tensor as read, with no copy. Any other is assembled from the
        ranges of the saved tensors that hold its elements. Everything was verified at open (the
        blocks read, or the whole file). Raises ValueError naming the file where a saved tensor's
        dtype or size is not the manifest's."""
        read: dict[str, tuple] = {}  # file -> (its verified ranges, its tensors' dtypes and sizes)
        out = {}
        for name, planned in self.adapter.items():
            block, param, copies = planned.block, params[name], planned.copies
            by_source: dict[_Source, list] = {}
            for run in copies:
                by_source.setdefault(run.source, []).append((run.copy.first, run.copy.into, run.copy.count))
            whole = len(copies) == 1 and (copies[0].copy.first, copies[0].copy.into) == (0, 0)
            whole = whole and copies[0].copy.count == block.numel == copies[0].source.block.numel
            local = None if whole else torch.empty(block.numel, dtype=param.dtype)
            for source, runs in by_source.items():
                span, lo, hi = self._saved_span(opened, source, param, check_binding, read)
                if local is None:  # the saved tensor itself goes into the parameter
                    local = span
                    break
                # one strided copy per group of like runs (a row-parallel split: one per tensor), not per row
                for g in strided_runs([(first - lo, into, count) for first, into, count in runs]):
                    into = strided_view(local, block.numel, g.into, g.into_step, g.width, g.n)
                    into.copy_(strided_view(span, hi - lo, g.first, g.step, g.width, g.n))
            # every element came from a tensor checked finite when its file was read (at open)
            out[name] = local.view(param.shape)
        return [(params, out)] if out else []

    def _saved_span(self, opened, source: _Source, param, check_binding, read: dict) -> tuple:
        """`(tensor, first, stop)`: the verified range of saved tensor `source` this rank reads
        (binding checked once per file). Raises ValueError where the tensor is not the manifest's."""
        if source.where not in read:
            kind, key = _ADAPTER_FILE.match(source.where).groups()
            check_binding(opened, source.where, {"role": f"{kind}-adapter", "coordinate": key})
            read[source.where] = (opened.tensor_ranges(source.where), _saved_adapter_tensors(opened, source.where))
        ranges, described = read[source.where]
        lo, hi = self.adapter_spans[(source.where, source.name)]
        try:
            span = ranges.get((source.name, lo, hi))
        except ValueError as exc:
            raise ValueError(f"{source.where}: {exc}") from None
        dtype, numel, shape = described.get(source.name, (None, None, None))
        saved = None if dtype is None or (shape is not None and not source.block.holds(shape)) else (dtype, numel)
        if saved != (param.dtype, source.block.numel) or span is None or span.numel() != hi - lo:
            got = "nothing of that shape" if saved is None else f"{saved[0]}[{saved[1]} elements]"
            raise ValueError(
                f"{source.where}: {source.name} is {got}, the manifest says {param.dtype}{list(source.block.shape)}"
            )
        return span, lo, hi

    def adapter_sources(self, assembled: list[tuple[dict, dict]]) -> dict[int, AdapterSource]:
        """`{id(model parameter): AdapterSource}` of every adapter weight in `assembled`
        (`adapter_tensors`' result), naming the saved files it came from. Every master this load
        restores must be its cast (`masters.check_master`)."""
        out = {}
        for params, tensors in assembled:
            for name, tensor in tensors.items():
                files = sorted({run.source.where for run in self.adapter[name].copies})
                out[id(params[name])] = AdapterSource(name, tensor, " + ".join(files))
        return out

    # ----------------------------------------------------------------------- optimizer

    def _plan_optimizer(
        self, saved: dict, request, saved_children: dict, manifest, mine: dict, same_layout: bool
    ) -> None:
        """Each stepped child's plan, by its own family (`ChildFamily.plan_reshard`); the chain's
        checks first (another class, optimizer or family refused)."""
        descriptions = request.descriptions()
        chain.check_against(saved_children, descriptions, request.rank, False)
        layout = ReshardContext(
            manifest,
            saved,
            request.view.names,
            self._whole_plan,
            lambda n: _block_of(mine, n),
            request.view,
            chain.by_index(descriptions),
            defer_moments=same_layout,
            saved_layout=same_layout,
        )
        partial: list[PartialRead] = []
        for desc in descriptions[request.rank]:
            index, entry = desc.index, chain.saved_record(saved_children, desc.index)
            if not entry.stepped:
                continue
            child = chain.select(request.optimizer, [index])[0]
            plan = family_of(child).plan_reshard(child, entry, layout)
            self.children[index] = plan
            self.files += [f for f in plan.files if not isinstance(f, PartialRead) and f not in self.files]
            partial += [f for f in plan.files if isinstance(f, PartialRead)]
        self.files += sorted(partial, key=lambda read: read.relpath)

    def restores(
        self, optimizer, bound_ranges, bound_tensors, states: dict, hyperparameters=None, adapter=None
    ) -> dict:
        """`{index: the family's restore}` for `chain.allocate` and `chain.install`, each child's
        by its family (`ChildFamily.restore_resharded`). `bound_ranges` and `bound_tensors` read
        this rank's verified files, binding checked; `states` is the training state's per-child JSON.
        `hyperparameters` (a `core.hyperparameters.Reconciler`) settles the saved param groups
        against the live ones. `adapter(model parameter)` gives the adapter weight restored into it
        (`adapter_sources`); every master must be its cast (None: not checked). Raises
        IncompatibleCheckpoint or ValueError as the families do; mutates nothing."""
        out = {}
        for index, plan in self.children.items():
            child = chain.select(optimizer, [index])[0]
            read = ReadContext(bound_tensors, states, plan.keys, bound_ranges, adapter, hyperparameters)
            out[index] = family_of(child).restore_resharded(child, plan, read)
        return out


def _saved_adapter_tensors(opened, relpath: str) -> dict[str, tuple[torch.dtype, int, tuple | None]]:
    """`{name: (dtype, element count, shape or None)}` of the tensors of one saved adapter file.
    They come from its block index where it has one (no shape; the header agreed with the index
    when read), otherwise from the tensors of the file read whole."""
    record = opened.manifest.files[relpath]
    if record.blocks is not None:
        out = {}
        for name in record.blocks.tensors:
            torch_name, numel = partial_reads.indexed_tensor(record.blocks, name)
            out[name] = (getattr(torch, torch_name), numel, None)
        return out
    return {name: (t.dtype, t.numel(), tuple(t.shape)) for name, t in opened.tensors(relpath).items()}


def _topology(request):
    return request.plans[request.rank].topology


def _gate_up_axis(saved: dict, running: list[dict]) -> dict:
    """`saved` with each whole block of a gated fc1 output as `param_blocks` now describes it.

    A v3 generation written before gated fc1 outputs were described with their gate/up axis
    recorded such a parameter whole at TP 1 (`[G, ...]`; split over TP it was recorded unknown).
    Whole, `[G, ...]` and `[2, G/2, ...]` are the same elements in the same C order, so such a
    block is taken as the one of the gate/up axis this run describes (same name)."""
    ours: dict[str, Block] = {}
    for described in running:
        for block in described.values():
            if block is not None and len(block.global_shape) >= 2:
                ours.setdefault(block.name, block)
    out = {}
    for key, blocks in saved.items():
        out[key] = {}
        for name, block in blocks.items():
            mine = None if block is None else ours.get(block.name)
            whole = block is not None and block.shape == block.global_shape and not any(block.offset)
            g = None if mine is None else mine.global_shape
            if whole and g is not None and len(g) == len(block.global_shape) + 1:
                if (g[0] * g[1], *g[2:]) == block.global_shape:
                    block = Block(block.name, g, (0,) * len(g), g, block.dtype)
            out[key][name] = block
    return out


def _parsed(described: dict) -> dict[str, Block | None]:
    """A rank's `param_blocks.describe` result with every block parsed (`Block`, or None)."""
    return {name: None if data is None else Block.from_dict(data, name) for name, data in described.items()}


def _block_of(described: dict, name: str) -> Block:
    """The block of parameter `name` in a parsed description (`_parsed`); refused where unknown."""
    block = described.get(name)
    if block is None:
        raise IncompatibleCheckpoint(
            f"parameter {name}: megatron's layout does not say where it lies in the global model"
        )
    return block


def _check_same_model(saved: dict, running: list[dict], refused: str) -> None:
    """Every trainable parameter of this run and of the checkpoint, by global name: the same set,
    global shapes and dtypes. Raises IncompatibleCheckpoint naming the first difference."""
    theirs: dict[str, Block] = {}
    for key, blocks in sorted(saved.items()):
        for name, block in blocks.items():
            if block is None:
                raise IncompatibleCheckpoint(
                    f"{refused}: the checkpoint does not say where {name} (at {key}) lies in the global model"
                )
            theirs.setdefault(block.name, block)
    ours: dict[str, Block] = {}
    for described in running:
        for name in sorted(described):
            block = _block_of(described, name)
            ours.setdefault(block.name, block)
    extra, missing = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    base = lambda n: n.split(UNNUMBERED_EXPERT)[0]  # noqa: E731
    moved = {base(n) for n in extra} & {base(n) for n in missing}
    unnumbered = sorted(n for n in (*extra, *missing) if UNNUMBERED_EXPERT in n and base(n) in moved)
    if unnumbered:
        raise IncompatibleCheckpoint(
            f"{refused}: expert parameter {unnumbered[0]} has no global expert number "
            "(one expert per EP rank, no local_expert_indices): experts cannot move across EP ranks"
        )
    if extra or missing:
        first = (extra or missing)[0]
        where = "this run has" if extra else "the checkpoint has"
        other = "the checkpoint does not" if extra else "this run does not"
        raise IncompatibleCheckpoint(
            f"{refused}: {where} trainable parameter {first}, {other} "
            f"({len(extra)} only in this run, {len(missing)} only in the checkpoint: other target modules?)"
        )
    for name in sorted(ours):
        a, b = theirs[name], ours[name]
        if a.global_shape != b.global_shape:
            gated = len(a.global_shape) != len(b.global_shape) and math.prod(a.global_shape) == math.prod(
                b.global_shape
            )
            why = (
                "a gated (swiglu) linear_fc1 in one, not in the other?"
                if gated
                else "another LoRA rank or model shape?"
            )
            raise IncompatibleCheckpoint(
                f"{refused}: {name} has global shape {list(a.global_shape)} in the checkpoint, "
                f"{list(b.global_shape)} in this run ({why})"
            )
        if a.dtype != b.dtype:
            raise IncompatibleCheckpoint(f"{refused}: {name} is {a.dtype} in the checkpoint, {b.dtype} in this run")
