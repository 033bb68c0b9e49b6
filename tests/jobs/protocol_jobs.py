"""Worker functions for the multi-rank protocol tests (run inside sim.launch workers, no megatron)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from miles_lora_ckpt.core import content_rules, faults
from miles_lora_ckpt.core.consensus import SLOT_BYTES, Consensus, Outcome
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import TRACKER, Topology
from miles_lora_ckpt.core.protocol import open_generation, save_generation
from miles_lora_ckpt.core.verify import verify_generation


def rank_file(rank: int) -> str:
    return f"shards/rank{rank:03d}.safetensors"


def rank_tensors(rank: int, iteration: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * iteration + rank)
    return {"w": torch.randn(64, 8, generator=gen), "m": torch.randn(33, generator=gen).bfloat16()}


def _save(consensus: Consensus, root: Path, iteration: int):
    def write(writer):
        writer.write_tensors(rank_file(consensus.rank), rank_tensors(consensus.rank, iteration))
        writer.write_tensors(f"shards/second{consensus.rank:03d}.safetensors", {"x": torch.ones(3) * iteration})
        if consensus.rank == 0:
            writer.write_json("meta/common.json", {"iteration": iteration})

    topo = Topology(world=consensus.world_size, dp=consensus.world_size)
    return save_generation(consensus, root, iteration=iteration, saver="test", topology=topo, write_files=write, keep=3)


def _load(consensus: Consensus, root: Path) -> tuple[int, bool]:
    opened = open_generation(consensus, root, lambda m: [rank_file(consensus.rank)])
    got = opened.tensors(rank_file(consensus.rank))
    want = rank_tensors(consensus.rank, opened.manifest.iteration)
    same = all(torch.equal(got[k], want[k]) for k in want)
    return opened.manifest.iteration, same


def _tracker(root: Path) -> str | None:
    path = root / TRACKER
    return path.read_text() if path.exists() else None


def raise_matrix(payload: dict, ctx) -> dict:
    """Every save phase on every rank raises once; returns what each attempt looked like here."""
    consensus = Consensus.for_world(timeout_s=payload.get("timeout_s", 60))
    root = Path(payload["root"])
    iteration = 1
    _save(consensus, root, iteration)
    cases = []
    for phase in faults.SAVE_PHASES:
        for failing in range(ctx.world_size):
            before = _tracker(root)
            if ctx.rank == failing:
                faults.arm(phase, failing, "raise")
            started = time.monotonic()
            try:
                _save(consensus, root, iteration + 1)
                error = None
            except CheckpointError as exc:
                error = {"phase": exc.phase, "ranks": exc.failed_ranks, "text": str(exc)}
            faults.disarm()
            elapsed = time.monotonic() - started
            after = _tracker(root)
            # the previous (or, after publish, the new) generation must load on every rank
            loaded_iteration, same = _load(consensus, root)
            iteration += 1 if phase == "after-publish" else 0
            cases.append(
                {
                    "phase": phase,
                    "failing": failing,
                    "error": error,
                    "tracker_unchanged": before == after,
                    "loaded_iteration": loaded_iteration,
                    "expected_iteration": iteration,
                    "content_ok": same,
                    "seconds": elapsed,
                }
            )
            # a later save succeeds
            iteration += 1
            _save(consensus, root, iteration)
    # load-side faults: one rank fails before reading
    load_errors = []
    for failing in range(ctx.world_size):
        if ctx.rank == failing:
            faults.arm("before-read", failing, "raise")
        try:
            _load(consensus, root)
            load_errors.append(None)
        except CheckpointError as exc:
            load_errors.append({"phase": exc.phase, "ranks": exc.failed_ranks})
        faults.disarm()
    return {"cases": cases, "load_errors": load_errors, "final_iteration": iteration}


def kill_once(payload: dict, ctx) -> dict:
    """Two good saves, then a third during which `payload['rank']` SIGKILLs itself at a phase.
    Also returns what the consensus logged at debug level, and the transport's own error text."""
    import logging

    consensus = Consensus.for_world(timeout_s=payload.get("timeout_s", 20))
    root = Path(payload["root"])
    _save(consensus, root, 1)
    _save(consensus, root, 2)
    if ctx.rank == payload["rank"]:
        faults.arm(payload["phase"], ctx.rank, "kill")
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(logging.Formatter().format(record))
    logger = logging.getLogger("miles_lora_ckpt.core.consensus")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    transport = []
    try:
        result = _timed_save(consensus, root, 3, errors=transport)
    finally:
        logger.removeHandler(handler)
    return {**result, "debug_log": "\n".join(records), "transport": transport}


