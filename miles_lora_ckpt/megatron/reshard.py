"""A resharding load: a format-v3 generation restored at another TP, expert-TP, EP, PP, VPP or CP layout.

An EP change needs experts numbered globally (`param_blocks`: megatron's `local_expert_indices`).

`ReshardPlan.build` runs inside `files_for_rank` (no file read yet, nothing changed): from the
manifest's `global_layout` (every saved parameter's `Block` per coordinate, the adapter files and
who wrote them) and each DistributedOptimizer child's `layout.positions` (where each parameter
lies in its bucket's world tensor), it works out, for this rank of the new layout,

- every adapter weight: which saved files and which flat runs of which saved tensors make it
  (`core.global_layout.plan_copies`); of each saved adapter tensor it needs, the rank reads one
  range (from its first element needed to its last: `protocol.PartialRead`, only those blocks
  read and verified), or the whole file where it has no block index (written before 2026-12-02);
- every parameter element of this rank's DistributedOptimizer shards: which element ranges of
  which saved slice files hold its master and moments (`protocol.PartialRead`: only those blocks
  are read and verified), and where they go in the shard; the install is the same-layout one
  (`distributed.DistributedFamily.install`: bucket by bucket, read back bit for bit);
- every parameter of a Float16 / FP32 or layer-wise child: assembled whole from the saved blocks
  (`reshard_whole`);

and refuses (`IncompatibleCheckpoint`, naming the parameter and both values) what cannot map:
another set of adapter parameters (target modules), another global shape (LoRA rank, model
shape), another dtype, a parameter whose place in the global model megatron cannot describe,
another optimizer or child family (the chain's own checks). A chosen-children or multi-LoRA slot
load reshards its own adapter weights and children only (the whole model must still match); a
slot load through `rename_slot` (a model view) is refused (its parameters have no global block).

`preflight` then reads (this rank's files were verified by the protocol), assembles each adapter
weight and each child's restore, and checks that the saved param groups and steps of every
coordinate this rank draws from agree. Nothing is changed before the load's preflight agreement.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from miles_lora_ckpt.core import layout_rules, storage
from miles_lora_ckpt.core.errors import IncompatibleCheckpoint
from miles_lora_ckpt.core.family_kind import FamilyKind
from miles_lora_ckpt.core.global_layout import (
    Block,
    cut_copies,
    distinct,
    fill_problem,
    plan_copies,
    strided_runs,
    strided_view,
)
from miles_lora_ckpt.core.jsoncodec import from_json
from miles_lora_ckpt.core.layout import MANIFEST
from miles_lora_ckpt.core.protocol import PartialRead
from miles_lora_ckpt.megatron import reshard_whole
from miles_lora_ckpt.megatron.optimizer_children import chain, distributed
from miles_lora_ckpt.megatron.optimizer_children.child import MASTER_KEY
from miles_lora_ckpt.megatron.optimizer_children.masters import AdapterSource
from miles_lora_ckpt.megatron.param_blocks import UNNUMBERED_EXPERT

_ADAPTER_FILE = re.compile(r"^adapter/(dense|expert)_([a-z0-9_]+)\.safetensors$")


@dataclass(frozen=True)
class _Source:
    """One saved copy of a global tensor: where it is (adapter file / optimizer coordinate) and its block."""

    where: str  # adapter file relpath, or the optimizer coordinate key
    name: str  # its chunk-qualified name there
    block: Block
    position: tuple | None = None  # optimizer: (buffer, bucket, start, numel) in that coordinate's buckets


@dataclass
class _ChildPlan:
    index: int
    keys: tuple[str, ...]
    coordinates: list[str]  # the saved coordinates this rank draws from (their JSON states must agree)
    buckets: list[list]  # per bucket of this rank: [(piece, first, stop, offset in the shard, rows)] (`_row_parts`)


@dataclass
class ReshardPlan:
    """What this rank reads and where it goes (see the module docstring)."""

    adapter: dict[str, tuple[Block, list]] = field(default_factory=dict)  # name -> (block, [(source, copy)])
    adapter_spans: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)  # (file, tensor) -> read
    children: dict[int, _ChildPlan] = field(default_factory=dict)
    whole: dict[int, tuple] = field(default_factory=dict)  # index -> (reshard_whole.WholePlan, state keys)
    files: list = field(default_factory=list)
    # (wanted block, saved blocks) -> plan_copies of the whole block: an adapter weight and its
    # optimizer shard's part of it are planned once (`cut_copies`)
    _plans: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, manifest, request, saved_children: dict, restore_optimizer: bool) -> ReshardPlan:
        """Plan this rank's reads, or raise IncompatibleCheckpoint naming what cannot map."""
        current = _topology(request)
        changes = ", ".join(manifest.topology.model_parallel_differences(current))
        layout = manifest.metadata.get("global_layout")
        if manifest.format_version < 3 or not isinstance(layout, dict):
            raise IncompatibleCheckpoint(
                f"exact restore needs the same model-parallel layout; checkpoint -> this run differs in {changes}, "
                f"and generation {manifest.generation} (format v{manifest.format_version}) records no global layout "
                "to reshard from (only the data-parallel size may change)"
            )
        running = [_parsed(plan["global"]) for plan in request.plans]  # every rank's blocks, parsed once
        # the layout's structural rules, as `verify` checks them (`layout_rules`: blocks tiling their
        # global tensors, adapter files' coordinates their bindings', positions inside their buckets)
        saved = _gate_up_axis(layout_rules.saved_blocks(manifest), running)
        _check_same_model(saved, running, changes)
        plan = cls()
        mine = running[request.rank]
        plan._plan_adapter(layout, saved, request, mine, manifest)
        if restore_optimizer:
            plan._plan_optimizer(saved, request, saved_children, manifest, mine)
        return plan

    def _whole_plan(self, block: Block, saved: list[Block]) -> list:
        key = (block, tuple(saved))
        if key not in self._plans:
            self._plans[key] = plan_copies(block, 0, block.numel, saved)
        return self._plans[key]

    # ----------------------------------------------------------------------- adapter

    def _plan_adapter(self, layout: dict, saved: dict, request, mine: dict, manifest) -> None:
        sources: dict[str, list[_Source]] = {}
        for file, entry in sorted(layout.get("adapter_files", {}).items()):
            for name in entry["names"]:
                block = saved[entry["coordinate"]][name]
                sources.setdefault(block.name, []).append(_Source(file, name, block))
        spans: dict[str, dict[str, list[int]]] = {}  # file -> saved tensor -> [first, stop) this rank reads
        for name in sorted(request.adapter_params()):
            block = _block_of(mine, name)
            found = sources.get(block.name, [])
            found = [found[i] for i in distinct([s.block for s in found])]
            try:
                copies = self._whole_plan(block, [s.block for s in found])
            except ValueError as exc:
                raise IncompatibleCheckpoint(f"adapter parameter {name}: {exc}") from None
            self.adapter[name] = (block, [(found[c.source], c) for c in copies])
            for c in copies:
                source = found[c.source]
                span = spans.setdefault(source.where, {}).setdefault(source.name, [c.first, c.first + c.count])
                span[0], span[1] = min(span[0], c.first), max(span[1], c.first + c.count)
        for file, named in sorted(spans.items()):
            self.adapter_spans.update({(file, name): tuple(span) for name, span in named.items()})
            record = manifest.files.get(file)
            if getattr(record, "blocks", None) is None:  # written before adapter files had a block index
                self.files.append(file)
            else:  # one range per saved tensor: its elements this rank needs, and those between
                self.files.append(PartialRead(file, tuple((n, *span) for n, span in sorted(named.items()))))

    def adapter_tensors(self, opened, params: dict, check_binding) -> list[tuple[dict, dict]]:
        """`[(params, {name: assembled local tensor})]` for `copy_into`: each adapter weight assembled
        from the ranges of the saved tensors that hold its elements (verified at open: the blocks
        holding them, or the whole file where it has no block index)."""
        read: dict[str, tuple] = {}  # file -> (its verified ranges, its tensors' dtypes and sizes)
        out = {}
        for name, (block, copies) in self.adapter.items():
            param = params[name]
            local = torch.empty(block.numel, dtype=param.dtype)
            by_source: dict[_Source, list] = {}
            for source, copy in copies:
                by_source.setdefault(source, []).append((copy.first, copy.into, copy.count))
            for source, runs in by_source.items():
                if source.where not in read:
                    kind, key = _ADAPTER_FILE.match(source.where).groups()
                    check_binding(opened, source.where, {"role": f"{kind}-adapter", "coordinate": key})
                    read[source.where] = (
                        opened.tensor_ranges(source.where),
                        _saved_adapter_tensors(opened, source.where),
                    )
                ranges, described = read[source.where]
                lo, hi = self.adapter_spans[(source.where, source.name)]
                try:
                    span = ranges.get((source.name, lo, hi))
                except ValueError as exc:
                    raise ValueError(f"{source.where}: {exc}") from None
                dtype, numel, shape = described.get(source.name, (None, None, None))
                saved = (
                    None if dtype is None or (shape is not None and not source.block.holds(shape)) else (dtype, numel)
                )
                if saved != (param.dtype, source.block.numel) or span is None or span.numel() != hi - lo:
                    got = "nothing of that shape" if saved is None else f"{saved[0]}[{saved[1]} elements]"
                    raise ValueError(
                        f"{source.where}: {source.name} is {got}, the manifest says "
                        f"{param.dtype}{list(source.block.shape)}"
                    )
                # one strided copy per group of like runs (a row-parallel split: one per tensor), not per row
                for g in strided_runs([(first - lo, into, count) for first, into, count in runs]):
                    into = strided_view(local, block.numel, g.into, g.into_step, g.width, g.n)
                    into.copy_(strided_view(span, hi - lo, g.first, g.step, g.width, g.n))
            # every element came from a tensor checked finite when its file was read (at open)
            out[name] = local.view(param.shape)
        return [(params, out)] if out else []

    def adapter_sources(self, assembled: list[tuple[dict, dict]]) -> dict[int, AdapterSource]:
        """`{id(model parameter): AdapterSource}` of every assembled adapter weight (`adapter_tensors`'
        result), naming the saved adapter files it was assembled from: every master this load
        restores must be its cast (`masters.check_master`), as on a same-layout load."""
        out = {}
        for params, tensors in assembled:
            for name, tensor in tensors.items():
                files = sorted({source.where for source, _ in self.adapter[name][1]})
                out[id(params[name])] = AdapterSource(name, tensor, " + ".join(files))
        return out

    # ----------------------------------------------------------------------- optimizer

    def _plan_optimizer(self, saved: dict, request, saved_children: dict, manifest, mine: dict) -> None:
        descriptions = request.descriptions()
        chain.check_against(saved_children, descriptions, request.rank, False)
        requests: dict[str, set] = {}
        for desc in descriptions[request.rank]:
            index, entry = desc["index"], saved_children[str(desc["index"])]
            if not entry["stepped"]:
                continue
            if entry["family"] == desc["family"] and FamilyKind(entry["family"]).whole_parameter:
                child = chain.select(request.optimizer, [index])[0].optimizer
                whole = reshard_whole.plan_child(
                    index, entry["layout"], child, request.view.names, mine, saved, _block_of
                )
                self.whole[index] = (whole, tuple(entry["keys"]))
                self.files += [f for f in sorted(whole.files) if f not in self.files]
                continue
            if entry["family"] != FamilyKind.DISTRIBUTED or desc["family"] != FamilyKind.DISTRIBUTED:
                raise IncompatibleCheckpoint(
                    f"optimizer child {index}: the checkpoint saved a {entry['class']} ({entry['family']}), this run "
                    f"has a {desc['class']} ({desc['family']}): not resharded"
                )
            child = chain.select(request.optimizer, [index])[0].optimizer
            sources = _optimizer_sources(index, entry["layout"], saved, manifest)
            keys = tuple(entry["keys"])
            pieces = {
                key: distributed.saved_pieces(index, entry["layout"], key, entry["layout"]["numel_unpadded"][key])
                for key in sorted({s.where for found in sources.values() for s in found})
            }
            offsets = {
                key: {buf: [sum(n[:b]) for b in range(len(n))] for buf, n in numels.items()}
                for key, numels in entry["layout"]["numel_unpadded"].items()
            }
            used, buckets = set(), []
            for layout in distributed.bucket_layouts(child):
                parts, targets = [], []
                for model_param, ranges in distributed._param_maps(child, layout).items():
                    name = request.view.names[id(model_param)]
                    block = _block_of(mine, name)
                    found = sources.get(block.name, [])
                    found = [found[i] for i in distinct([s.block for s in found])]
                    first, stop = ranges["param"].start, ranges["param"].end
                    try:
                        copies = cut_copies(self._whole_plan(block, [s.block for s in found]), first, stop)
                    except ValueError as exc:
                        raise IncompatibleCheckpoint(f"optimizer child {index}, parameter {name}: {exc}") from None
                    runs: dict = {}  # id(piece) -> (piece, [(first, offset in the shard, count)]), in shard order
                    for copy in copies:
                        source = found[copy.source]
                        used.add(source.where)
                        buf, bucket, start, _ = source.position
                        lo = offsets[source.where][f"buf{buf}"][bucket] + start + copy.first
                        hi = lo + copy.count
                        into = ranges["gbuf_local"].start + copy.into
                        for piece in pieces[source.where]:
                            a, b = max(lo, piece.begin), min(hi, piece.end)
                            if piece.buf == f"buf{buf}" and b > a:
                                runs.setdefault(id(piece), (piece, []))[1].append(
                                    (a - piece.begin, into + (a - lo), b - a)
                                )
                    for piece, found_runs in runs.values():
                        for part in _row_parts(piece, found_runs, manifest):
                            parts.append(part)
                            requests.setdefault(piece.file, set()).update(
                                distributed.range_key(piece, k, part[1], part[2], part[4]) for k in (MASTER_KEY, *keys)
                            )
                    targets.append((ranges["gbuf_local"].start, ranges["gbuf_local"].end))
                # every element of this rank's shard of the bucket filled exactly once, as a same-layout
                # load checks its shard (`distributed.preflight`): no master or moment left as it was allocated
                problem = fill_problem(targets, [span for part in parts for span in _part_spans(part)])
                if problem is not None:
                    raise layout_rules.damaged(
                        manifest,
                        MANIFEST,
                        f"optimizer child {index}, buf{layout.buffer_index} bucket {layout.bucket_index} of this "
                        f"rank's shard: {problem}: the saved positions and blocks do not give it",
                    )
                buckets.append(parts)
            self.children[index] = _ChildPlan(index, keys, sorted(used), buckets)
        self.files += [PartialRead(f, tuple(sorted(r))) for f, r in sorted(requests.items())]

    def restores(
        self, optimizer, bound_ranges, bound_tensors, states: dict, hyperparameters=None, adapter=None
    ) -> dict:
        """`{index: the family's restore}` for `chain.allocate` / `chain.install`. A DistributedOptimizer
        child's ranges were verified at open (kept; installed from there); a whole-parameter child's
        files are read here. `hyperparameters` (a `core.hyperparameters.Reconciler`) checks every
        child's saved param groups against the live ones, as a same-layout load does: unknown keys
        refused, differences reported and settled by its policy. `adapter(model parameter)` is the
        assembled adapter weight restored into it (`adapter_sources`): every master restored must be
        its cast (`masters.check_master`, naming the parameter, the adapter files and the optimizer
        file), as on a same-layout load; None: not checked."""
        out = {}
        for index, plan in self.children.items():
            selected = chain.select(optimizer, [index])[0]
            child = selected.optimizer
            state = _one_state(index, plan.coordinates, states)
            groups = len(state.get("optimizer", {}).get("param_groups", [])) if isinstance(state, dict) else None
            if groups is not None and groups != len(child.optimizer.param_groups):
                raise IncompatibleCheckpoint(
                    f"optimizer child {index}: the checkpoint has {groups} param group(s), this run "
                    f"{len(child.optimizer.param_groups)}"
                )
            buckets = [
                [
                    (piece, bound_ranges(piece.file, piece.binding), first, stop, offset, rows)
                    for piece, first, stop, offset, rows in parts
                ]
                for parts in plan.buckets
            ]
            if adapter is not None:  # one bucket's master shard at a time, views of the verified ranges
                for layout, parts in zip(distributed.bucket_layouts(child), buckets, strict=True):
                    masters = [
                        (piece.file, *distributed.read_part(piece, source, MASTER_KEY, first, stop, offset, rows))
                        for piece, source, first, stop, offset, rows in parts
                    ]
                    distributed.check_master_shard(selected, layout, masters, adapter)
            state = from_json(state)  # as the same-layout preflight hands it to `allocate`
            groups = state.get("optimizer", {}).get("param_groups", [])
            if hyperparameters is not None:
                hyperparameters.param_groups(f"optimizer child {index}", groups, child.optimizer.param_groups)
            out[index] = distributed._Restore(plan.keys, state, buckets, groups)
        for index, (plan, keys) in self.whole.items():
            child = chain.select(optimizer, [index])[0].optimizer
            state = _one_state(index, plan.coordinates, states)
            out[index] = reshard_whole.restore(plan, child, bound_tensors, state, keys, hyperparameters, adapter)
        return out


