"""A resharding load's copies are vectorised: torch calls per tensor, not per row (no processes).

`core.global_layout.strided_runs` merges the runs of a row-parallel split into one strided group;
`ReshardPlan.adapter_tensors` (the adapter's assembly) and `distributed._strided_groups` (the
optimizer install's pieces) copy each group with one strided view. These tests count the torch
calls of a known layout at two row counts: the same count, and the same bytes as a row-by-row copy.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from miles_lora_ckpt.core.global_layout import Block, Strided, plan_copies, strided_runs, strided_view
from miles_lora_ckpt.core.protocol import WholeFileRanges
from miles_lora_ckpt.megatron.optimizer_children.distributed import _strided_groups
from miles_lora_ckpt.megatron.reshard import AdapterCopy, AdapterPlan, ReshardPlan, _Source


class _Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _row_parallel(rows: int, cols: int, tp: int, rank: int) -> Block:
    width = cols // tp
    return Block("w", (rows, cols), (0, rank * width), (rows, width), "torch.float32")


def test_a_row_parallel_split_is_one_strided_group():
    """TP 1 saved, TP 2 wanted: `rows` runs of half a row, one group; a TP 2 -> TP 1 merge: one per source."""
    whole = Block("w", (64, 32), (0, 0), (64, 32), "torch.float32")
    copies = plan_copies(_row_parallel(64, 32, 2, 1), 0, 64 * 16, [whole])
    assert len(copies) == 64
    assert strided_runs([(c.first, c.into, c.count) for c in copies]) == [Strided(16, 32, 0, 16, 16, 64)]
    halves = [_row_parallel(64, 32, 2, r) for r in range(2)]
    merged = plan_copies(whole, 0, 64 * 32, halves)
    for source in range(2):
        runs = [(c.first, c.into, c.count) for c in merged if c.source == source]
        assert strided_runs(runs) == [Strided(0, 16, source * 16, 32, 16, 64)]


def test_irregular_runs_stay_apart_and_views_are_bounded():
    assert strided_runs([(0, 0, 4), (4, 4, 2), (10, 8, 2), (20, 10, 2)]) == [
        Strided(0, 0, 0, 0, 4, 1),
        Strided(4, 6, 4, 4, 2, 2),
        Strided(20, 0, 10, 0, 2, 1),
    ]
    assert strided_runs([(0, 0, 4), (2, 2, 4)]) == [Strided(0, 0, 0, 0, 4, 1), Strided(2, 0, 2, 0, 4, 1)]
    flat = torch.arange(20.0)
    assert strided_view(flat[2:], 18, 1, 5, 2, 3).tolist() == [[3, 4], [8, 9], [13, 14]]
    with pytest.raises(ValueError, match="outside a tensor of 10 elements"):
        strided_view(flat[:10], 10, 1, 5, 2, 3)  # within the storage, past the tensor


@pytest.mark.parametrize("tp", [2, 4])
def test_the_adapter_is_assembled_with_torch_calls_per_tensor_not_per_row(tp):
    """`adapter_tensors` for a row-parallel split saved at TP 1: the assembled tensor is the wanted
    block, and the torch calls do not grow with the rows (row by row, 64 more rows cost 64+ calls)."""
    calls = {}
    for rows in (64, 128):
        full = torch.randn(rows, 32)
        saved = Block("w", (rows, 32), (0, 0), (rows, 32), "torch.float32")
        wanted = _row_parallel(rows, 32, tp, tp - 1)
        source = _Source("adapter/dense_t0p0.safetensors", "w", saved)
        plan = ReshardPlan()
        copies = plan_copies(wanted, 0, wanted.numel, [saved])
        plan.adapter["w"] = AdapterPlan(wanted, [AdapterCopy(source, c) for c in copies])
        plan.adapter_spans[(source.where, "w")] = (copies[0].first, copies[-1].first + copies[-1].count)

        class _Opened:  # the file read whole (no block index): its ranges cut from its tensors
            manifest = SimpleNamespace(files={source.where: SimpleNamespace(blocks=None)})

            def tensors(self, where, full=full):
                return {"w": full}

            def tensor_ranges(self, where, full=full):
                return WholeFileRanges({"w": full})

        param = torch.empty(rows, 32 // tp)
        with _Count() as count:
            [(_, out)] = plan.adapter_tensors(_Opened(), {"w": param}, lambda *args: None)
        calls[rows] = count.calls
        assert torch.equal(out["w"], full[:, (tp - 1) * 32 // tp :])
    assert calls[64] == calls[128], calls


def test_install_copies_are_grouped_with_one_copy_per_group():
    """`_strided_groups`: `rows` pieces of one destination (half rows) make one (view, values) pair
    whose copy writes exactly those elements; the torch calls do not grow with the rows."""
    calls = {}
    for rows in (64, 128):
        values = torch.randn(rows, 16)
        pieces = [(r * 32 + 16, values[r], 16) for r in range(rows)]
        dest = torch.zeros(rows * 32)
        with _Count() as count:
            groups = _strided_groups(dest, dest.numel(), pieces)
        calls[rows] = count.calls
        assert len(groups) == 1
        for into, source in groups:
            into.copy_(source)
        assert torch.equal(dest.view(rows, 32)[:, 16:], values)
        assert not dest.view(rows, 32)[:, :16].any()
    assert calls[64] == calls[128], calls


def test_the_optimizer_read_plan_asks_one_range_per_row_group_not_per_row():
    """`distributed._row_parts`: a parameter's half rows of one saved piece (a row-parallel split saved at
    TP 1, loaded at TP 2) are one part covering them (one range asked per key), with its rows;
    rows whose gaps would skip a whole block stay parts of their own (nothing more read)."""
    from types import SimpleNamespace

    from miles_lora_ckpt.megatron.optimizer_children.distributed import Piece, _row_parts

    piece = Piece("optimizer/x.safetensors", {}, "buf0.bucket0", "buf0", 0, 1 << 20)
    runs = [(100 + r * 32 + 16, 7 + r * 16, 16) for r in range(64)]  # (first, offset in the shard, count)

    def manifest(block_bytes):
        return SimpleNamespace(files={piece.file: SimpleNamespace(blocks=SimpleNamespace(block_bytes=block_bytes))})

    assert _row_parts(piece, runs, manifest(1 << 16)) == [(piece, 116, 116 + 63 * 32 + 16, 7, (32, 16, 64, 16))]
    apart = _row_parts(piece, runs, manifest(32))  # a gap of 16 fp32 elements = 64 bytes > a block of 32
    assert [(p[1], p[2], p[3], p[4]) for p in apart] == [(f, f + 16, o, None) for f, o, _ in runs]
