"""One writer per save root: a lease file that names its holder and is renewed while it lives.

`<root>/.writer-lease.json` holds::

    {"format": "miles-lora-ckpt-lease",
     "holder": {"host": ..., "pid": ..., "run": ..., "token": ..., "boot_id": ...},
     "acquired_unix_s": ..., "timeout_s": 60.0}

A save's coordinator takes the lease at prepare and checks it again just before publishing. A
heartbeat thread renews it every quarter of its timeout; it is released at exit (`release_all`). A
second writer is refused with `LeaseHeld`, naming the holder, before anything is written.

Only operations atomic on a shared file system are used: create-exclusive (`link`, or `O_EXCL`),
rename, `utime` and reads, never `flock`. A lease appears whole or not at all. Staleness is judged
by the file system's own clock, or at once for a dead holder on this host. A stale lease is taken
over with one rename, checked to be the very lease judged stale. See docs/guarantees.md, "Writer
lease".
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import re
import secrets
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_lora_ckpt.core import atomic_files, bounded, regular_files, settings
from miles_lora_ckpt.core.errors import MilesLoraCkptError
from miles_lora_ckpt.core.layout import LEASE

__all__ = ["LeaseHeld", "acquire", "confirm", "holds", "me", "read_state", "release", "release_all"]

log = logging.getLogger(__name__)

LEASE_FORMAT = "miles-lora-ckpt-lease"
MAX_LEASE_BYTES = 64 * 1024
_MAX_PID = 2**31 - 1  # pid_t
_ATTEMPTS = 4


class LeaseHeld(MilesLoraCkptError, RuntimeError):
    """Another writer holds the save root's lease, or took it over from this process."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: a process (host, pid, boot) of a run, and a token unique to it."""

    host: str
    pid: int
    run: str
    token: str
    boot_id: str = ""

    def describe(self) -> str:
        """The holder for a message: host, pid and run."""
        return f"host {self.host} pid {self.pid}" + (f" run {self.run}" if self.run else "")

    def to_dict(self) -> dict:
        """The holder as the lease file's `holder` object."""
        return {"host": self.host, "pid": self.pid, "run": self.run, "token": self.token, "boot_id": self.boot_id}

    @classmethod
    def from_dict(cls, data: Any) -> Holder:
        """The holder of a lease file's `holder` object; ValueError naming a malformed field."""
        bounded.mapping(data, "lease holder")
        return cls(
            host=bounded.string(data.get("host"), "lease holder host", max_len=256),
            pid=bounded.integer(data.get("pid"), "lease holder pid", high=2**31),
            run=bounded.string(data.get("run", ""), "lease holder run", max_len=256),
            token=bounded.string(data.get("token"), "lease holder token", max_len=64),
            boot_id=bounded.string(data.get("boot_id", ""), "lease holder boot_id", max_len=64),
        )


@dataclass(frozen=True)
class LeaseState:
    """A lease as a reader sees it now."""

    holder: Holder | None  # None: the lease file is unreadable (`problem` says why)
    problem: str | None
    acquired_unix_s: float | None
    timeout_s: float
    age_s: float  # since the last renewal, by the file system's clock
    stale_reason: str | None  # None while the lease is live
    inode: int
    mtime_ns: int

    @property
    def live(self) -> bool:
        """Whether the lease is live: renewed within its timeout by a holder that may still run."""
        return self.stale_reason is None

    def describe(self) -> str:
        """The lease for a message: who holds it, when it was renewed, whether it is stale."""
        who = self.holder.describe() if self.holder else f"an unreadable lease ({self.problem})"
        when = f"renewed {self.age_s:.0f} s ago"
        if self.live:
            return f"held by {who}, {when}; stale after {self.timeout_s:g} s without renewal"
        return f"stale: {who}, {when}; {self.stale_reason}"


# --------------------------------------------------------------------------- this process

_lock = threading.Lock()
_held: dict[str, tuple[int, float]] = {}  # root -> (pid, timeout_s) of the leases this process holds
_identity: dict[int, tuple[str, str, str]] = {}  # pid -> (host, token, boot id) of this process
_heartbeat: threading.Thread | None = None
_wake = threading.Event()  # set when a lease is registered: the heartbeat recomputes its period


