"""Asynchronous single-LoRA save (opt-in): training is blocked only while the state is copied.

Collective, like the synchronous save; reads as phases::

    main thread (training blocked):
        wait for the previous save of this saver to commit (its failure is raised here, once)
        plan_save: plan -> agree -> layout -> agree -> this rank's files -> agree
        snapshot:  copy every tensor this rank writes into host memory (from a GPU: into pinned
                   memory on a side stream, `HostCopier`) -> agree
    background thread (training goes on):
        write_planned_save: protocol.save_generation (prepare -> write -> commit -> publish, each agreed)
        then (optional): the caller's collective step after the commit (e.g. Miles' tracker)

The snapshot holds exactly what the save writes: the adapter shards this rank writes, every saved
optimizer child's per-DP-rank slice of fp32 masters and moments (the lazily produced slices are
produced now), every rank's RNG states (`plan_save` captures them: training is still blocked), and,
as JSON, steps, param groups, scheduler and training state. After it returns,
training may change model and optimizer freely: the generation holds the state at the snapshot,
bit for bit. The price is host memory: a rank holds its whole share of the save until it is written
(the synchronous save streams it one tensor at a time).

Every collective of an `AsyncSaver` (the planning ones on the main thread too) runs on its own gloo
group, made when the saver is built (`Consensus.for_world`, collective): background consensus never
shares a group with training collectives or with other checkpoint calls (`Consensus.default()`) on
the main thread. The main thread never runs this group's collectives while the background thread
does (a save first waits for the previous one).

Every guarantee of the synchronous save holds: the protocol is the same (a crash at any point
leaves the previous generation loadable; nothing is published without every rank's agreement); a
failure on any rank raises the same `CheckpointError`, naming rank, phase and reason, on every rank,
at the next `PendingSave.wait()`, `AsyncSaver.wait()`, or save of the same saver; a dead or stalled
peer becomes that error after the saver's consensus timeout (never a hang). Process exit waits for
the background write to finish (its thread is not a daemon) and logs a failure nobody waited for.

Not supported asynchronously: the PEFT export (`peft=...`, it runs a collective Bridge export over
the live model), which the synchronous `save_lora_checkpoint` does. Loading from a root while a save
into it is pending: call `wait()` first (the Miles integration does).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from miles_lora_ckpt.core import settings
from miles_lora_ckpt.core.consensus import Consensus, attempt
from miles_lora_ckpt.core.safetensors_write import LazyTensor
from miles_lora_ckpt.savers.options import SaveOptions
from miles_lora_ckpt.savers.single_lora.save import PlannedSave, RankFile, plan_save, write_planned_save

log = logging.getLogger(__name__)

ThenFn = Callable[[str, Consensus], None]


class PendingSave:
    """One asynchronous save: `wait()` returns the committed generation directory or raises the
    save's collective `CheckpointError` (every call the same); `done()` does not block."""

    def __init__(self, iteration: int):
        self.iteration = iteration
        self.blocked_s = 0.0  # seconds `AsyncSaver.save` blocked its caller (previous save, plan, snapshot)
        self._finished = threading.Event()
        self._generation: str | None = None
        self._error: BaseException | None = None
        self._reported = False  # the error reached a caller (wait() raised it)

    def done(self) -> bool:
        return self._finished.is_set()

    def join(self) -> str | None:
        """Block until the save finished; its generation, or None if it failed. The error is left
        for `wait()` or the saver to raise (e.g. for a wait on one rank only)."""
        self._finished.wait()
        return self._generation

    def wait(self) -> str:
        """Block until the save committed (or failed); local: peers' background threads go on by themselves."""
        self._finished.wait()
        if self._error is not None:
            self._reported = True
            raise self._error
        return self._generation

    def _run(self, planned: PlannedSave, consensus: Consensus, save_dir, keep: int | None, then: ThenFn | None) -> None:
        try:
            generation = write_planned_save(planned, consensus, save_dir, keep=keep)
            if then is not None:
                then(generation, consensus)
            self._generation = generation
        except BaseException as exc:  # noqa: BLE001 - reported at wait(), save() or exit
            self._error = exc
        finally:
            planned.files.clear()  # release the snapshot's host memory
            self._finished.set()


