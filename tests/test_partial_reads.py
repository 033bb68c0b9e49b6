"""Verified partial reads: per-block digests written with a file, ranges read and checked block by
block, unread blocks checked round-robin, and the lazy writer (plain processes, no megatron)."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from jobs_paths import TESTS

from miles_lora_ckpt.core import checked_reads, host_memory, partial_reads, read_ahead, safetensors_write
from miles_lora_ckpt.core.child_layouts import DistributedLayout
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import FileRecord, Topology
from miles_lora_ckpt.core.protocol import WholeFileRanges, open_generation, save_generation
from miles_lora_ckpt.core.verify import check_file_ranges
from miles_lora_ckpt.megatron.optimizer_children import distributed as dopt
from miles_lora_ckpt.megatron.optimizer_children.family import ChildDescription
from miles_lora_ckpt_harness.sim.launch import check_all, run_workers


def _write(tmp_path, tensors, block_bytes=256):
    path = tmp_path / "t.safetensors"
    record = safetensors_write.save_tensors(path, tensors, finite=True, blocks=True, block_bytes=block_bytes)
    return path, FileRecord.from_dict(record.to_dict())  # through the manifest's JSON


def _tensors():
    return {"a": torch.arange(300, dtype=torch.float32), "b": torch.arange(200, dtype=torch.bfloat16)}


def test_block_index_round_trips_and_ranges_read_exactly(tmp_path):
    path, record = _write(tmp_path, _tensors())
    assert record.blocks is not None and len(record.blocks.digests) == -(-record.bytes // 256)
    wanted = [("a", 10, 20), ("a", 250, 300), ("b", 0, 7), ("b", 5, 5)]
    got, metadata = partial_reads.read_ranges(path, record, wanted)
    for name, first, stop in wanted:
        assert torch.equal(got[(name, first, stop)], _tensors()[name][first:stop])
    # a whole read checks every block digest too
    assert checked_reads.check_file(path, record).entries is not None


def test_a_flipped_byte_is_caught_exactly_where_it_is_read(tmp_path):
    path, record = _write(tmp_path, _tensors())
    begin = record.blocks.tensors["a"][1]
    flip = begin + 280 * 4  # inside a[280], a block that a read of a[10:20] does not touch
    data = bytearray(path.read_bytes())
    data[flip] ^= 0x01
    path.write_bytes(bytes(data))
    far = flip // 256
    near = partial_reads.blocks_needed(record.blocks, [("a", 10, 20)])
    assert far not in near
    partial_reads.read_ranges(path, record, [("a", 10, 20)])  # untouched bytes: fine (others verify the rest)
    with pytest.raises(ValueError, match=f"block {far} .*digest mismatch"):
        partial_reads.read_ranges(path, record, [("a", 279, 281)])
    with pytest.raises(ValueError, match=f"block {far} .*digest mismatch"):
        partial_reads.check_blocks(path, record, [far])
    with pytest.raises(ValueError, match="digest mismatch"):
        checked_reads.check_file(path, record)


def test_header_and_block_index_must_agree(tmp_path):
    path, record = _write(tmp_path, _tensors())
    forged = FileRecord.from_dict(
        {**record.to_dict(), "blocks": {**record.blocks.to_dict(), "tensors": {"a": ["F32", 100, 1300]}}}
    )
    with pytest.raises(ValueError, match="disagree"):
        partial_reads.read_ranges(path, forged, [("a", 0, 1)])
    with pytest.raises(ValueError, match="elements"):
        partial_reads.read_ranges(path, record, [("a", 0, 301)])
    with pytest.raises(ValueError, match="not in the file"):
        partial_reads.read_ranges(path, record, [("c", 0, 1)])
    with pytest.raises(ValueError, match="digests: expected"):
        FileRecord.from_dict({**record.to_dict(), "blocks": {**record.blocks.to_dict(), "digests": []}})


def test_nan_in_a_read_range_is_refused(tmp_path):
    tensors = _tensors()
    tensors["a"][150] = float("nan")
    path = tmp_path / "nan.safetensors"
    record = safetensors_write.save_tensors(path, tensors, blocks=True, block_bytes=256)  # finite not checked on write
    partial_reads.read_ranges(path, record, [("a", 0, 100)])
    with pytest.raises(ValueError, match="NaN"):
        partial_reads.read_ranges(path, record, [("a", 140, 160)])
    with pytest.raises(ValueError, match="NaN"):
        partial_reads.check_blocks(path, record, partial_reads.blocks_needed(record.blocks, [("a", 150, 151)]))


def test_touching_ranges_stay_apart_and_each_block_is_read_once(tmp_path, monkeypatch):
    """`verify.coalesce_ranges` merges only overlapping ranges of one tensor: ranges that touch, or
    share a block, stay apart, each its own buffer (a resharding load's moment range can then become
    the state as it is, `distributed.replace_state`), and the block they share is still read and
    hashed once (`partial_reads._BlockFile` keeps the last block). Each range is exactly its elements."""
    from miles_lora_ckpt.core.verify import coalesce_ranges

    assert coalesce_ranges([("a", 20, 40), ("a", 10, 30), ("b", 0, 5)]) == [("a", 10, 40), ("b", 0, 5)]
    assert coalesce_ranges([("a", 30, 50), ("a", 10, 30)]) == [("a", 10, 30), ("a", 30, 50)]
    assert coalesce_ranges([("a", 5, 5), ("a", 5, 9)]) == [("a", 5, 5), ("a", 5, 9)]

    path, record = _write(tmp_path, _tensors())  # a: 300 fp32, 64 elements per 256-byte block
    a0 = record.blocks.tensors["a"][1]
    cut = next(e for e in range(1, 300) if (a0 + e * 4) % 256 == 128)  # mid-block: both ranges need it
    asked = [("a", 0, cut), ("a", cut, 300)]
    reads = []
    real = partial_reads.os.preadv

    def counted(fd, buffers, offset):
        reads.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(partial_reads.os, "preadv", counted)
    got, _ = partial_reads.read_ranges(path, record, coalesce_ranges(asked))
    a_end = record.blocks.tensors["a"][2]
    assert sorted(reads) == list(range(0, a_end, 256))  # every block of "a" once, none twice
    for name, first, stop in asked:
        tensor = got[(name, first, stop)]
        assert torch.equal(tensor, _tensors()[name][first:stop])
        assert tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == (stop - first) * 4


def test_the_writer_pulls_lazy_tensors_one_at_a_time(tmp_path):
    """A file of lazily produced tensors never holds more than one of them: each is produced when
    its bytes are due, and released before the next one is produced."""
    alive: list[weakref.ref] = []
    order = []

    def producer(name, n):
        def produce():
            assert all(ref() is None for ref in alive), f"{name}: an earlier tensor is still in memory"
            order.append(name)
            tensor = torch.full((n,), float(len(order)))
            alive.append(weakref.ref(tensor))
            return tensor

        return produce

    names = ["x0", "x1", "x2", "x3"]
    lazy = {name: safetensors_write.LazyTensor(torch.float32, (1000,), producer(name, 1000)) for name in names}
    assert order == []  # nothing produced before writing
    record = safetensors_write.save_tensors(tmp_path / "lazy.safetensors", lazy, finite=True, blocks=True)
    assert order == names  # in file order, each once
    loaded, _ = checked_reads.load_tensors(tmp_path / "lazy.safetensors", record)
    assert [loaded[n][0].item() for n in names] == [1.0, 2.0, 3.0, 4.0]
    wrong = {"y": safetensors_write.LazyTensor(torch.float32, (3,), lambda: torch.zeros(4))}
    with pytest.raises(ValueError, match="announced"):
        safetensors_write.save_tensors(tmp_path / "wrong.safetensors", wrong)


# ------------------------------------------------------------------ slice bounds (pure, no megatron)

CURRENT = {"buf0": [10, 6]}


def _plan_json(bounds_per_rank) -> dict:
    """The manifest's JSON of a child's layout at coordinate "k", one slice per rank's bounds."""
    n = len(bounds_per_rank)
    return {
        "numel_unpadded": {"k": CURRENT},
        "slices": {
            "k": [
                {"file": dopt.slice_file_name(3, "k", r, n), "slice": f"{r}/{n}", "bounds": {"buf0": b}}
                for r, b in enumerate(bounds_per_rank)
            ]
        },
    }


