"""No reader ever blocks: a FIFO, a socket or a character device where a file is expected is refused
at once, and the refusal names the path.

Every reader of a checkpoint path meets one: a stock native checkpoint's `metadata.json`,
`.metadata` and `*.distcp` (through the launch's startup scan, the load's classification and the
warm start's reads), a legacy Miles `.pt`, a PEFT export's files, an offline export's base
`config.json`, and every file of a plugin generation (through `verify` and the load). Opening a
FIFO for reading blocks until a writer comes, so each case runs under a 5 s alarm: a regression
fails here instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import stat
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from miles_lora_ckpt.core import native_dist
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.dcp_metadata import DcpMetadataError, read_metadata
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import MANIFEST, TRACKER, Topology
from miles_lora_ckpt.core.protocol import open_generation, save_generation
from miles_lora_ckpt.tools.cli import main as cli

KINDS = ("fifo", "socket", "character device")
SECONDS = 5  # every case below answers in milliseconds; only a blocking open takes longer


@contextlib.contextmanager
def answered_at_once():
    """Fail (TimeoutError) instead of hanging when the body blocks; and assert it took < 5 s."""

    def hung(signum, frame):
        raise TimeoutError(f"a reader blocked for {SECONDS} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(SECONDS)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < SECONDS


def make_special(path: Path, kind: str) -> None:
    """Replace `path` with a special file of `kind`."""
    if path.exists():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        cwd = os.getcwd()
        os.chdir(path.parent)  # a socket path may be at most ~100 characters: bind relative to its folder
        try:
            socket.socket(socket.AF_UNIX).bind(path.name)
        finally:
            os.chdir(cwd)
    else:
        try:  # /dev/zero's numbers: a reader that opened it would read zeros without end
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))
        except PermissionError:
            pytest.skip("creating a character device needs CAP_MKNOD")


def refused(error: type[BaseException] | tuple, call, path: Path, kind: str) -> str:
    with answered_at_once(), pytest.raises(error) as caught:
        call()
    message = str(caught.value)
    assert str(path) in message and kind in message, message
    return message


# --------------------------------------------------------------------------- a stock native checkpoint


@pytest.fixture(scope="module")
def native_template(tmp_path_factory) -> Path:
    """A Miles save directory holding one stock native adapter checkpoint, written by torch's own
    `dcp.save` plus megatron's `metadata.json`: `<save>/iter_0000002/adapter/torch_dist`."""
    import torch.distributed.checkpoint as dcp

    save = tmp_path_factory.mktemp("native") / "save"
    found = save / "iter_0000002" / "adapter" / native_dist.NATIVE_SUBDIR
    found.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a.lora_A.weight": torch.arange(12.0).view(3, 4)}, checkpoint_id=str(found))
    (found / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return save


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["metadata.json", ".metadata", "distcp"])
def test_special_files_in_a_native_checkpoint_are_refused_at_once_and_named(native_template, tmp_path, name, kind):
    from miles_lora_ckpt.integration import resume
    from miles_lora_ckpt.integration.config import load_config
    from miles_lora_ckpt.savers.single_lora import load

    save = tmp_path / "save"
    shutil.copytree(native_template, save)
    adapter = save / "iter_0000002" / "adapter"
    found = adapter / native_dist.NATIVE_SUBDIR
    distcp = sorted(found.glob("*.distcp"))[0]
    special = distcp if name == "distcp" else found / name
    make_special(special, kind)
    launch = SimpleNamespace(
        start_rollout_id=None, finetune=False, lora_adapter_path=None, save=str(tmp_path / "fresh"), load=str(save)
    )
    if name == "distcp":
        # recognition reads no tensor file: the startup scan refuses the stock checkpoint as usual
        with answered_at_once(), pytest.raises(resume.ResumeRefused, match="stock Miles native"):
            resume.check_relaunch(load_config({}), launch)
        metadata = read_metadata(found / ".metadata")
        entry = metadata.entries["a.lora_A.weight"]
        refused(
            ValueError,
            lambda: native_dist.read_chunk(found, metadata, "a.lora_A.weight", entry.chunks[0]),
            special,
            kind,
        )
        return
    # the launch's startup scan, the load's classification and the probe itself
    message = refused(resume.ResumeRefused, lambda: resume.check_relaunch(load_config({}), launch), special, kind)
    assert message.startswith("--load: "), message
    refused(ValueError, lambda: load._classify(adapter), special, kind)
    refused(ValueError, lambda: native_dist.native_checkpoints_in(save), special, kind)
    if name == ".metadata":
        refused(DcpMetadataError, lambda: read_metadata(special), special, kind)