def hold_lease(payload: dict, ctx) -> dict:
    """Rank 0 takes the writer lease of `root` and returns normally, still holding it."""
    from miles_lora_ckpt.core import lease

    if ctx.rank == 0:
        lease.acquire(Path(payload["root"]))
    return {"pid": os.getpid(), "holds": lease.holds(Path(payload["root"]))}


def hang_peer(payload: dict, ctx) -> dict:
    """Rank 1 stalls past the consensus timeout; everybody must get a CheckpointError, not hang."""
    consensus = Consensus.for_world(timeout_s=payload["timeout_s"])
    root = Path(payload["root"])
    if ctx.rank == 1:
        time.sleep(payload["stall_s"])
    return _timed_save(consensus, root, 1)


def _timed_save(consensus: Consensus, root: Path, iteration: int, errors: list | None = None) -> dict:
    """Save once; report "saved" or the CheckpointError text, and how long it took (`errors` gets
    the text of the exception the CheckpointError was raised from, if any)."""
    started = time.monotonic()
    try:
        _save(consensus, root, iteration)
        outcome = "saved"
    except CheckpointError as exc:
        outcome = f"CheckpointError: {exc}"
        if errors is not None and exc.__context__ is not None:
            errors.append(str(exc.__context__))
    return {"outcome": outcome, "seconds": time.monotonic() - started}


