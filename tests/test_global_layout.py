"""Pure slicing math of resharding (core.global_layout): no megatron, no processes."""

from __future__ import annotations

import math

import pytest
import torch

from miles_lora_ckpt.core.global_layout import Block, cut_copies, distinct, global_indices, plan_copies


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