def me() -> Holder:
    """This process as a lease holder: a new token after a fork, and the run id as now set."""
    pid = os.getpid()
    if pid not in _identity:
        _identity.clear()
        _identity[pid] = (socket.gethostname(), secrets.token_hex(8), _boot_id())
    host, token, boot_id = _identity[pid]
    return Holder(host, pid, settings.current().run_id, token, boot_id)


def acquire(root: Path) -> None:
    """Take or renew the lease of `root` for this process, and keep it renewed by the heartbeat.

    Idempotent. Raises LeaseHeld if another writer holds a live one; an OSError propagates.
    """
    root, holder = Path(root), me()
    timeout_s = settings.current().lease_timeout_s
    for _ in range(_ATTEMPTS):
        if _create(root, holder, timeout_s):
            _register(root, timeout_s)
            _sweep_leftovers(root, timeout_s)
            return
        state = read_state(root, judge=False)
        if state is not None and state.holder is not None and state.holder.token == holder.token:
            _renew(root, holder)
            _register(root, timeout_s)
            return
        state = read_state(root)  # another writer's (or unreadable): is it stale?
        if state is None:
            continue  # it vanished meanwhile: try the create again
        if state.live:
            raise LeaseHeld(_refusal(root, state))
        _take_over(root, state)
    raise LeaseHeld(f"save root {root}: could not take its writer lease (other writers are contending for it)")


def confirm(root: Path) -> None:
    """Renew this process's lease of `root` and check it is still its own; LeaseHeld if not."""
    root = Path(root)
    try:
        _renew(root, me())
    except LeaseHeld:
        _unregister(root)
        raise


def release(root: Path) -> None:
    """Give up the lease of `root` if it is still this process's; an OSError propagates."""
    root = Path(root)
    _unregister(root)
    state = read_state(root, judge=False)
    if state is None or state.holder is None or state.holder.token != me().token:
        return  # not ours (any more): leave it alone
    moved = _move_aside(root)
    if moved is None:
        return
    tomb, state = moved
    if state.holder is not None and state.holder.token == me().token:
        tomb.unlink(missing_ok=True)
    else:
        _put_back(root, tomb)


def holds(root: Path) -> bool:
    """Whether this process holds the lease of `root` and has not lost it."""
    with _lock:
        entry = _held.get(str(Path(root)))
    return entry is not None and entry[0] == os.getpid()


def read_state(root: Path, *, judge: bool = True) -> LeaseState | None:
    """The lease of `root` as it is now, or None when there is none.

    `judge=False` skips the staleness judgement and its probe of the file system's clock, when only
    the holder is wanted.
    """
    return _state_of(Path(root) / LEASE, Path(root), judge=judge)


# --------------------------------------------------------------------------- the file


def _create(root: Path, holder: Holder, timeout_s: float) -> bool:
    """Create the lease, whole or not at all; False when one exists already.

    The body is written and fsynced into a file of its own, then linked into place; `link` is
    create-exclusive on every POSIX and NFS file system. So no reader sees a partial lease. A
    failure at any step removes what this call made: an empty lease would refuse every later writer.
    """
    body = {
        "format": LEASE_FORMAT,
        "holder": holder.to_dict(),
        "acquired_unix_s": round(time.time(), 3),
        "timeout_s": timeout_s,
    }
    data = json.dumps(body, indent=1, sort_keys=True).encode()
    lease = root / LEASE
    if os.path.lexists(lease):
        return False  # the common refusal, with nothing written
    fresh = root / f"{LEASE}.new-{secrets.token_hex(6)}"
    try:
        _write_new(fresh, data)
        try:
            os.link(fresh, lease, follow_symlinks=False)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:
                raise
            return _create_in_place(lease, data)  # a file system without hard links
    finally:
        fresh.unlink(missing_ok=True)
    try:
        atomic_files.fsync_dir(root)
    except BaseException:
        lease.unlink(missing_ok=True)  # ours: linked just now, and live, so nobody took it over
        raise
    return True


# Errnos of a file system without hard links: the lease is then created in place (`O_EXCL`).
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS}


