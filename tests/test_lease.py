"""The writer lease: one writer per save root, stale leases taken over safely, renewal, release.

A second process holds a real lease here (no test double): a Python child that imports only the
protocol core, takes the lease, and waits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles_lora_ckpt.core import lease, settings
from miles_lora_ckpt.core.layout import LEASE

HOLDER = """
import sys, time
from pathlib import Path
from miles_lora_ckpt.core import lease
lease.acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture(autouse=True)
def _clean():
    settings.reset()
    yield
    settings.reset()


@pytest.fixture
def other_holder(tmp_path):
    """Another process on this host holding the lease of tmp_path."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "MILES_LORA_CKPT_RUN_ID": "run-other"},
    )
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_lease_names_its_holder_is_idempotent_and_released(tmp_path):
    with settings.overridden(run_id="run-7", lease_timeout_s=30.0):
        lease.acquire(tmp_path)
        lease.acquire(tmp_path)
    body = json.loads((tmp_path / LEASE).read_text())
    assert body["holder"]["pid"] == os.getpid() and body["holder"]["run"] == "run-7" and body["timeout_s"] == 30.0
    assert body["holder"]["host"] and body["acquired_unix_s"] > 0
    state = lease.read_state(tmp_path)
    assert state.live and state.holder.token == lease.me().token and f"pid {os.getpid()}" in state.describe()
    assert lease.holds(tmp_path)
    lease.release(tmp_path)
    assert not (tmp_path / LEASE).exists() and not lease.holds(tmp_path)
    assert sorted(os.listdir(tmp_path)) == []  # no probe or aside file is left behind


def test_a_second_writer_is_refused_naming_the_holder_until_it_is_gone(tmp_path, other_holder):
    with pytest.raises(lease.LeaseHeld) as info:
        lease.acquire(tmp_path)
    text = str(info.value)
    assert f"pid {other_holder.pid} run run-other" in text and "has another writer" in text
    other_holder.kill()
    other_holder.wait()
    lease.acquire(tmp_path)  # its process is gone and it ran on this host: taken over at once
    assert lease.read_state(tmp_path).holder.pid == os.getpid()
    lease.release(tmp_path)


def test_a_stale_lease_is_taken_over_and_its_old_holder_finds_out(tmp_path):
    lease.acquire(tmp_path)
    foreign = {"host": "elsewhere", "pid": 1, "run": "", "token": "feedfeedfeedfeed", "boot_id": "b"}
    then = time.time() - 1000
    body = {"format": "miles-lora-ckpt-lease", "holder": foreign, "acquired_unix_s": then, "timeout_s": 60}
    (tmp_path / LEASE).write_text(json.dumps(body))  # someone else took it over meanwhile
    with pytest.raises(lease.LeaseHeld, match="lost its writer lease; it is now held by host elsewhere"):
        lease.confirm(tmp_path)
    assert not lease.holds(tmp_path)
    os.utime(tmp_path / LEASE, (then, then))  # ... and then stopped renewing it
    state = lease.read_state(tmp_path)
    assert not state.live and "not renewed for" in state.stale_reason
    lease.acquire(tmp_path)
    assert lease.read_state(tmp_path).holder.token == lease.me().token
    lease.release(tmp_path)


def test_a_lease_renewed_while_being_taken_over_is_put_back_and_the_contender_refused(tmp_path, other_holder):
    then = time.time() - 1000
    os.utime(tmp_path / LEASE, (then, then))
    judged = lease.read_state(tmp_path)
    content = (tmp_path / LEASE).read_text()
    os.utime(tmp_path / LEASE)  # the holder renews between our judgement and our rename
    with pytest.raises(lease.LeaseHeld, match="has another writer"):
        lease._take_over(tmp_path, judged)
    assert (tmp_path / LEASE).read_text() == content
    assert [n for n in os.listdir(tmp_path) if n != LEASE] == []


def test_the_heartbeat_keeps_a_lease_live_past_its_timeout(tmp_path):
    with settings.overridden(lease_timeout_s=0.4):
        lease.acquire(tmp_path)
        time.sleep(1.2)
        state = lease.read_state(tmp_path)
        assert state.live and state.age_s < 0.4, state
        lease.release(tmp_path)


def test_a_fork_does_not_release_its_parents_lease_at_exit(tmp_path):
    lease.acquire(tmp_path)
    pid = os.fork()
    if pid == 0:  # the child runs the exit handler, as a forked worker that exits normally would
        lease._release_all_at_exit()
        os._exit(0)
    os.waitpid(pid, 0)
    assert lease.read_state(tmp_path).holder.token == lease.me().token
    lease.release(tmp_path)


def test_an_unreadable_lease_is_live_until_it_ages_out(tmp_path):
    (tmp_path / LEASE).write_text("{not json")
    with pytest.raises(lease.LeaseHeld, match="unreadable lease"):
        lease.acquire(tmp_path)
    then = time.time() - 1000
    os.utime(tmp_path / LEASE, (then, then))
    lease.acquire(tmp_path)
    lease.release(tmp_path)
    assert not Path(tmp_path / LEASE).exists()