def _row_parts(piece, runs: list, manifest) -> list[tuple]:
    """One parameter's `(first, offset in the shard, count)` runs of one saved piece, as bucket parts
    `(piece, first, stop, offset, rows)`: a strided group of rows (`strided_runs`, e.g. the half rows
    of a row-parallel split at another TP) is one part whose range `[first, stop)` covers them all
    and `rows` is `(step, width, n, offset step)`; a lone run is `rows` None. A group is covered
    only where the elements between its rows lie in blocks read and verified anyway (a gap shorter
    than the file's block), so nothing more is
    read or kept; otherwise its rows stay parts of their own. One range asked per group, not per row."""
    record = manifest.files.get(piece.file)
    blocks = getattr(record, "blocks", None)
    gap_limit = None if blocks is None else blocks.block_bytes // 4  # fp32 elements (`distributed._read_piece`)
    out = []
    for g in strided_runs(runs):
        if g.n == 1:
            out.append((piece, g.first, g.first + g.width, g.into, None))
        elif gap_limit is None or g.step - g.width <= gap_limit:
            stop = g.first + (g.n - 1) * g.step + g.width
            out.append((piece, g.first, stop, g.into, (g.step, g.width, g.n, g.into_step)))
        else:
            out += [
                (piece, g.first + i * g.step, g.first + i * g.step + g.width, g.into + i * g.into_step, None)
                for i in range(g.n)
            ]
    return out