def _plan(bounds_per_rank) -> DistributedLayout:
    return DistributedLayout.parse(_plan_json(bounds_per_rank), 3)


def test_slice_bounds_of_the_plan_tile_every_bucket():
    padded, unpadded = {"buf0": [12, 8]}, CURRENT
    bounds = [dopt.slice_bounds(padded, unpadded, r, 4) for r in range(4)]
    assert bounds == [
        {"buf0": [[0, 3], [0, 2]]},
        {"buf0": [[3, 6], [2, 4]]},
        {"buf0": [[6, 9], [4, 6]]},
        {"buf0": [[9, 10], [6, 6]]},
    ]
    pieces = dopt.saved_pieces(3, _plan([b["buf0"] for b in bounds]), "k", CURRENT)
    # buffer coordinates: bucket 1 starts after bucket 0's 10 elements; empty slices hold no piece
    assert [(p.prefix, p.begin, p.end) for p in pieces] == [
        ("buf0.bucket0", 0, 3),
        ("buf0.bucket1", 10, 12),
        ("buf0.bucket0", 3, 6),
        ("buf0.bucket1", 12, 14),
        ("buf0.bucket0", 6, 9),
        ("buf0.bucket1", 14, 16),
        ("buf0.bucket0", 9, 10),
    ]
    # a rank at DP=2 reads element ranges of the DP=4 slices that overlap its shard
    held = dopt.DistributedHeld((), 1, 2, 0, unpadded, padded, {})
    reads = [(pos, p.file[-22:], first, stop, offset) for pos, p, first, stop, offset in dopt.reads_for(pieces, held)]
    assert reads == [
        (0, "_k_s002of004.safetensors"[-22:], 0, 3, 0),
        (0, "_k_s003of004.safetensors"[-22:], 0, 1, 3),
        (1, "_k_s002of004.safetensors"[-22:], 0, 2, 0),
    ]


def test_the_family_keeps_every_range_it_reads_at_any_layout():
    """`DistributedFamily.files_to_read`: one `PartialRead` per saved slice file, every key's ranges
    (masters and moments) kept from open (each block read and verified once per load; the install
    copies the masters and makes the moments of those verified buffers), at a same layout (its own
    whole slice) and when saved at DP=4 and loaded at DP=2 (parts of two slices)."""
    from types import SimpleNamespace

    padded, unpadded = {"buf0": [12, 8]}, CURRENT

    def asked(saved_dp, dp_size, dp_rank):
        plan = _plan([dopt.slice_bounds(padded, unpadded, r, saved_dp)["buf0"] for r in range(saved_dp)])
        held = dopt.DistributedHeld((), dp_rank, dp_size, 0, unpadded, padded, {})
        desc = ChildDescription(3, "distributed", "DistributedOptimizer", "adam", ("exp_avg",), True, False, held)
        view = SimpleNamespace(rank=dp_rank, ranks=[SimpleNamespace(model_parallel_key="k")] * dp_size)
        described = [desc if r == dp_rank else None for r in range(dp_size)]
        return dopt.FAMILY.files_to_read(3, view, described, plan)

    [same] = asked(2, 2, 1)
    assert same.relpath == dopt.slice_file_name(3, "k", 1, 2) and same.keep
    assert {name for name, _, _ in same.ranges} == {f"buf0.bucket{b}.{k}" for b in (0, 1) for k in ("param", "exp_avg")}
    resharding = asked(4, 2, 0)
    assert len(resharding) == 2 and all(r.keep for r in resharding)