def _write_new(path: Path, data: bytes) -> None:
    """Create `path` (exclusively), write all of `data` and fsync it; on any failure remove it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _create_in_place(lease: Path, data: bytes) -> bool:
    """`O_EXCL` create of the lease itself, removed again if writing it fails."""
    try:
        _write_new(lease, data)
    except FileExistsError:
        return False
    try:
        atomic_files.fsync_dir(lease.parent)
    except BaseException:
        lease.unlink(missing_ok=True)
        raise
    return True


def _state_of(path: Path, root: Path, *, judge: bool = True) -> LeaseState | None:
    """Read a lease file (the lease, or one moved aside) without ever blocking on it."""
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        return None
    holder, problem, acquired, timeout_s = None, None, None, settings.current().lease_timeout_s
    inode, mtime_ns = before.st_ino, before.st_mtime_ns
    try:
        fd, st = regular_files.open_regular(path)  # an open revalidates cached attributes on NFS
        try:
            inode, mtime_ns = st.st_ino, st.st_mtime_ns
            if st.st_size > MAX_LEASE_BYTES:
                raise ValueError(f"is {st.st_size} bytes, more than a lease may have")
            raw = b""
            while len(raw) <= MAX_LEASE_BYTES and (chunk := os.read(fd, MAX_LEASE_BYTES + 1 - len(raw))):
                raw += chunk
        finally:
            os.close(fd)
        body = bounded.mapping(bounded.parse_json(raw, what="lease", max_bytes=MAX_LEASE_BYTES), "lease")
        if body.get("format") != LEASE_FORMAT:
            raise ValueError(f"format is {bounded.show(body.get('format'))}, not {LEASE_FORMAT!r}")
        holder = Holder.from_dict(body.get("holder"))
        timeout_s = bounded.number(body.get("timeout_s"), "lease timeout_s", low=1e-3, high=10**7)
        acquired = body.get("acquired_unix_s")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        problem = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    age_s = max(0.0, (_fs_now_ns(root) - mtime_ns) / 1e9) if judge else 0.0
    stale = _stale_reason(holder, age_s, timeout_s) if judge else None
    return LeaseState(holder, problem, acquired, timeout_s, age_s, stale, inode, mtime_ns)


def _stale_reason(holder: Holder | None, age_s: float, timeout_s: float) -> str | None:
    mine = me()
    if holder is not None and holder.boot_id and (holder.host, holder.boot_id) == (mine.host, mine.boot_id):
        if holder.pid != mine.pid and not _process_alive(holder.pid):
            return f"its process (pid {holder.pid} on this host) is gone"
    if age_s > timeout_s:
        return f"not renewed for {age_s:.0f} s (timeout {timeout_s:g} s)"
    return None


def _renew(root: Path, holder: Holder) -> None:
    try:
        os.utime(root / LEASE, follow_symlinks=False)
    except FileNotFoundError:
        raise LeaseHeld(f"save root {root}: this process's writer lease was removed (taken over?)") from None
    state = read_state(root, judge=False)
    if state is None or state.holder is None or state.holder.token != holder.token:
        current = read_state(root)
        now = "nobody holds it now" if current is None else f"it is now {current.describe()}"
        raise LeaseHeld(f"save root {root}: this process ({holder.describe()}) lost its writer lease; {now}")


def _take_over(root: Path, judged: LeaseState) -> None:
    moved = _move_aside(root)
    if moved is None:
        return  # another contender moved it first: retry the create
    tomb, state = moved
    if (state.inode, state.mtime_ns) != (judged.inode, judged.mtime_ns):
        _put_back(root, tomb)  # renewed (or replaced) after we judged it: it is live
        raise LeaseHeld(_refusal(root, state))
    tomb.unlink(missing_ok=True)
    log.warning("save root %s: took over a stale writer lease (%s)", root, judged.describe())


def _move_aside(root: Path) -> tuple[Path, LeaseState] | None:
    tomb = root / f"{LEASE}.aside-{secrets.token_hex(6)}"
    try:
        os.rename(root / LEASE, tomb)
    except FileNotFoundError:
        return None
    state = _state_of(tomb, root, judge=False)
    if state is None:
        return None
    return tomb, state


def _put_back(root: Path, tomb: Path) -> None:
    """Restore a lease moved aside by mistake, unless a new one exists already.

    It is linked back whole, same inode and mtime, so its holder's next renewal finds it.
    """
    try:
        os.link(tomb, root / LEASE, follow_symlinks=False)
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        data = tomb.read_bytes() if tomb.is_file() and not tomb.is_symlink() else b""
        _create_in_place(root / LEASE, data[:MAX_LEASE_BYTES])
    finally:
        tomb.unlink(missing_ok=True)


# What a killed creator (`.new-`) or taker-over (`.aside-`) leaves: the name, then 12 hex digits.
_LEFTOVER = re.compile(re.escape(LEASE) + r"\.(new|aside)-[0-9a-f]{12}")


def _sweep_leftovers(root: Path, timeout_s: float) -> None:
    """Remove side files of lease creations and takeovers killed midway, once past the timeout.

    Only the new holder sweeps, so no live creation or takeover races it; each lasts milliseconds.
    Nothing reads these files, so a failure is logged, not raised.
    """
    try:
        names = [name for name in os.listdir(root) if _LEFTOVER.fullmatch(name)]
        if not names:
            return
        now_ns = _fs_now_ns(root)
        for name in names:
            path = root / name
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and now_ns - info.st_mtime_ns > timeout_s * 1e9:
                path.unlink(missing_ok=True)
                log.info("save root %s: removed %s, left by a lease creation or takeover that was killed", root, name)
    except OSError as exc:
        log.warning("save root %s: could not sweep the lease's leftover side files: %s", root, exc)


def _refusal(root: Path, state: LeaseState) -> str:
    return (
        f"save root {root} has another writer: its lease is {state.describe()}. Refusing to write (two "
        "writers on one root break each other's saves): stop the other writer, save elsewhere, or wait "
        "until its lease is stale."
    )


def _fs_now_ns(root: Path) -> int:
    """'Now' by the file system's clock: the mtime of a probe file created in `root`."""
    probe = root / f"{LEASE}.clock-{secrets.token_hex(6)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError:
        return time.time_ns()  # a read-only root: our own clock is all there is
    try:
        return os.fstat(fd).st_mtime_ns
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs; a zombie is gone.

    A pid no process can have is gone too: 0, which `kill` takes for our own process group, or one
    past `pid_t`. So a lease file naming one is judged, never a crash of its reader.
    """
    if not 0 < pid <= _MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[-1].split()[0] != b"Z"  # a zombie is gone
    except (OSError, IndexError):
        return True


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()[:64]
    except OSError:
        return ""


# --------------------------------------------------------------------------- heartbeat


def _register(root: Path, timeout_s: float) -> None:
    global _heartbeat
    with _lock:
        _held[str(root)] = (os.getpid(), timeout_s)
        if _heartbeat is None or not _heartbeat.is_alive():
            _heartbeat = threading.Thread(target=_renew_forever, name="miles-lora-ckpt-lease", daemon=True)
            _heartbeat.start()
    _wake.set()


def _unregister(root: Path) -> None:
    with _lock:
        _held.pop(str(root), None)


def _renew_forever() -> None:
    pid = os.getpid()
    while os.getpid() == pid:
        with _lock:
            held = dict(_held)
        timeouts = [timeout for owner, timeout in held.values() if owner == pid]
        if _wake.wait(min(timeouts, default=settings.current().lease_timeout_s) / 4):
            _wake.clear()
            continue
        for root in held:
            if not holds(Path(root)):
                continue
            try:
                _renew(Path(root), me())
            except LeaseHeld as exc:
                _unregister(Path(root))
                log.warning("%s", exc)
            except OSError as exc:
                _unregister(Path(root))
                if Path(root).is_dir():
                    log.warning("save root %s: could not renew the writer lease: %s", root, exc)


def release_all() -> None:
    """Give up every lease this process holds, not a forked parent's; OSErrors are ignored.

    It runs at interpreter exit. A process that leaves through `os._exit` calls it first.
    """
    with _lock:
        roots = [root for root, (owner, _) in _held.items() if owner == os.getpid()]  # not a fork's parent's
    for root in roots:
        try:
            release(Path(root))
        except OSError:
            pass


atexit.register(release_all)
