"""Pure slicing math of resharding (core.global_layout): no megatron, no processes."""

from __future__ import annotations

import math

import pytest
import torch

from miles_lora_ckpt.core import layout_rules
from miles_lora_ckpt.core.errors import GenerationDamaged
from miles_lora_ckpt.core.global_layout import Block, cut_copies, distinct, fill_problem, global_indices, plan_copies
from miles_lora_ckpt.core.layout import MANIFEST, FileRecord, Manifest, Topology


def _assemble(wanted: Block, first: int, stop: int, saved: list[Block], tensors: list[torch.Tensor]) -> torch.Tensor:
    out = torch.full((stop - first,), -1.0)
    for c in plan_copies(wanted, first, stop, saved):
        out[c.into : c.into + c.count] = tensors[c.source].reshape(-1)[c.first : c.first + c.count]
    return out


def _slice(full: torch.Tensor, block: Block) -> torch.Tensor:
    out = full
    for dim, (o, s) in enumerate(zip(block.offset, block.shape, strict=True)):
        out = out.narrow(dim, o, s)
    return out.contiguous()


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("saved_tp, wanted_tp", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_any_split_is_assembled_from_any_other(axis, saved_tp, wanted_tp):
    """Column- (axis 0) and row-parallel (axis 1) splits, gathered and re-split, any sub-range."""
    shape = (8, 12)
    full = torch.arange(96, dtype=torch.float32).view(shape)

    def blocks(tp):
        step = shape[axis] // tp
        return [
            Block(
                "w",
                shape,
                tuple(r * step if d == axis else 0 for d in range(2)),
                tuple(step if d == axis else shape[d] for d in range(2)),
            )
            for r in range(tp)
        ]

    saved = blocks(saved_tp)
    tensors = [_slice(full, b) for b in saved]
    for wanted in blocks(wanted_tp):
        expected = _slice(full, wanted).reshape(-1)
        for first, stop in ((0, wanted.numel), (3, wanted.numel - 5), (7, 8)):
            assert torch.equal(_assemble(wanted, first, stop, saved, tensors), expected[first:stop])


def test_a_relocated_whole_tensor_is_one_run():
    block = Block("layers.3.w", (4, 6), (0, 0), (4, 6))
    copies = plan_copies(block, 5, 17, [block])
    assert [(c.source, c.first, c.count, c.into) for c in copies] == [(0, 5, 12, 0)]


def test_missing_or_doubled_elements_and_other_tensors_are_refused():
    shape = (4, 6)
    left, right = Block("w", shape, (0, 0), (4, 3)), Block("w", shape, (0, 3), (4, 3))
    whole = Block("w", shape, (0, 0), shape)
    with pytest.raises(ValueError, match="by none"):
        plan_copies(whole, 0, 24, [left])
    with pytest.raises(ValueError, match="by more than one"):
        plan_copies(whole, 0, 24, [left, right, whole])
    with pytest.raises(ValueError, match="cannot give"):
        plan_copies(whole, 0, 24, [Block("w", (8, 6), (0, 0), (4, 6))])
    assert distinct([left, left, right, left]) == [0, 2]


def test_blocks_round_trip_and_bad_ones_are_refused():
    block = Block("w", (4, 6), (2, 0), (2, 6), "torch.bfloat16")
    assert Block.from_dict(block.to_dict(), "x") == block
    assert global_indices(block, 0, 3).tolist() == [12, 13, 14]
    with pytest.raises(ValueError, match="exceeds the global shape"):
        Block("w", (4, 6), (3, 0), (2, 6))
    bad = {**block.to_dict(), "offset": [2, -1]}
    with pytest.raises(ValueError):
        Block.from_dict(bad, "x")
    with pytest.raises(ValueError, match="expected global"):
        Block.from_dict({**block.to_dict(), "extra": 1}, "x")


@pytest.mark.parametrize("saved_tp, wanted_tp", [(2, 1), (1, 2), (2, 4)])
def test_swiglu_gate_and_up_halves_reshard(saved_tp, wanted_tp):
    """A gated fc1 output: TP rank r holds [gate_r; up_r] as [2 * L, n]; its block is [2, L, n] of
    [gate; up] read as [2, G, n] (`param_blocks`). Any TP's local tensors give any other's."""
    gate, up = torch.arange(24.0).view(8, 3), 100 + torch.arange(24.0).view(8, 3)

    def local(tp):  # what each TP rank holds, from the logical weight
        return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp), strict=True)]

    def blocks(tp):
        return [Block("w", (2, 8, 3), (0, r * 8 // tp, 0), (2, 8 // tp, 3)) for r in range(tp)]

    saved = blocks(saved_tp)
    assert all(b.holds(t.shape) for b, t in zip(saved, local(saved_tp), strict=True))
    for wanted, expected in zip(blocks(wanted_tp), local(wanted_tp), strict=True):
        assert torch.equal(_assemble(wanted, 0, wanted.numel, saved, local(saved_tp)), expected.reshape(-1))
        assert torch.equal(_assemble(wanted, 5, 11, saved, local(saved_tp)), expected.reshape(-1)[5:11])


def test_holds_is_the_same_shape_or_the_gate_up_axis_merged():
    assert Block("w", (4, 3), (0, 0), (4, 3)).holds((4, 3))
    assert not Block("w", (4, 3), (0, 0), (4, 3)).holds((3, 4))
    gated = Block("w", (2, 4, 3), (0, 2, 0), (2, 2, 3))
    assert gated.holds((2, 2, 3)) and gated.holds((4, 3))
    assert not gated.holds((2, 6)) and not gated.holds((12,))
    assert Block("b", (2, 4), (0, 2), (2, 2)).holds((4,))  # a gated bias


def _grid(name: str, shape: tuple, splits: tuple) -> list[Block]:
    """Every block of `shape` cut into `splits[d]` equal parts along each dimension d."""
    import itertools

    steps = [g // n for g, n in zip(shape, splits, strict=True)]
    return [
        Block(name, shape, tuple(i * s for i, s in zip(index, steps, strict=True)), tuple(steps))
        for index in itertools.product(*(range(n) for n in splits))
    ]


def test_run_based_plan_matches_element_by_element_on_random_grids():
    """`plan_copies` works run by run (`runs`): on random 1-3-d shapes, cut into random grids
    (saved and wanted), every sub-range assembles to the wanted elements, and a dropped or doubled
    saved block is counted element by element as the all-elements definition counts it."""
    import random

    rng = random.Random(21)
    for _ in range(300):
        dims = rng.randint(1, 3)
        splits_saved = tuple(rng.choice([1, 2, 4]) for _ in range(dims))
        splits_wanted = tuple(rng.choice([1, 2, 4]) for _ in range(dims))
        shape = tuple(4 * rng.randint(1, 3) for _ in range(dims))
        full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
        saved = _grid("w", shape, splits_saved)
        tensors = [_slice(full, b) for b in saved]
        wanted = rng.choice(_grid("w", shape, splits_wanted))
        first = rng.randint(0, wanted.numel)
        stop = rng.randint(first, wanted.numel)
        expected = _slice(full, wanted).reshape(-1)[first:stop]
        assert torch.equal(_assemble(wanted, first, stop, saved, tensors), expected), (shape, wanted, first, stop)
        # a range cut from the whole block's plan is that range's plan, copy for copy
        whole = plan_copies(wanted, 0, wanted.numel, saved)
        assert cut_copies(whole, first, stop) == plan_copies(wanted, first, stop, saved), (shape, wanted, first, stop)
        # against the element-by-element definition: drop one saved block, or give one twice
        broken = list(saved)
        if rng.random() < 0.5:
            broken.pop(rng.randrange(len(broken)))
        else:
            broken.append(Block("w", shape, (0,) * dims, shape))
        need = global_indices(wanted, first, stop)
        hits = sum((torch.isin(need, global_indices(b)).to(torch.int64) for b in broken), torch.zeros_like(need))
        missing, twice = int((hits == 0).sum()), int((hits > 1).sum())
        if missing or twice:
            with pytest.raises(ValueError, match=f"give {missing} wanted element.* and {twice} by more than one"):
                plan_copies(wanted, first, stop, broken)
        else:
            assert torch.equal(_assemble(wanted, first, stop, broken, [_slice(full, b) for b in broken]), expected)


def test_a_block_inside_one_saved_block_is_planned_by_arithmetic_run_by_run():
    """`plan_copies`' path for one saved block holding every wanted element (a TP split of a larger
    saved block): a column split of a whole tensor is one run; a row-parallel split is one run per
    row, each row's elements at the saved row's place; a gate/up block keeps its two halves apart."""
    whole = Block("w", (8, 12), (0, 0), (8, 12))
    copies = plan_copies(Block("w", (8, 12), (4, 0), (4, 12)), 0, 48, [whole])
    assert [(c.source, c.first, c.count, c.into) for c in copies] == [(0, 48, 48, 0)]
    copies = plan_copies(Block("w", (8, 12), (0, 6), (8, 6)), 2, 20, [whole])
    assert [(c.first, c.count, c.into) for c in copies] == [(8, 4, 0), (18, 6, 4), (30, 6, 10), (42, 2, 16)]
    gated = Block("fc1", (2, 8, 3), (0, 0, 0), (2, 8, 3))
    copies = plan_copies(Block("fc1", (2, 8, 3), (0, 4, 0), (2, 4, 3)), 0, 24, [gated])
    assert [(c.first, c.count, c.into) for c in copies] == [(12, 12, 0), (36, 12, 12)]
    # inside a saved block that is itself a split: offsets are the saved block's own
    half = Block("w", (8, 12), (0, 6), (8, 6))
    copies = plan_copies(Block("w", (8, 12), (2, 9), (2, 3)), 0, 6, [half])
    assert [(c.first, c.count, c.into) for c in copies] == [(15, 3, 0), (21, 3, 3)]


# --------------------------------------------------------------------------- the layout's own rules


def test_fill_problem_says_what_a_shard_would_miss_get_twice_or_spill():
    """The shared check of every destination shard (same-layout and resharding loads): every
    element exactly once, nothing outside."""
    assert fill_problem([(0, 10)], [(0, 4), (4, 10)]) is None
    assert fill_problem([(0, 4), (6, 10)], [(6, 10), (0, 4)]) is None  # a gap between parameters: not a target
    assert fill_problem([], []) is None
    assert fill_problem([(0, 10)], [(0, 4), (5, 10)]).startswith("1 element(s) would be filled by nothing, 0 ")
    assert "1 by more than one saved element" in fill_problem([(0, 10)], [(0, 5), (4, 10)])
    assert "2 outside every destination (first at element 4)" in fill_problem([(0, 4), (6, 10)], [(0, 10)])
    assert "(first at element 0)" in fill_problem([(0, 4)], [])  # a position that fell outside every piece


C0, C1 = "tp000_pp000_ep000_etp000", "tp001_pp000_ep000_etp001"
DENSE0, DENSE1 = "adapter/dense_tp000_pp000.safetensors", "adapter/dense_tp001_pp000.safetensors"


def _v3_manifest(edit=None) -> Manifest:
    """A format-v3 manifest of a TP 2 save (its layout as the single-LoRA saver records it): `B` split
    on axis 0 over the two TP ranks, `A` whole on both, one DistributedOptimizer child whose bucket
    holds both parameters. `edit(metadata, files)` changes it first."""

    def block(name, global_shape, offset, shape):
        return Block(name, global_shape, offset, shape, "torch.bfloat16").to_dict()

    params = {
        key: {
            "chunk0.B": block("B", (8, 4), (4 * tp, 0), (4, 4)),
            "chunk0.A": block("A", (4, 6), (0, 0), (4, 6)),
        }
        for tp, key in enumerate((C0, C1))
    }
    metadata = {
        "global_layout": {
            "params": params,
            "adapter_files": {
                DENSE0: {"coordinate": C0, "names": ["chunk0.A", "chunk0.B"]},
                DENSE1: {"coordinate": C1, "names": ["chunk0.A", "chunk0.B"]},
            },
        },
        "optimizer_children": {
            "0": {
                "family": "distributed",
                "layout": {
                    "numel_unpadded": {key: {"buf0": [40]} for key in (C0, C1)},
                    "positions": {key: {"chunk0.B": [0, 0, 0, 16], "chunk0.A": [0, 0, 16, 24]} for key in (C0, C1)},
                    "slices": {
                        key: [{"file": _slice_file(key), "slice": "0/1", "bounds": {"buf0": [[0, 40]]}}]
                        for key in (C0, C1)
                    },
                },
            }
        },
    }
    files = {
        DENSE0: FileRecord(1, "xxh3_128:" + "0" * 32, binding={"role": "dense-adapter", "coordinate": "tp000_pp000"}),
        DENSE1: FileRecord(1, "xxh3_128:" + "0" * 32, binding={"role": "dense-adapter", "coordinate": "tp001_pp000"}),
    }
    for key in (C0, C1):
        binding = {"role": "optimizer", "coordinate": key, "child": "0", "slice": "0/1"}
        files[_slice_file(key)] = FileRecord(1, "xxh3_128:" + "0" * 32, binding=binding)
    if edit is not None:
        edit(metadata, files)
    return Manifest("0123456789abcdef", 2, "single-lora", Topology(world=2, tp=2), files, metadata, format_version=3)


def _slice_file(key: str, rank: int = 0, size: int = 1) -> str:
    return f"optimizer/child0_{key}_s{rank:03d}of{size:03d}.safetensors"


def _slices(key, *bounds):
    def edit(metadata, files):
        n = len(bounds)
        metadata["optimizer_children"]["0"]["layout"]["slices"][key] = [
            {"file": _slice_file(key, r, n), "slice": f"{r}/{n}", "bounds": {"buf0": [b]}} for r, b in enumerate(bounds)
        ]
        for r in range(n):
            files.setdefault(_slice_file(key, r, n), files[_slice_file(key)])

    return edit


def _position(key, name, value):
    def edit(metadata, files):
        metadata["optimizer_children"]["0"]["layout"]["positions"][key][name] = value

    return edit


def _block(key, name, **changes):
    def edit(metadata, files):
        metadata["global_layout"]["params"][key][name].update(changes)

    return edit


def _coordinates_swapped(metadata, files):
    entries = metadata["global_layout"]["adapter_files"]
    entries[DENSE0]["coordinate"], entries[DENSE1]["coordinate"] = C1, C0


LAYOUT_EDITS = {  # name: (edit, the file named, words of the reason)
    "a position past its bucket": (
        _position(C0, "chunk0.A", [0, 0, 20, 24]),
        MANIFEST,
        "the position of chunk0.A is elements [20, 44) of buf0 bucket 0, which holds 40",
    ),
    "a position in a bucket the layout lacks": (
        _position(C1, "chunk0.A", [0, 3, 16, 24]),
        MANIFEST,
        "names buf0 bucket 3, which the bucket layout lacks",
    ),
    "two positions overlapping": (
        _position(C0, "chunk0.A", [0, 0, 8, 24]),
        MANIFEST,
        "chunk0.B and chunk0.A overlap in buf0 bucket 0",
    ),
    "a position of another size than its block": (
        _position(C0, "chunk0.A", [0, 0, 16, 20]),
        MANIFEST,
        "holds 20 elements, its block 24",
    ),
    "a position of no number": (_position(C0, "chunk0.A", [0, 0, -1, 24]), MANIFEST, "not [buffer, bucket"),
    "a block outside its global tensor": (_block(C1, "chunk0.B", offset=[6, 0]), MANIFEST, "exceeds the global shape"),
    "two blocks overlapping": (
        _block(C1, "chunk0.B", offset=[2, 0]),
        MANIFEST,
        "the blocks of B at",
    ),
    "blocks leaving a gap": (
        _block(C1, "chunk0.B", offset=[0, 0]),  # both TP ranks' blocks at rows 0-3: rows 4-7 held by none
        MANIFEST,
        "the blocks of B hold 16 of its 32 elements",
    ),
    "a global shape in one coordinate only": (
        _block(C1, "chunk0.A", global_shape=[4, 7], shape=[4, 7]),
        MANIFEST,
        "A is torch.bfloat16[4, 7] at",
    ),
    "slices leaving a gap": (_slices(C0, [0, 20], [21, 40]), _slice_file(C0, 1, 2), "leave a gap at element 20"),
    "slices overlapping": (_slices(C1, [0, 21], [20, 40]), _slice_file(C1, 1, 2), "leave a overlap at element 20"),
    "slices ending short": (_slices(C0, [0, 39]), MANIFEST, "the slices of buf0 bucket 0 end at 39, not 40"),
    "a slice holding elements, not listed": (
        lambda metadata, files: files.pop(_slice_file(C1)),
        _slice_file(C1),
        "holds elements [0, 40) of buf0 bucket 0, but is not listed",
    ),
    "adapter coordinates swapped": (_coordinates_swapped, DENSE0, "the global layout says coordinate " + C1),
    "an adapter file naming an undescribed parameter": (
        lambda metadata, files: metadata["global_layout"]["adapter_files"][DENSE1]["names"].append("chunk0.C"),
        DENSE1,
        "has no block for chunk0.C",
    ),
}


@pytest.mark.parametrize("name", sorted(LAYOUT_EDITS))
def test_the_layout_rules_refuse_each_edit_naming_the_file(name):
    """`layout_rules.check` (what verify's `check_structure` and so every loader runs; the resharding
    loader plans from `saved_blocks`, its layout part): each structural edit of a v3 layout is
    damage naming the file and the reason."""
    layout_rules.check(_v3_manifest())  # the intact layout passes
    edit, file, words = LAYOUT_EDITS[name]
    with pytest.raises(GenerationDamaged) as refused:
        layout_rules.check(_v3_manifest(edit))
    assert [p.file for p in refused.value.problems] == [file], refused.value
    assert words in refused.value.problems[0].reason, refused.value


def test_an_adapter_file_naming_a_parameter_megatron_could_not_describe_passes():
    """A null block (megatron cannot describe the parameter: a multi-LoRA slot's adapter) is a
    described parameter of no known place, not a missing one: its file passes, and it is never
    resharded. Only a name the layout does not list at all is refused (the edit above)."""

    def undescribed(metadata, files):
        for key in (C0, C1):
            metadata["global_layout"]["params"][key]["chunk0.A"] = None

    layout_rules.check(_v3_manifest(undescribed))


def test_a_file_stamped_with_its_layout_entries_refuses_a_swap_of_tp_offsets():
    """Swapping the TP ranks' offsets keeps every structural rule (the blocks still tile B), but
    no longer matches each file's stamp: the digest of the entries it was written with."""

    def swapped(metadata, files):
        params = metadata["global_layout"]["params"]
        params[C0]["chunk0.B"]["offset"], params[C1]["chunk0.B"]["offset"] = [4, 0], [0, 0]

    written = _v3_manifest()
    forged = _v3_manifest(swapped)
    layout_rules.check(forged)  # structurally sound
    for rel in (DENSE0, DENSE1, "optimizer/child0_tp001_pp000_ep000_etp001_s000of001.safetensors"):
        binding = written.files[rel].binding if rel in written.files else {"role": "optimizer", "child": "0"}
        binding = {**binding, **({"coordinate": C1} if rel.startswith("optimizer/") else {})}
        for manifest in (written, forged):
            manifest.files.setdefault(rel, FileRecord(1, "xxh3_128:" + "0" * 32, binding=binding))
        stamp = layout_rules.stamp(written.metadata, rel, binding)
        assert list(stamp) == [layout_rules.STAMP_KEY]
        layout_rules.check_stamp(rel, written, stamp)  # as written
        layout_rules.check_stamp(rel, forged, {})  # a file written before the stamp: not checked
        with pytest.raises(GenerationDamaged, match="other global layout entries than the manifest records"):
            layout_rules.check_stamp(rel, forged, stamp)
    assert layout_rules.stamp(written.metadata, "training_state.json", {"role": "training-state"}) == {}


def test_an_adapter_file_read_whole_must_hold_its_blocks_tensors():
    """`layout_rules.check_file_tensors` (a content rule: `verify` and every loader): the tensors of
    an adapter file the layout lists, as its header describes them, against their blocks: what the
    resharding loader requires of a file without a block index (read whole)."""
    manifest = _v3_manifest()
    dtypes, shapes = {"chunk0.A": "BF16", "chunk0.B": "BF16"}, {"chunk0.A": [4, 6], "chunk0.B": [4, 4]}
    layout_rules.check_file_tensors(DENSE0, manifest, dtypes, shapes)
    layout_rules.check_file_tensors(DENSE0, manifest, dtypes)  # read in part: no shapes
    layout_rules.check_file_tensors("training_state.json", manifest, {})  # not an adapter file of the layout
    for wrong_dtypes, wrong_shapes, words in (
        (
            {**dtypes, "chunk0.B": "F32"},
            shapes,
            "chunk0.B is torch.float32[4, 4], its global layout block torch.bfloat16[4, 4]",
        ),
        (dtypes, {**shapes, "chunk0.A": [6, 4]}, "chunk0.A is torch.bfloat16[6, 4], its global layout block"),
        ({"chunk0.A": "BF16"}, shapes, "chunk0.B is no such tensor"),
    ):
        with pytest.raises(GenerationDamaged) as refused:
            layout_rules.check_file_tensors(DENSE0, manifest, wrong_dtypes, wrong_shapes)
        assert refused.value.problems[0].file == DENSE0 and words in refused.value.problems[0].reason


def test_a_whole_parameter_childs_file_must_hold_its_blocks_shapes():
    """The same content rule for a Float16 / FP32 or layer-wise child's file (read whole): each
    parameter's tensors of a shape its writer coordinate's block holds, and a master."""
    whole = "optimizer/child1_tp000_pp000_ep000_etp000_dp000_cp000.safetensors"

    def with_whole_child(metadata, files):
        metadata["optimizer_children"]["1"] = {"family": "replicated", "layout": {"entries": {}, "files": {}}}
        binding = {"role": "optimizer", "coordinate": C0 + "_dp000_cp000", "child": "1"}
        files[whole] = FileRecord(1, "xxh3_128:" + "0" * 32, binding=binding)

    manifest = _v3_manifest(with_whole_child)
    layout_rules.check(manifest)
    shapes = {"chunk0.A.param": [4, 6], "chunk0.A.exp_avg": [4, 6], "chunk0.A.step": [], "chunk0.B.param": [4, 4]}
    layout_rules.check_file_tensors(whole, manifest, {}, shapes)
    for wrong, words in (
        ({**shapes, "chunk0.B.param": [8, 4]}, "chunk0.B.param is [8, 4], its global layout block [4, 4]"),
        ({k: v for k, v in shapes.items() if k != "chunk0.A.param"}, "chunk0.A has no master chunk0.A.param"),
    ):
        with pytest.raises(GenerationDamaged) as refused:
            layout_rules.check_file_tensors(whole, manifest, {}, wrong)
        assert refused.value.problems[0].file == whole and words in refused.value.problems[0].reason