@pytest.mark.parametrize(
    "bounds, words",
    [
        ([[[0, 6], [0, 3]], [[5, 10], [3, 6]]], "overlap at element 5"),
        ([[[0, 4], [0, 3]], [[5, 10], [3, 6]]], "gap at element 4"),
        ([[[0, 5], [0, 3]], [[5, 9], [3, 6]]], "end at 9, not 10"),
        ([[[0, 5], [0, 3]], [[5, 11], [3, 6]]], "out of [0, 10]"),
        ([[[0, 5]], [[5, 10], [3, 6]]], "one [lo, hi] per bucket"),
    ],
)
def test_overlapping_or_gapped_slice_bounds_are_refused(bounds, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        dopt.saved_pieces(3, _plan(bounds), "k", CURRENT)


def test_a_slice_listed_under_another_name_or_a_changed_bucket_layout_is_refused():
    from miles_lora_ckpt.core.errors import IncompatibleCheckpoint

    plan = _plan_json([[[0, 5], [0, 3]], [[5, 10], [3, 6]]])
    plan["slices"]["k"][1]["file"] = "training_state.json"
    with pytest.raises(ValueError, match="slice 1 of 2"):
        dopt.saved_pieces(3, DistributedLayout.parse(plan, 3), "k", CURRENT)
    with pytest.raises(IncompatibleCheckpoint, match="bucket layout differs"):
        dopt.saved_pieces(3, _plan([[[0, 5], [0, 3]], [[5, 10], [3, 6]]]), "k", {"buf0": [10, 7]})


def test_a_bucket_layout_missing_from_the_plan_names_the_missing_key():
    from miles_lora_ckpt.core.errors import GenerationDamaged, IncompatibleCheckpoint

    plan = _plan_json([[[0, 5], [0, 3]], [[5, 10], [3, 6]]])
    plan["numel_unpadded"] = {"other": CURRENT}  # this run's coordinate "k" is not in the checkpoint
    with pytest.raises(IncompatibleCheckpoint) as refused:
        dopt.saved_pieces(3, DistributedLayout.parse(plan, 3), "k", CURRENT)
    assert "missing key 'k' in 'numel_unpadded'" in str(refused.value) and "['other']" in str(refused.value)
    assert "None" not in str(refused.value)
    del plan["numel_unpadded"]  # the layout's record refuses it as it is read: damage naming the manifest
    with pytest.raises(GenerationDamaged, match=r"has no bucket layout \('numel_unpadded'\)") as damaged:
        DistributedLayout.parse(plan, 3)
    assert [p.file for p in damaged.value.problems] == ["manifest.json"] and "None" not in str(damaged.value)


def test_a_layout_of_another_shape_is_damage_naming_the_manifest():
    """`DistributedLayout.parse`: every value of the kind its field holds, else GenerationDamaged
    naming the manifest; what it makes gives back the JSON it was made of (`to_json`)."""
    from miles_lora_ckpt.core.errors import GenerationDamaged

    good = _plan_json([[[0, 5], [0, 3]], [[5, 10], [3, 6]]])
    assert DistributedLayout.parse(good, 3).to_json() == good
    edits = {
        "slices not a list": lambda p: p["slices"].update(k={"file": "x"}),
        "a slice without its file": lambda p: p["slices"]["k"][0].pop("file"),
        "bounds of three numbers": lambda p: p["slices"]["k"][0]["bounds"].update(buf0=[[0, 5, 1], [0, 3]]),
        "a negative bucket size": lambda p: p["numel_unpadded"].update(k={"buf0": [-1, 6]}),
        "a position of three numbers": lambda p: p.update(positions={"k": {"chunk0.a": [0, 0, 4]}}),
    }
    for name, edit in edits.items():
        plan = _plan_json([[[0, 5], [0, 3]], [[5, 10], [3, 6]]])
        edit(plan)
        with pytest.raises(GenerationDamaged) as refused:
            DistributedLayout.parse(plan, 3)
        assert [p.file for p in refused.value.problems] == ["manifest.json"], name
        assert "optimizer child 3" in refused.value.problems[0].reason, name


# --------------------------------------------------------------------------- partial reads

SLICED = "optimizer/sliced.safetensors"


BLOCK = 256  # bytes: small blocks, so that every rank reads a different part of the file


def sliced_tensors() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(512, dtype=torch.float32), "b": torch.arange(512, dtype=torch.float32) * 2}