# --------------------------------------------------------------------------- legacy Miles, PEFT, offline export


@pytest.mark.parametrize("kind", KINDS)
def test_special_files_in_legacy_peft_and_export_inputs_are_refused_at_once_and_named(tmp_path, kind):
    from miles_lora_ckpt.savers.peft_export import CONFIG_NAME, WEIGHTS_NAME
    from miles_lora_ckpt.savers.peft_export.format import check_peft_dir
    from miles_lora_ckpt.savers.peft_export.offline import OfflineExportError, convert_shards
    from miles_lora_ckpt.savers.single_lora import legacy_miles

    # a legacy Miles adapter shard (torch.load(weights_only=True) of what we read, never of the path)
    shard = tmp_path / "legacy" / "adapter_megatron_rank0.pt"
    shard.parent.mkdir()
    make_special(shard, kind)
    refused(ValueError, lambda: legacy_miles._torch_load_weights_only(shard), shard, kind)
    make_special(shard.parent / "training_state_rank0.pt", kind)
    with answered_at_once():
        assert legacy_miles._legacy_iteration(shard.parent, 0) is None  # informative only: skipped
    # a PEFT export directory: each of its two files
    peft = tmp_path / "peft"
    peft.mkdir()
    for special in (peft / CONFIG_NAME, peft / WEIGHTS_NAME):
        (peft / CONFIG_NAME).unlink(missing_ok=True)
        (peft / CONFIG_NAME).write_text("{}")
        make_special(special, kind)
        with answered_at_once():
            problems = check_peft_dir(peft)
        assert [p.file for p in problems] == [special.name] and kind in problems[0].reason, problems
    # the HF base's config.json an offline export reads
    base = tmp_path / "base"
    base.mkdir()
    make_special(base / "config.json", kind)
    manifest = SimpleNamespace(topology=SimpleNamespace(vpp=1), files={})
    refused(OfflineExportError, lambda: convert_shards(tmp_path, manifest, base, None), base / "config.json", kind)


# --------------------------------------------------------------------------- a plugin generation


def _generation(root: Path) -> Path:
    def write(writer):
        writer.write_tensors(
            "adapter/dense_tp000_pp000.safetensors", {"lora_A": torch.ones(2, 3)}, binding={"role": "dense-adapter"}
        )
        writer.write_json(
            "training_state.json", {"iteration": 3, "generation": writer.generation}, binding={"role": "training-state"}
        )

    return save_generation(
        Consensus.single_process(), root, iteration=3, saver="fuzz", topology=Topology(), write_files=write
    )


def test_every_file_of_a_generation_as_a_fifo_is_refused_at_once_and_named(tmp_path):
    """verify and the load name the FIFO, whichever file of the generation (or the tracker) it replaces."""
    template = tmp_path / "template"
    gen = _generation(template)
    files = [
        str(p.relative_to(template))
        for p in sorted(template.rglob("*"))
        if p.is_file() and ".writer-lease" not in p.name
    ]
    assert f"{gen.name}/{MANIFEST}" in files and TRACKER in files and len(files) >= 4
    for rel in files:
        root = tmp_path / f"case{files.index(rel)}"
        shutil.copytree(template, root)
        make_special(root / rel, "fifo")
        out = io.StringIO()
        with answered_at_once(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = cli(["verify", str(root)])
        assert code in (0, 1, 2) and "is a fifo" in out.getvalue() and Path(rel).name in out.getvalue(), (
            rel,
            out.getvalue(),
        )
        if rel == TRACKER:
            continue  # the tracker is a hint: the load goes on without it (warned)
        with answered_at_once(), pytest.raises(CheckpointError) as caught:
            open_generation(Consensus.single_process(), root, lambda m: list(m.files))
        assert "is a fifo" in str(caught.value) and Path(rel).name in str(caught.value), (rel, caught.value)