def _part_spans(part: tuple) -> list[tuple[int, int]]:
    """The shard elements `(begin, end)` a bucket part (`_row_parts`) fills: one range, or its rows."""
    _, first, stop, into, rows = part
    if rows is None:
        return [(into, into + stop - first)]
    _, width, n, into_step = rows
    return [(into + i * into_step, into + i * into_step + width) for i in range(n)]


def _saved_adapter_tensors(opened, relpath: str) -> dict[str, tuple[torch.dtype, int, tuple | None]]:
    """`{name: (dtype, element count, shape or None)}` of the tensors of one saved adapter file, once
    per file: from its block index where it has one (a file read in part: the header agreed with
    the index when read; no shape), otherwise from the tensors of the file read whole."""
    record = opened.manifest.files[relpath]
    if record.blocks is not None:
        out = {}
        for name in record.blocks.tensors:
            torch_name, numel = storage.indexed_tensor(record.blocks, name)
            out[name] = (getattr(torch, torch_name), numel, None)
        return out
    return {name: (t.dtype, t.numel(), tuple(t.shape)) for name, t in opened.tensors(relpath).items()}


def _one_state(index: int, coordinates: list[str], states: dict):
    """The saved JSON state (param groups, steps, grad scaler) of a child at the coordinates a rank
    draws from: they must all be there and agree."""
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