def partial_reads_job(payload: dict, ctx) -> dict:
    """Save one file with a block index (and one plain file); then, per case, damage a byte (on
    rank 0, between barriers) and load with each rank asking a different element range of it.
    Cases: `{"name": {"flip": byte offset or None, "ranges": [[name, first, stop] per rank]}}`."""
    import torch.distributed as dist

    from miles_lora_ckpt.core import safetensors_write
    from miles_lora_ckpt.core.protocol import PartialRead

    consensus = Consensus.for_world(timeout_s=60)
    root = Path(payload["root"])
    real_block = safetensors_write.BLOCK_BYTES
    safetensors_write.BLOCK_BYTES = BLOCK
    try:

        def write(writer):
            if consensus.rank == 0:
                writer.write_tensors(SLICED, sliced_tensors(), blocks=True)

        topo = Topology(world=consensus.world_size, dp=consensus.world_size)
        gen = save_generation(consensus, root, iteration=1, saver="test", topology=topo, write_files=write)
    finally:
        safetensors_write.BLOCK_BYTES = real_block
    out = {}
    original = (gen / SLICED).read_bytes()
    for name, case in payload["cases"].items():
        dist.barrier()
        if ctx.rank == 0:
            data = bytearray(original)
            if case["flip"] is not None:
                data[case["flip"]] ^= 0x01
            (gen / SLICED).write_bytes(bytes(data))
        dist.barrier()
        mine = tuple(tuple(r) for r in case["ranges"][ctx.rank])
        keep = case.get("keep", True)
        try:
            opened = open_generation(
                consensus, gen, lambda m, mine=mine, keep=keep: [PartialRead(SLICED, mine, keep=keep)] if mine else []
            )
        except CheckpointError as exc:
            out[name] = {"error": str(exc)}
            continue
        ranges = opened.tensor_ranges(SLICED) if mine else {}
        if case.get("flip_after_open") is not None:  # the file changes between open and install
            dist.barrier()
            if ctx.rank == 0:
                data = bytearray(original)
                data[case["flip_after_open"]] ^= 0x01
                (gen / SLICED).write_bytes(bytes(data))
            dist.barrier()
        want = sliced_tensors()
        try:
            got = {item: ranges.get(item) for item in mine}
            exact = all(torch.equal(t, want[k[0]][k[1] : k[2]]) for k, t in got.items())
            out[name] = {
                "error": None,
                "exact": exact,
                "got": len(got),
                "kept": isinstance(ranges, dict),
                "late_error": None,
            }
        except ValueError as exc:  # a deferred range read again: verified again
            out[name] = {"error": None, "late_error": str(exc), "kept": isinstance(ranges, dict)}
    record = json_manifest(gen)["files"][SLICED]
    return {"cases": out, "record": record}


def json_manifest(gen: Path) -> dict:
    import json

    return json.loads((gen / "manifest.json").read_text())


# ------------------------------------------------------------------ across processes


@pytest.mark.multirank
def test_partial_reads_across_ranks_verify_every_byte_somewhere(tmp_path):
    """Two ranks each read a different range of one file with 256-byte blocks; the blocks nobody
    reads are verified round-robin. A flipped byte fails the load on every rank wherever it is:
    in a block one rank reads and the other does not, or in a block no rank reads."""

    a_begin = None  # the data of tensor "a" starts after the header: found from the record below
    probe = check_all(
        run_workers(
            2,
            "test_partial_reads:partial_reads_job",
            {"root": str(tmp_path / "probe"), "cases": {}},
            sys_path=[TESTS],
            megatron=False,
        )
    )
    a_begin = probe[0]["record"]["blocks"]["tensors"]["a"][1]
    ranges = [[["a", 0, 10]], [["b", 100, 110]]]  # rank 0 reads a[0:10], rank 1 b[100:110]
    in_rank1_block = probe[0]["record"]["blocks"]["tensors"]["b"][1] + 105 * 4  # b[105]: only rank 1 reads it
    nobody = a_begin + 300 * 4  # a[300]: nobody asked for it
    cases = {
        "intact": {"flip": None, "ranges": ranges},
        "flip read by rank 1 only": {"flip": in_rank1_block, "ranges": ranges},
        "flip read by nobody": {"flip": nobody, "ranges": ranges},
        "flip read by nobody, rank 1 asks nothing": {"flip": nobody, "ranges": [ranges[0], []]},
        # keep=False: verified at open, not kept, read and verified again when asked for
        "deferred intact": {"flip": None, "ranges": ranges, "keep": False},
        "deferred, flipped after open": {
            "flip": None,
            "ranges": ranges,
            "keep": False,
            "flip_after_open": in_rank1_block,
        },
        "kept, flipped after open": {"flip": None, "ranges": ranges, "flip_after_open": in_rank1_block},
    }
    results = check_all(
        run_workers(
            2,
            "test_partial_reads:partial_reads_job",
            {"root": str(tmp_path / "root"), "cases": cases},
            sys_path=[TESTS],
            megatron=False,
        )
    )
    for r in results:
        assert r["cases"]["intact"] == {"error": None, "exact": True, "got": 1, "kept": True, "late_error": None}
        assert r["cases"]["deferred intact"] == {
            "error": None,
            "exact": True,
            "got": 1,
            "kept": False,
            "late_error": None,
        }
        # kept ranges are the bytes verified at open: a later change of the file cannot reach them
        assert r["cases"]["kept, flipped after open"]["exact"] is True
    # deferred ranges are verified again when read: the change is caught where it is read (rank 1)
    late = [r["cases"]["deferred, flipped after open"] for r in results]
    assert late[0]["late_error"] is None and late[0]["exact"] is True, late[0]
    block = cases["deferred, flipped after open"]["flip_after_open"] // BLOCK
    assert f"block {block} " in late[1]["late_error"] and "digest mismatch" in late[1]["late_error"], late[1]
    for name in ("flip read by rank 1 only", "flip read by nobody", "flip read by nobody, rank 1 asks nothing"):
        errors = [r["cases"][name]["error"] for r in results]
        assert errors[0] and errors[0] == errors[1], (name, errors)  # the same error on every rank
        block = cases[name]["flip"] // BLOCK
        assert f"sliced.safetensors: block {block} " in errors[0] and "digest mismatch" in errors[0], errors[0]


