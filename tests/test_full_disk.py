"""A full disk never locks the root: a save that fails while creating its writer lease leaves no
lease behind (a retry succeeds at once), and a failure after the publishing rename says that the
generation was committed, naming it.

ENOSPC is injected at each step (the calls are patched only around the step under test); one test
also fills a real file system (a small tmpfs), skipped only where mounting one is impossible."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch

from miles_lora_ckpt.core import atomic_files, json_files, lease, protocol
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError, CommittedButFailed
from miles_lora_ckpt.core.layout import LATEST, LEASE, TRACKER, Topology
from miles_lora_ckpt.core.protocol import open_generation, save_generation


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _save(root: Path, iteration: int, **kwargs) -> Path:
    def write(writer):
        writer.write_tensors("adapter.safetensors", {"w": torch.full((64, 64), float(iteration))})

    return save_generation(
        Consensus.single_process(),
        root,
        iteration=iteration,
        saver="test",
        topology=Topology(),
        write_files=write,
        **kwargs,
    )


def _lease_files(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(LEASE))


@pytest.fixture
def fresh_root(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    yield root
    lease.release(root)


# each step of creating the lease file, and the call that fails there
LEASE_STEPS = {
    "create": (os, "open"),
    "write": (os, "write"),
    "fsync": (os, "fsync"),
    "link": (os, "link"),
    "fsync-root": (atomic_files, "fsync_dir"),
}


@pytest.mark.parametrize("step", list(LEASE_STEPS))
def test_a_lease_that_cannot_be_written_is_not_left_behind_and_a_retry_takes_it(fresh_root, monkeypatch, step):
    module, name = LEASE_STEPS[step]
    with monkeypatch.context() as patched:
        patched.setattr(module, name, _full)
        with pytest.raises(OSError) as raised:
            lease.acquire(fresh_root)
    assert raised.value.errno == errno.ENOSPC
    assert _lease_files(fresh_root) == []  # no lease, and no half-written file beside it
    assert not lease.holds(fresh_root)
    lease.acquire(fresh_root)  # the retry, once there is room: not refused by a leftover
    assert lease.read_state(fresh_root).holder.token == lease.me().token
    assert _lease_files(fresh_root) == [LEASE]


def test_a_save_whose_lease_write_fails_leaves_the_root_free_for_another_writer(fresh_root, monkeypatch):
    with monkeypatch.context() as patched:
        patched.setattr(os, "write", _full)
        with pytest.raises(CheckpointError, match=r"(?s)phase 'prepare'.*No space left on device"):
            _save(fresh_root, 1)
    assert _lease_files(fresh_root) == []
    # another writer (another process: another token) is not refused by what the failed save left
    monkeypatch.setattr(lease, "_identity", {os.getpid(): ("other-host", "other-token", "")})
    gen = _save(fresh_root, 1)
    assert lease.read_state(fresh_root).holder.host == "other-host"
    assert open_generation(Consensus.single_process(), fresh_root, lambda m: []).path == gen


def test_a_lease_put_back_after_a_mistaken_takeover_is_the_same_whole_file(fresh_root):
    lease.acquire(fresh_root)
    before = os.stat(fresh_root / LEASE)
    tomb = fresh_root / f"{LEASE}.aside-test"
    os.rename(fresh_root / LEASE, tomb)
    lease._put_back(fresh_root, tomb)
    after = os.stat(fresh_root / LEASE)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert _lease_files(fresh_root) == [LEASE]
    lease.confirm(fresh_root)  # still ours


def _fail_root_fsync(root: Path):
    real = atomic_files.fsync_dir

    def fsync_dir(path):
        if Path(path) == root:
            _full()
        real(path)

    return fsync_dir


# each step after the publishing rename, and how it fails
AFTER_RENAME = {
    "tracker": lambda root: (json_files, "write_json", _full),
    "latest link": lambda root: (os, "symlink", _full),
    "fsync of the root": lambda root: (atomic_files, "fsync_dir", _fail_root_fsync(root)),
}


@pytest.mark.parametrize("step", list(AFTER_RENAME))
def test_a_failure_after_the_publishing_rename_says_the_generation_was_committed(fresh_root, monkeypatch, step):
    older = _save(fresh_root, 1)
    module, name, replacement = AFTER_RENAME[step](fresh_root)
    with monkeypatch.context() as patched:
        patched.setattr(module, name, replacement)
        with pytest.raises(CheckpointError) as raised:
            _save(fresh_root, 2, link_latest=True)
    committed = sorted(p for p in fresh_root.glob("gen-000000002-*"))
    assert len(committed) == 1 and committed[0].is_dir()
    error = raised.value
    assert isinstance(error, CommittedButFailed) and error.generation == committed[0].name
    assert str(error).startswith(f"generation {committed[0].name} committed; the failure after it: ")
    assert "No space left on device" in str(error) and error.phase == "publish"
    # it is a valid generation: the loader takes it (the tracker may still name the older one: a warning)
    opened = open_generation(Consensus.single_process(), fresh_root, lambda m: ["adapter.safetensors"])
    assert opened.path == committed[0] and older.is_dir()
    assert not list(fresh_root.glob(".staging-*")) and not list(fresh_root.glob(f".{LATEST}.tmp-*"))
    _save(fresh_root, 3, link_latest=True)  # and the next save goes through
    assert (fresh_root / TRACKER).is_file() and os.readlink(fresh_root / LATEST).startswith("gen-000000003-")


def test_a_failure_before_the_rename_is_not_called_committed(fresh_root, monkeypatch):
    _save(fresh_root, 1)
    with monkeypatch.context() as patched:
        patched.setattr(protocol.os, "rename", _full)
        with pytest.raises(CheckpointError) as raised:
            _save(fresh_root, 2)
    assert not isinstance(raised.value, CommittedButFailed) and "committed" not in str(raised.value)
    assert not list(fresh_root.glob("gen-000000002-*"))


@contextlib.contextmanager
def _small_tmpfs(where: Path, size: str):
    where.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def test_a_really_full_file_system_leaves_no_lease_and_the_save_after_freeing_space_commits(tmp_path):
    with _small_tmpfs(tmp_path / "mnt", "1m") as mnt:
        root = mnt / "root"
        root.mkdir()
        filler = mnt / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):  # take every byte the file system has
            while os.write(fd, b"\1" * 4096):
                pass
        os.close(fd)
        try:
            with pytest.raises(CheckpointError, match="No space left on device"):
                _save(root, 1)
            assert _lease_files(root) == [] and not list(root.glob(".staging-*"))
            filler.unlink()
            # the room is back: a retry, here or by another process, takes the lease and commits
            gen = _save(root, 1)
            assert open_generation(Consensus.single_process(), root, lambda m: []).path == gen
        finally:
            lease.release(root)