def disagreeing_generations(payload: dict, ctx) -> dict:
    """Each rank is pointed at a different generation: loading must fail on all ranks."""
    consensus = Consensus.for_world(timeout_s=30)
    root = Path(payload["root"])
    _save(consensus, root, 10)
    _save(consensus, root, 11)
    gens = sorted(p for p in root.iterdir() if p.name.startswith("gen-"))
    # rank-local choice, as stock Miles does it: every rank verifies "its" generation
    mine = gens[ctx.rank % len(gens)]
    # payloads around the consensus' first slot (SLOT_BYTES), longer on one rank than the other
    sizes = (0, SLOT_BYTES - 40, SLOT_BYTES - 12, SLOT_BYTES - 11, SLOT_BYTES, 3 * SLOT_BYTES)
    expected = [[{"r": r, "s": "\u00e9" * (n if r == 1 else n // 3)} for r in range(ctx.world_size)] for n in sizes]
    agreed = [consensus.agree("sizes", Outcome.success(e[ctx.rank])) for e in expected]
    try:
        opened = open_generation(consensus, mine if ctx.rank == 0 else root, lambda m: [rank_file(ctx.rank)])
        return {"iteration": opened.manifest.iteration, "ok": verify_generation(opened.path).intact}
    except CheckpointError as exc:
        return {"error": str(exc), "payloads_ok": agreed == expected}


def pid(payload: dict, ctx) -> dict:
    return {"pid": os.getpid()}


def chaos_writer(payload: dict, ctx) -> dict:
    """One of two training runs saving into the same root at the same time.

    Saves `saves` generations (iterations `first`, `first`+1, ...), recording for each whether it
    committed or was refused; then keeps running (and holding the lease, if it won it) until the
    other run is done, so the other one meets a live writer every time.
    """
    consensus = Consensus.for_world(timeout_s=60)
    root, scratch = Path(payload["root"]), Path(payload["scratch"])
    outcomes = []
    for offset in range(payload["saves"]):
        iteration = payload["first"] + offset

        def write(writer, iteration=iteration):
            writer.write_tensors(rank_file(consensus.rank), rank_tensors(consensus.rank, iteration))

        topo = Topology(world=consensus.world_size, dp=consensus.world_size)
        try:
            path = save_generation(consensus, root, iteration=iteration, saver="test", topology=topo, write_files=write)
            outcomes.append({"saved": path.name})
        except CheckpointError as exc:
            outcomes.append({"refused": str(exc)})
        time.sleep(payload.get("pause_s", 0.1))
    (scratch / f"done-{payload['name']}-{ctx.rank}").touch()
    deadline = time.monotonic() + 60
    while len(list(scratch.glob("done-*"))) < 2 * ctx.world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"outcomes": outcomes, "pid": os.getpid()}


def fifo_load(payload: dict, ctx) -> dict:
    """Save, replace one listed file by a FIFO, load on every rank: all must fail within seconds."""
    consensus = Consensus.for_world(timeout_s=60)
    root = Path(payload["root"])
    gen = _save(consensus, root, 1)
    consensus.agree("sync", Outcome.success())
    if ctx.rank == 0:
        target = gen / rank_file(1)
        target.unlink()
        os.mkfifo(target)
    consensus.agree("sync", Outcome.success())
    started = time.monotonic()
    try:
        open_generation(consensus, gen, lambda m: [rank_file(consensus.rank)])
        error = None
    except CheckpointError as exc:
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - started}


# --------------------------------------------------------------------------- partial reads

SLICED = "optimizer/sliced.safetensors"
BLOCK = 256  # bytes: small blocks, so that every rank reads a different part of the file


def sliced_tensors() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(512, dtype=torch.float32), "b": torch.arange(512, dtype=torch.float32) * 2}


def partial_reads(payload: dict, ctx) -> dict:
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


# --------------------------------------------------------------------------- a bug is not damage


def bug_or_damage(payload: dict, ctx) -> dict:
    """Two generations. A TypeError injected into rank 1's content check of the newer one must fail
    the load on every rank (never the older generation), its traceback in rank 1's log; real
    damage to the newer one (a flipped byte) must still make every rank fall back to the older."""
    consensus = Consensus.for_world(timeout_s=60)
    root = Path(payload["root"])
    _save(consensus, root, 1)
    newest = _save(consensus, root, 2)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("miles_lora_ckpt").addHandler(handler)
    original = content_rules.check_tensor_file

    def buggy(relpath, manifest, *args, **kwargs):
        if manifest.iteration == 2:
            raise TypeError("injected bug: unsupported operand type(s)")
        return original(relpath, manifest, *args, **kwargs)

    bug: dict = {}
    if ctx.rank == 1:
        content_rules.check_tensor_file = buggy
    try:
        bug["loaded"] = _load(consensus, root)[0]
    except CheckpointError as exc:
        bug["error"] = {"phase": exc.phase, "ranks": exc.failed_ranks, "text": str(exc)}
    finally:
        content_rules.check_tensor_file = original
        logging.getLogger("miles_lora_ckpt").removeHandler(handler)
    formatter = logging.Formatter()
    tracebacks = [formatter.format(r) for r in records if r.exc_info and r.exc_info[0] is TypeError]
    consensus.agree("sync", Outcome.success())
    if ctx.rank == 0:  # damage: one byte of rank 1's tensor data, same size (its digest no longer matches)
        target = newest / rank_file(1)
        data = bytearray(target.read_bytes())
        data[-1] ^= 0x40
        target.write_bytes(bytes(data))
    consensus.agree("sync", Outcome.success())
    return {"bug": bug, "tracebacks": tracebacks, "damaged_load": list(_load(consensus, root))}