class AsyncSaver:
    """Asynchronous single-LoRA saves, one at a time, on the saver's own consensus group.

    Constructing one is collective (every rank, at the same point: it makes a gloo group with
    `consensus_timeout_s`, or `timeout_s`), unless a `consensus` is given, which must be used by
    nothing else while a save is pending. Use one saver per process for a save root.
    """

    def __init__(self, consensus: Consensus | None = None, *, timeout_s: float | None = None):
        self.consensus = consensus or Consensus.for_world(timeout_s or settings.current().consensus_timeout_s)
        self._pending: PendingSave | None = None
        self._thread: threading.Thread | None = None
        _LIVE.append(self)

    def save(
        self,
        model,
        args,
        save_dir: str | os.PathLike,
        *,
        optimizer=None,
        opt_param_scheduler=None,
        iteration: int | None = None,
        keep: int | None = None,
        optimizer_children: Iterable[int] | None = None,
        then: ThenFn | None = None,
        data_state: dict | None = None,
    ) -> PendingSave:
        """Collective. `save_lora_checkpoint`'s arguments (no `peft`); returns the `PendingSave` once
        the state is copied (`submit`, with these keywords as one `SaveOptions`).

        First waits for this saver's previous save to commit and raises its error if nobody saw it
        yet (on every rank alike: the error is collective). `then(generation, consensus)` runs on
        every rank in the background after the commit, with the saver's consensus (its failures
        must go through `consensus.agree`); its error is the pending save's error.
        """
        options = SaveOptions(
            iteration=iteration, keep=keep, optimizer_children=optimizer_children, data_state=data_state
        )
        return self.submit(
            model, args, save_dir, options, optimizer=optimizer, opt_param_scheduler=opt_param_scheduler, then=then
        )

    def submit(
        self,
        model,
        args,
        save_dir: str | os.PathLike,
        options: SaveOptions,
        *,
        optimizer=None,
        opt_param_scheduler=None,
        then: ThenFn | None = None,
    ) -> PendingSave:
        """Collective. `save` with its options as one value (`options.peft` must be None): waits for
        the previous save, plans and snapshots (training blocked), then writes in the background;
        returns the `PendingSave`. Raises the previous save's unseen error, or the same
        CheckpointError on every rank when planning or the snapshot fails."""
        started = time.perf_counter()
        self.wait()
        consensus = self.consensus
        planned = plan_save(
            model, args, consensus, options, optimizer=optimizer, opt_param_scheduler=opt_param_scheduler
        )
        snapped = attempt(snapshot, planned)
        consensus.agree("snapshot", snapped.map(lambda _: None))
        pending = PendingSave(planned.iteration)
        self._thread = threading.Thread(
            target=pending._run,
            args=(snapped.value, consensus, save_dir, options.keep, then),
            name=f"miles-lora-ckpt-save-{planned.iteration}",
            daemon=False,  # process exit waits for the write
        )
        self._pending = pending
        pending.blocked_s = time.perf_counter() - started
        self._thread.start()
        return pending

    @property
    def pending(self) -> PendingSave | None:
        """The save in flight or finished but not yet waited for by the saver."""
        return self._pending

    def wait(self) -> str | None:
        """Wait for the previous save; return its generation (None if there was none), or raise its
        error unless `PendingSave.wait()` already raised it. Local (no collective)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        seen = pending._reported  # its error already reached a caller through PendingSave.wait()
        try:
            return pending.wait()
        except BaseException:
            if seen:
                return None
            raise

    def _wait_at_exit(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        reported = pending._reported
        try:
            pending.wait()
        except BaseException as exc:  # noqa: BLE001 - at exit: log it, there is nobody to raise to
            if not reported:
                log.error("miles-lora-ckpt: the asynchronous save of iteration %d failed: %s", pending.iteration, exc)


def snapshot(planned: PlannedSave) -> PlannedSave:
    """Local: `planned` with every tensor it writes copied into host memory (lazily produced
    optimizer slices produced now: fresh tensors; parameters and anything else copied), so that
    training may change model and optimizer while it is written. JSON parts are already copies.

    Tensors on a GPU are copied into pinned host memory on a side stream (`HostCopier`); it
    returns once every copy has landed."""
    if planned.peft_step is not None:
        raise ValueError("the asynchronous save cannot export PEFT (it runs over the live model): save synchronously")
    copier = HostCopier()
    files = {}
    for relpath, file in planned.files.items():
        files[relpath] = RankFile(
            file.binding, {name: copier.copy(name, t) for name, t in file.tensors.items()}, file.blocks
        )
    copier.finish()
    planned.files = files
    return planned


class HostCopier:
    """Copies tensors into host memory for a snapshot; `finish()` returns once every copy landed.

    A CPU tensor is copied as before (a lazily produced one is produced: already a fresh tensor).
    A CUDA tensor goes into a pinned host buffer, copied without blocking on a side stream of its
    device. That stream first waits for the work already queued on the current stream (training's
    last writes), so the copy sees them. The source is recorded on the side stream, so that a
    lazily produced temporary's memory is not reused before its copy ran. Copies thus overlap the
    production of the next slices on the current stream. Pinned buffers come from torch's caching
    host allocator, reused from one save to the next.
    """

    def __init__(self):
        self.streams: dict = {}  # device -> its side stream (none until a CUDA tensor is copied)
        self.device_bytes = 0  # bytes copied from a GPU

    def copy(self, name: str, tensor):
        """A host copy of `tensor` (a `LazyTensor` is produced first, and checked against its announced shape)."""
        if isinstance(tensor, LazyTensor):
            produced = tensor.produced(name)
            if not produced.is_cuda:
                return produced.detach().to("cpu")  # a fresh tensor (on CPU already: no second copy)
            return self._from_device(produced.detach())
        if not tensor.is_cuda:
            return tensor.detach().to("cpu", copy=True)
        return self._from_device(tensor.detach())

    def _from_device(self, tensor):
        import torch

        stream = self.streams.get(tensor.device)
        if stream is None:
            stream = self.streams[tensor.device] = torch.cuda.Stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)
        self.device_bytes += tensor.numel() * tensor.element_size()
        return host

    def finish(self) -> None:
        """Block until every copy queued on a side stream has landed in host memory."""
        for stream in self.streams.values():
            stream.synchronize()


# --------------------------------------------------------------------------- process-wide saver

_LIVE: list[AsyncSaver] = []  # every saver made in this process (exit waits for each one's save)
_DEFAULT: AsyncSaver | None = None


def default_saver() -> AsyncSaver:
    """The process-wide saver, made on first use (so first use is collective)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = AsyncSaver()
    return _DEFAULT


def save_lora_checkpoint_async(model, args, save_dir: str | os.PathLike, **kwargs) -> PendingSave:
    """Collective. `save_lora_checkpoint` that returns once the state is copied (`AsyncSaver.save`,
    on the process-wide saver, whose keywords it takes: `optimizer`, `opt_param_scheduler`,
    `iteration`, `keep`, `optimizer_children`, `then`, `data_state`); returns the `PendingSave`, whose
    `.wait()` returns the committed generation directory or raises the save's CheckpointError.
    Raises as `AsyncSaver.save`."""
    return default_saver().save(model, args, save_dir, **kwargs)


def wait_all() -> None:
    """Wait for every live saver's pending save (raising the first unseen error)."""
    for saver in list(_LIVE):
        saver.wait()


@atexit.register
def _wait_at_exit() -> None:
    for saver in list(_LIVE):
        saver._wait_at_exit()
