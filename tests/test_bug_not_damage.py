"""A bug is not damage: an exception in a check that is not `GenerationDamaged` (nor an OSError
reading a listed file) fails the load on every rank, with its traceback in the log, and never
makes a loader, `verify`, `gc` or retention treat the generation as damaged."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from jobs_paths import TESTS
from protocol_generations import load_ranks, rank_file, save_ranks

from miles_lora_ckpt.core import content_rules
from miles_lora_ckpt.core.consensus import Consensus, Outcome
from miles_lora_ckpt.core.errors import (
    CheckpointError,
    CommittedButFailed,
    GenerationDamaged,
    IncompatibleCheckpoint,
    MilesLoraCkptError,
    NotACheckpoint,
    NothingCommitted,
)
from miles_lora_ckpt.core.layout import Topology
from miles_lora_ckpt.core.protocol import save_generation
from miles_lora_ckpt.tools.cli import main as cli
from miles_lora_ckpt_harness.sim.launch import check_all, run_workers

ADAPTER = "adapter.safetensors"


def _save(root: Path, iteration: int, keep: int | None = None) -> Path:
    def write(writer):
        writer.write_tensors(ADAPTER, {"w": torch.full((4, 4), float(iteration))})
        writer.write_json("state.json", {"iteration": iteration})

    return save_generation(
        Consensus.single_process(),
        root,
        iteration=iteration,
        saver="test",
        topology=Topology(),
        write_files=write,
        keep=keep,
    )


@pytest.fixture
def bug_in_a_check(monkeypatch):
    """A TypeError in the content check of every tensor file (a bug of ours, not damage)."""

    def buggy(*args, **kwargs):
        raise TypeError("injected bug: unsupported operand type(s)")

    monkeypatch.setattr(content_rules, "check_tensor_file", buggy)


def test_every_error_of_the_package_derives_from_one_base():
    """Every exception class a production module defines derives from MilesLoraCkptError: found by
    walking the package (the harness `sim` and the demo/bench tools aside), so a new error class
    cannot slip past a hand-kept list."""
    import importlib
    import pkgutil

    import miles_lora_ckpt
    from miles_lora_ckpt import MilesLoraCkptError as exported

    assert exported is MilesLoraCkptError
    found = []
    for info in pkgutil.walk_packages(miles_lora_ckpt.__path__, "miles_lora_ckpt."):
        if info.name.startswith(("miles_lora_ckpt.tools", "miles_lora_ckpt.__main__")):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == info.name:
                found.append(value)
    names = {cls.__name__ for cls in found}
    # the classes this walk must see (a broken walk would pass vacuously)
    assert {"CheckpointError", "DcpMetadataError", "DataStateRefused", "LeaseHeld", "OfflineExportError"} <= names
    assert [cls for cls in found if not issubclass(cls, MilesLoraCkptError)] == []
    # the damage exception is a ValueError too (code that refused a bad file by ValueError still does)
    assert issubclass(GenerationDamaged, ValueError) and not issubclass(IncompatibleCheckpoint, GenerationDamaged)
    for cls in (CheckpointError, CommittedButFailed, NothingCommitted, NotACheckpoint):
        assert cls in found, cls


# --------------------------------------------------------------------------- a bug is not damage


def bug_or_damage(payload: dict, ctx) -> dict:
    """Two generations. A TypeError injected into rank 1's content check of the newer one must fail
    the load on every rank (never the older generation), its traceback in rank 1's log; real
    damage to the newer one (a flipped byte) must still make every rank fall back to the older."""
    consensus = Consensus.for_world(timeout_s=60)
    root = Path(payload["root"])
    save_ranks(consensus, root, 1)
    newest = save_ranks(consensus, root, 2)
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
        bug["loaded"] = load_ranks(consensus, root)[0]
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
    return {"bug": bug, "tracebacks": tracebacks, "damaged_load": list(load_ranks(consensus, root))}


def test_a_bug_in_a_check_fails_the_load_on_every_rank_and_damage_still_falls_back(tmp_path):
    results = check_all(
        run_workers(
            2, "test_bug_not_damage:bug_or_damage", {"root": str(tmp_path / "root")}, sys_path=[TESTS], megatron=False
        )
    )
    errors = [r["bug"].get("error") for r in results]
    assert all(r["bug"].get("loaded") is None for r in results)  # no rank resumed the older generation
    assert all(e is not None for e in errors), errors
    assert errors[0] == errors[1]  # the same error on every rank
    assert errors[0]["phase"] == "read" and errors[0]["ranks"] == [1]
    assert "TypeError: injected bug" in errors[0]["text"]
    # the traceback is in the log of the rank that met it
    assert results[0]["tracebacks"] == []
    traceback = "\n".join(results[1]["tracebacks"])
    assert "Traceback (most recent call last)" in traceback and "check_file_content" in traceback, traceback
    # real damage (a flipped byte) still makes every rank fall back to the older generation
    assert [r["damaged_load"] for r in results] == [[1, True], [1, True]]


def test_verify_and_inspect_report_a_bug_as_an_internal_error_not_as_damage(tmp_path, bug_in_a_check, capsys):
    root = tmp_path / "root"
    _save(root, 1)
    newest = _save(root, 2)
    capsys.readouterr()
    for args in (
        ["verify", str(root)],
        ["verify", str(root), "--all"],
        ["verify", str(newest)],
        ["inspect", str(root)],
    ):
        assert cli(args) == 3, args  # internal error, not 1 (damaged), and no older generation passes as OK
        out, err = capsys.readouterr()
        assert "OK " not in out and "ERROR" not in out, (args, out)
        assert err.startswith("INTERNAL ERROR TypeError: injected bug") and "--debug" in err, err
        assert "Traceback" not in out + err and len(err.strip().splitlines()) == 1  # one line, no traceback
    assert cli(["verify", str(root), "--debug"]) == 3
    assert "Traceback (most recent call last)" in capsys.readouterr().err  # asked for: the traceback


def test_gc_never_removes_generations_for_a_bug(tmp_path, monkeypatch, capsys):
    root = tmp_path / "root"
    for iteration in (1, 2, 3):
        _save(root, iteration)
    monkeypatch.setattr(content_rules, "check_tensor_file", _raise_type_error)
    capsys.readouterr()
    assert cli(["gc", str(root), "--keep", "1"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("INTERNAL ERROR TypeError") and "Traceback" not in err
    assert len(list(root.glob("gen-*"))) == 3


def test_retention_at_the_end_of_a_save_removes_nothing_for_a_bug(tmp_path, monkeypatch, caplog):
    root = tmp_path / "root"
    for iteration in (1, 2, 3):
        _save(root, iteration)
    monkeypatch.setattr(content_rules, "check_tensor_file", _raise_type_error)
    # the save commits; taking the bug for damage would leave only the new generation (the older
    # ones "damaged" and older than it); instead nothing is removed and the traceback is logged
    with caplog.at_level(logging.ERROR, logger="miles_lora_ckpt"):
        newest = _save(root, 4, keep=2)
    assert newest.is_dir() and len(list(root.glob("gen-*"))) == 4
    bug = [r for r in caplog.records if r.exc_info and r.exc_info[0] is TypeError]
    assert bug and "retention" in bug[0].getMessage()


def _raise_type_error(*args, **kwargs):
    raise TypeError("injected bug in a check")