def test_read_ahead_of_a_large_kept_file_checks_every_byte(tmp_path):
    """A kept read of a file larger than one read-ahead chunk overlaps reading with hashing and
    checking; the same digest, header and finiteness rules hold for every byte."""
    tensors = {"big": torch.arange(3 * 2**20, dtype=torch.float32), "small": torch.ones(5)}  # 12 MiB
    path = tmp_path / "big.safetensors"
    record = safetensors_write.save_tensors(path, tensors, finite=True)
    assert record.bytes > 2 * read_ahead.READ_AHEAD_CHUNK
    loaded, _ = checked_reads.load_tensors(path, record)
    assert torch.equal(loaded["big"], tensors["big"]) and torch.equal(loaded["small"], tensors["small"])
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # in the last chunk
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="digest mismatch"):
        checked_reads.load_tensors(path, record)
    tensors["big"][-1] = float("inf")
    record = safetensors_write.save_tensors(path, tensors)
    with pytest.raises(ValueError, match="NaN or Inf"):
        checked_reads.load_tensors(path, record)


# ------------------------------------------------------------------ reads of a same-layout load (speed3)


def test_whole_blocks_are_read_straight_into_the_range_and_verified_there(tmp_path, monkeypatch):
    """`read_ranges` reads every block lying wholly inside a range straight into the range's own
    buffer (one copy of each byte, the kernel's) and checks its digest there; only the cut blocks
    at a range's ends pass through the reader's block buffer. A flipped byte in a block read in
    place fails the read like any other."""
    path, record = _write(tmp_path, _tensors())
    begin = record.blocks.tensors["a"][1]
    first = -(-begin // 256) * 256  # the first block wholly inside tensor "a"
    wanted = ("a", 0, 300)
    seen = []
    real = partial_reads._BlockFile.block
    monkeypatch.setattr(
        partial_reads._BlockFile, "block", lambda self, i, *into: seen.append((i, bool(into))) or real(self, i, *into)
    )
    got, _ = partial_reads.read_ranges(path, record, [wanted])
    assert torch.equal(got[wanted], _tensors()["a"])
    whole = set(range(first // 256, (begin + 1200) // 256))
    assert whole and {i for i, into in seen if into} == whole
    assert all(not into for i, into in seen if i not in whole)
    data = bytearray(path.read_bytes())
    data[first + 3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"block {first // 256} .*digest mismatch"):
        partial_reads.read_ranges(path, record, [wanted])


def test_check_only_ranges_are_verified_in_the_same_pass_and_not_returned(tmp_path):
    """`read_ranges(check_only=...)`: those ranges are read, digest- and finiteness-checked in the
    same pass (one open, one header parse) and not returned; a flipped byte or a NaN in them fails
    the read as in a kept range."""
    tensors = _tensors()
    path, record = _write(tmp_path, tensors)
    got, _ = partial_reads.read_ranges(path, record, [("b", 0, 7)], check_only=[("a", 0, 300), ("a", 10, 20)])
    assert list(got) == [("b", 0, 7)] and torch.equal(got[("b", 0, 7)], tensors["b"][:7])
    data = bytearray(path.read_bytes())
    data[record.blocks.tensors["a"][1] + 4 * 150 + 1] ^= 0x01
    path.write_bytes(bytes(data))
    partial_reads.read_ranges(path, record, [("b", 0, 7)])  # the flip is not in what this reads
    with pytest.raises(ValueError, match="digest mismatch"):
        partial_reads.read_ranges(path, record, [("b", 0, 7)], check_only=[("a", 100, 200)])
    nan = dict(tensors, a=tensors["a"].clone())
    nan["a"][150] = float("nan")
    path = tmp_path / "nan.safetensors"
    record = FileRecord.from_dict(
        safetensors_write.save_tensors(path, nan, finite=False, blocks=True, block_bytes=256).to_dict()
    )
    with pytest.raises(ValueError, match="'a' holds NaN or Inf"):
        partial_reads.read_ranges(path, record, [], check_only=[("a", 100, 200)])


def test_check_only_ranges_pass_through_one_block_of_memory_however_long(tmp_path, monkeypatch):
    """A range verified and not kept goes through a buffer of one block, a block at a time (a
    relaunch's moments at open: what the load holds must not grow with them), every block of it
    still digest-checked and every element finiteness-checked, in its last block too."""
    sizes = []
    real = host_memory.large_buffer
    monkeypatch.setattr(partial_reads, "large_buffer", lambda n: sizes.append(n) or real(n))
    tensors = {"a": torch.arange(3000, dtype=torch.float32), "b": torch.arange(200, dtype=torch.bfloat16)}
    path, record = _write(tmp_path, tensors)
    got, _ = partial_reads.read_ranges(path, record, [("b", 0, 7)], check_only=[("a", 0, 3000), ("a", 5, 2999)])
    assert list(got) == [("b", 0, 7)] and max(sizes) <= 256, sizes  # the block, the scratch: one block each
    nan = dict(tensors, a=tensors["a"].clone())
    nan["a"][2999] = float("inf")  # the last element, in the range's last (cut) block
    path = tmp_path / "inf.safetensors"
    record = FileRecord.from_dict(
        safetensors_write.save_tensors(path, nan, finite=False, blocks=True, block_bytes=256).to_dict()
    )
    with pytest.raises(ValueError, match="'a' holds NaN or Inf"):
        partial_reads.read_ranges(path, record, [], check_only=[("a", 1, 3000)])
    data = bytearray((tmp_path / "t.safetensors").read_bytes())
    data[record.blocks.tensors["a"][1] + 4 * 2500 + 1] ^= 0x01
    (tmp_path / "t.safetensors").write_bytes(bytes(data))
    record = FileRecord.from_dict(
        safetensors_write.save_tensors(
            tmp_path / "u.safetensors", tensors, finite=True, blocks=True, block_bytes=256
        ).to_dict()
    )
    (tmp_path / "u.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="digest mismatch"):
        partial_reads.read_ranges(tmp_path / "u.safetensors", record, [], check_only=[("a", 0, 3000)])


def test_a_file_read_in_part_keeps_the_ranges_asked_kept_and_reads_the_others_again(tmp_path, monkeypatch):
    """One file with both kinds of `PartialRead` (a same-layout load: masters kept, moments not):
    one verified pass at open; the kept ranges are served from memory (a later change of the file
    cannot reach them) and dropped when the caller says; the others are read again, verified
    again, when asked for."""
    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt.core.layout import Topology
    from miles_lora_ckpt.core.protocol import DeferredRanges, PartialRead, open_generation, save_generation

    tensors = _tensors()
    monkeypatch.setattr(safetensors_write, "BLOCK_BYTES", 256)
    spec = {"iteration": 1, "saver": "test", "topology": Topology()}
    write = lambda writer: writer.write_tensors("t.safetensors", tensors, blocks=True)  # noqa: E731
    gen = save_generation(Consensus.single_process(), tmp_path / "root", write_files=write, **spec)
    monkeypatch.undo()
    kept, later = ("a", 0, 300), ("b", 0, 200)
    reads = []
    real = partial_reads.read_ranges

    def counted(path, record, wanted, **kwargs):
        reads.append((sorted(wanted), sorted(kwargs.get("check_only", ()))))
        return real(path, record, wanted, **kwargs)

    monkeypatch.setattr(partial_reads, "read_ranges", counted)
    opened = open_generation(
        Consensus.single_process(),
        gen,
        lambda m: [PartialRead("t.safetensors", (kept,)), PartialRead("t.safetensors", (later,), keep=False)],
    )
    assert reads == [([kept], [later])]  # one pass: the kept range returned, the other checked
    ranges = opened.tensor_ranges("t.safetensors")
    assert isinstance(ranges, DeferredRanges) and list(ranges.kept) == [kept]
    data = bytearray((gen / "t.safetensors").read_bytes())
    data[-3] ^= 0x01  # in "b", the last tensor
    (gen / "t.safetensors").write_bytes(bytes(data))
    assert torch.equal(ranges.get(kept), tensors["a"]) and len(reads) == 1  # from memory, no read
    with pytest.raises(ValueError, match="digest mismatch"):
        ranges.get(later)  # read again, verified again
    with pytest.raises(ValueError, match="digest mismatch"):
        ranges.get(later, transient=True)  # into the reused buffer: verified all the same
    ranges.drop(kept)
    assert not ranges.kept
    (gen / "t.safetensors").write_bytes(bytes(data[:-3] + bytes([data[-3] ^ 0x01]) + data[-2:]))
    one, two = ranges.get(("b", 0, 100), transient=True), ranges.get(("b", 100, 200), transient=True)
    assert one.data_ptr() == two.data_ptr()  # one buffer, reused read after read
    assert torch.equal(two, tensors["b"][100:200])
    assert ranges.get(later).data_ptr() != two.data_ptr()  # a plain get: a fresh buffer
    ranges.release()


def test_unread_blocks_are_the_blocks_no_plan_touches_however_many_ranges():
    """`protocol._unread_blocks` marks blocks range by range (`partial_reads.mark_blocks`, no sort or
    merge of a resharding load's thousands of rows): the same blocks as `partial_reads.blocks_needed`
    of the merged ranges, the header's included, empty ranges touching nothing; a range the file
    does not hold raises as `byte_range` does."""
    import random

    from miles_lora_ckpt.core.layout import BlockIndex
    from miles_lora_ckpt.core.protocol import _unread_blocks
    from miles_lora_ckpt.core.verify import coalesce_ranges

    index = BlockIndex(64, tuple("0" * 32 for _ in range(40)), {"a": ("F32", 100, 900), "b": ("BF16", 900, 2560)})
    rng = random.Random(7)
    for _ in range(200):
        plans = []
        for _ in range(rng.randint(1, 3)):
            items = []
            for _ in range(rng.randint(0, 12)):
                name, count = rng.choice([("a", 200), ("b", 830)])
                first = rng.randint(0, count)
                items.append([name, first, rng.randint(first, min(count, first + rng.choice([0, 1, 5, 40, 300])))])
            plans.append({"ranges": {"f": items} if items or rng.random() < 0.5 else {}})
        read = set()
        for plan in plans:
            if "f" in plan["ranges"]:
                read |= partial_reads.blocks_needed(index, coalesce_ranges(tuple(i) for i in plan["ranges"]["f"]))
        expected = [i for i in range(40) if i not in read]
        assert _unread_blocks(index, "f", plans) == expected, plans
    for bad in (["c", 0, 1], ["a", 0, 201], ["a", 5, 4]):
        with pytest.raises(ValueError, match="not in the file|out of its"):
            _unread_blocks(index, "f", [{"ranges": {"f": [bad]}}])


def test_a_partial_read_of_every_block_checks_the_whole_file_digest_as_verify_does(tmp_path, capsys):
    """Block digests that match the bytes under a file digest that does not: `verify` (a whole
    read) refuses it; so does a load whose ranges cover every block (a same-layout
    DistributedOptimizer load reads its whole slice file so), for the same reason, reading nothing more."""
    import json

    from damage import edit_manifest

    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt.core.errors import CheckpointError
    from miles_lora_ckpt.core.layout import MANIFEST, Topology
    from miles_lora_ckpt.core.protocol import PartialRead, open_generation, save_generation
    from miles_lora_ckpt.tools.cli import main as cli

    rel, numel = "slice.safetensors", 3 * safetensors_write.BLOCK_BYTES // 4 // 2  # 1.5 blocks each
    tensors = {"param": torch.arange(numel, dtype=torch.float32), "exp_avg": torch.ones(numel)}
    write = lambda writer: writer.write_tensors(rel, tensors, blocks=True)  # noqa: E731
    gen = save_generation(
        Consensus.single_process(), tmp_path / "root", iteration=1, saver="test", topology=Topology(), write_files=write
    )
    assert len(json.loads((gen / MANIFEST).read_text())["files"][rel]["blocks"]["digests"]) > 2
    every = PartialRead(rel, [("param", 0, numel), ("exp_avg", 0, numel)])
    read_all = lambda manifest: [every]  # noqa: E731
    assert torch.equal(
        open_generation(Consensus.single_process(), gen, read_all).tensor_ranges(rel).get(("param", 0, numel)),
        tensors["param"],
    )
    edit_manifest(gen, lambda body: body["files"][rel].update(digest="xxh3_128:" + "0" * 32))
    capsys.readouterr()
    assert cli(["verify", str(gen)]) == 1
    out = capsys.readouterr().out
    assert f"ERROR {rel}: digest mismatch (content changed or corrupted)" in out, out
    with pytest.raises(CheckpointError) as info:
        open_generation(Consensus.single_process(), gen, read_all)
    assert f"{rel}: digest mismatch (content changed or corrupted)" in str(info.value), str(info.value)


def _bucket_child(sizes: list[int], stepped: bool):
    """The attributes of a DistributedOptimizer child `replace_state` reads (one grad buffer, one
    bucket, parameters of `sizes` elements back to back in this rank's shard), with fp32 masters and
    an `exp_avg` per parameter (stepped: values to keep; else zeros just allocated)."""
    from types import SimpleNamespace

    params = [torch.zeros(n) for n in sizes]
    masters = [torch.zeros(n) for n in sizes]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    param_map = {
        p: {"gbuf_local": SimpleNamespace(start=a, end=a + n)} for p, a, n in zip(params, starts, sizes, strict=True)
    }
    state = {
        m: {"exp_avg": torch.full((n,), 7.0) if stepped else torch.zeros(n)}
        for m, n in zip(masters, sizes, strict=True)
    }
    inner = SimpleNamespace(param_groups=[{"params": masters}], state=state)
    child = SimpleNamespace(
        gbuf_ranges=[{(torch.bfloat16, torch.float32): [{"param_map": param_map}]}],
        model_param_group_index_map={p: (0, i) for i, p in enumerate(params)},
        optimizer=inner,
    )
    return child, masters, dopt.BucketLayout(0, 0, sum(sizes), sum(sizes))


def test_replace_state_adopts_verified_buffers_and_never_writes_the_old_tensors():
    """A DistributedOptimizer install's moments (`replace_state`): a parameter inside one part gets a
    view of it (the verified bytes become the state: no copy); a parameter cut across two parts gets
    a new tensor with the parts copied in; either way the tensor the optimizer held stays as it was
    (the undo record keeps it, not a copy), unless this load allocated it (then it is written)."""
    child, masters, layout = _bucket_child([4, 6], stepped=True)
    old = [child.optimizer.state[m]["exp_avg"] for m in masters]
    values = torch.arange(10, dtype=torch.float32)
    dopt.replace_state(child, "exp_avg", layout, [(0, values, 10, None)])
    for master, before, (a, b) in zip(masters, old, [(0, 4), (4, 10)], strict=True):
        now = child.optimizer.state[master]["exp_avg"]
        assert torch.equal(now, values[a:b]) and now.data_ptr() == values[a:].data_ptr()  # a view
        assert now is not before and torch.equal(before, torch.full_like(before, 7.0))  # untouched
    # the second parameter cut across two parts: a new tensor, copied and read back
    child, masters, layout = _bucket_child([4, 6], stepped=True)
    old = [child.optimizer.state[m]["exp_avg"] for m in masters]
    dopt.replace_state(child, "exp_avg", layout, [(0, values[:7], 7, None), (7, values[7:], 3, None)])
    second = child.optimizer.state[masters[1]]["exp_avg"]
    assert torch.equal(second, values[4:]) and second is not old[1]
    assert not (values.data_ptr() <= second.data_ptr() < values.data_ptr() + 40)  # its own memory
    assert torch.equal(old[1], torch.full((6,), 7.0))
    # the first lies inside `values[:7]`, but that part is cut from a larger buffer: copied, for a
    # view would keep all of `values` alive with the state
    first = child.optimizer.state[masters[0]]["exp_avg"]
    assert torch.equal(first, values[:4]) and first is not old[0]
    assert not (values.data_ptr() <= first.data_ptr() < values.data_ptr() + 40)
    # the same cut into a tensor this load allocated: written in place, no second tensor
    child, masters, layout = _bucket_child([4, 6], stepped=False)
    allocated = child.optimizer.state[masters[1]]["exp_avg"]
    dopt.replace_state(
        child,
        "exp_avg",
        layout,
        [(0, values[:7], 7, None), (7, values[7:], 3, None)],
        frozenset({(id(masters[1]), "exp_avg")}),
    )
    assert child.optimizer.state[masters[1]]["exp_avg"] is allocated and torch.equal(allocated, values[4:])
    # a state tensor of another size than its shard is refused before anything is replaced
    child, masters, layout = _bucket_child([4, 6], stepped=True)
    child.optimizer.state[masters[1]]["exp_avg"] = torch.zeros(5)
    kept = child.optimizer.state[masters[0]]["exp_avg"]
    with pytest.raises(ValueError, match="holds 5 elements, its shard 6"):
        dopt.replace_state(child, "exp_avg", layout, [(0, values, 10, None)])
    assert child.optimizer.state[masters[0]]["exp_avg"] is kept


def test_a_range_read_alone_owns_its_buffer_so_an_install_may_adopt_it(tmp_path):
    """What `replace_state` relies on to make a moment a view of its verified bytes: a range read on
    its own (a same-layout load's whole bucket slice) is a tensor that is all of its buffer, small
    (a bytearray) or large (an anonymous map); a range cut from a wider verified span is a slice of
    a larger buffer (`replace_state` then copies it, see the test above)."""
    for n in (300, host_memory.ANONYMOUS_ABOVE // 4 + 1000):
        path, record = _write(tmp_path, {"a": torch.arange(n, dtype=torch.float32)}, block_bytes=4096)
        got, _ = partial_reads.read_ranges(path, record, [("a", 0, n)])
        tensor = got[("a", 0, n)]
        assert tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == n * 4, n
        assert torch.equal(tensor, torch.arange(n, dtype=torch.float32))
        cut = tensor[10:20]
        assert cut.untyped_storage().nbytes() > cut.numel() * 4


def test_a_strided_range_comes_back_as_its_rows_compact_with_every_block_under_it_verified(tmp_path):
    """A resharding load's half rows of a row-parallel factor (`partial_reads.strided_rows`): the read
    returns only the rows, one after the other, in a buffer of their own (an install may adopt it),
    each block under the whole span verified, a gap between rows included; plain ranges asked with
    it in the same pass come back as before."""
    a = torch.arange(2000, dtype=torch.float32)
    path, record = _write(tmp_path, {"a": a, "b": torch.arange(50, dtype=torch.float32)}, block_bytes=256)
    rows = ("a", 100, 100 + 9 * 64 + 24, 64, 24)  # 10 rows of 24 elements, one every 64
    assert partial_reads.strided_rows(rows) == (64, 24, 10) and partial_reads.range_numel(rows) == 240
    expected = a[100 : 100 + 10 * 64].view(10, 64)[:, :24].reshape(-1)
    got, _ = partial_reads.read_ranges(path, record, [rows, ("a", 0, 30), ("b", 5, 9)])
    compact = got[rows]
    assert torch.equal(compact, expected)
    assert compact.storage_offset() == 0 and compact.untyped_storage().nbytes() == 240 * 4  # its own buffer
    assert torch.equal(got[("a", 0, 30)], a[:30]) and torch.equal(got[("b", 5, 9)], torch.arange(5, 9.0))
    # through the loader's entry (`verify.check_file_ranges`), with a plain range of the same tensor
    from miles_lora_ckpt.core.layout import Manifest, Topology

    manifest = Manifest(
        "0123456789abcdef", 1, "single-lora", Topology(dp=1), {"t.safetensors": record}, format_version=1
    )
    both = check_file_ranges(tmp_path, "t.safetensors", manifest, [rows, ("a", 100, 124)])
    assert torch.equal(both[rows], expected) and torch.equal(both[("a", 100, 124)], a[100:124])
    # a file read whole cuts the same rows (`protocol.WholeFileRanges`)
    whole = WholeFileRanges({"a": a.view(40, 50)})
    assert torch.equal(whole.get(rows), expected)
    # a flipped byte in a gap between two rows is caught: its block lies under the span
    gap = record.blocks.tensors["a"][1] + (100 + 64 + 40) * 4
    data = bytearray(path.read_bytes())
    data[gap] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="digest mismatch"):
        partial_reads.read_ranges(path, record, [rows])


@pytest.mark.parametrize(
    "bad",
    [
        ("a", 0, 10, 4),
        ("a", 0, 10, 3, 4),
        ("a", 0, 10, 5, 0),
        ("a", 0, 11, 5, 4),
        ("a", 0, 3, 5, 4),
        ("a", 0, 9, 5, 4.0),
    ],
)
def test_a_strided_range_whose_rows_do_not_end_at_its_stop_is_refused(bad):
    with pytest.raises(ValueError, match="element range"):
        partial_reads.strided_rows(bad)


def test_a_strided_part_whose_rows_fill_the_shard_is_installed_as_one_whole_part():
    """`distributed.read_part`: the rows of a strided part read compact go to consecutive shard
    elements (a row-parallel factor's half rows at DP 1): one whole part (no rows), the shape an
    install adopts as the state; rows that stay apart in the shard keep a compact stride."""
    piece = dopt.Piece("optimizer/x.safetensors", {}, "buf0.bucket0", "buf0", 0, 100)
    compact = torch.arange(12, dtype=torch.float32)
    source = {("buf0.bucket0.exp_avg", 10, 10 + 2 * 8 + 4, 8, 4): compact}
    offset, tensor, count, rows = dopt.read_part(piece, source, "exp_avg", 10, 30, 0, (8, 4, 3, 4))
    assert (offset, count, rows) == (0, 12, None) and tensor is compact
    offset, tensor, count, rows = dopt.read_part(piece, source, "exp_avg", 10, 30, 5, (8, 4, 3, 6))
    assert (offset, count, rows) == (5, 12, (4, 4, 3, 6)) and tensor is compact
    assert dopt.range_key(piece, "exp_avg", 10, 26, None) == ("buf0.bucket0.exp_avg", 10, 26)
    with pytest.raises(ValueError, match=r"expected torch.float32\[12\]"):
        dopt.read_part(
            piece, {("buf0.bucket0.exp_avg", 10, 30, 8, 4): compact[:10]}, "exp_avg", 10, 30, 0, (8, 4, 3, 4)
        )