def _topology(request):
    from miles_lora_ckpt.core.layout import Topology

    return Topology.from_dict(request.plans[request.rank]["topology"])


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


def _check_same_model(saved: dict, running: list[dict], changes: str) -> None:
    """Every trainable parameter of this run and of the checkpoint, by global name: the same set,
    global shapes and dtypes. Raises IncompatibleCheckpoint naming the first difference."""
    theirs: dict[str, Block] = {}
    for key, blocks in sorted(saved.items()):
        for name, block in blocks.items():
            if block is None:
                raise IncompatibleCheckpoint(
                    f"cannot reshard ({changes}): the checkpoint does not say where {name} (at {key}) lies in the global model"
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
            f"cannot reshard ({changes}): expert parameter {unnumbered[0]} has no global expert number "
            "(one expert per EP rank, no local_expert_indices): experts cannot move across EP ranks"
        )
    if extra or missing:
        first = (extra or missing)[0]
        where = "this run has" if extra else "the checkpoint has"
        other = "the checkpoint does not" if extra else "this run does not"
        raise IncompatibleCheckpoint(
            f"cannot reshard ({changes}): {where} trainable parameter {first}, {other} "
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
                f"cannot reshard ({changes}): {name} has global shape {list(a.global_shape)} in the checkpoint, "
                f"{list(b.global_shape)} in this run ({why})"
            )
        if a.dtype != b.dtype:
            raise IncompatibleCheckpoint(
                f"cannot reshard ({changes}): {name} is {a.dtype} in the checkpoint, {b.dtype} in this run"
            )


def _optimizer_sources(index: int, layout: dict, saved: dict, manifest) -> dict[str, list[_Source]]:
    """`{global name: [_Source]}` of one child's saved positions (checked by `layout_rules.saved_blocks`:
    inside their buckets, one parameter each, of their blocks' sizes)."""
    positions = layout.get("positions")
    if not isinstance(positions, dict):
        raise IncompatibleCheckpoint(f"optimizer child {index}: the checkpoint records no parameter positions")
    sources: dict[str, list[_Source]] = {}
    for key, named in sorted(positions.items()):
        for name, where in sorted(named.items()):
            block = saved.get(key, {}).get(name)
            if block is None or block.numel != where[3]:
                raise layout_rules.damaged(
                    manifest, MANIFEST, f"optimizer child {index} at {key}: {name} has no matching global block"
                )
            sources.setdefault(block.name, []).append(_Source(key, name, block, tuple(where)))
    return sources
