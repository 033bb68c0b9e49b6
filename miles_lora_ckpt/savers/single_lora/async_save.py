"""Asynchronous single-LoRA save (opt-in): training is blocked only while the state is copied.

Collective, like the synchronous save; reads as phases::

    main thread (training blocked):
        wait for the previous save of this saver to commit (its failure is raised here, once)
        plan_save: plan -> agree -> layout -> agree -> this rank's files -> agree
        snapshot:  copy every tensor this rank writes into host memory (from a GPU: into pinned
                   memory on a side stream, `HostCopier`) -> agree
    background thread (training goes on):
        write_planned_save: protocol.save_generation (prepare -> write -> commit -> publish)
        then (optional): the caller's collective step after the commit (e.g. Miles' tracker)

The snapshot holds exactly what the save writes, so training may then change model and optimizer
freely. The price is host memory: a rank holds its whole share of the save until it is written.
Every collective runs on the saver's own gloo group, never shared with training or with other
checkpoint calls. Every guarantee of the synchronous save holds, and a failure is raised on every
rank at the next wait or save. The PEFT export is not asynchronous: it runs over the live model.
The guide is docs/python-api.md, "Asynchronous save".
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

__all__ = ["AsyncSaver", "HostCopier", "PendingSave", "save_lora_checkpoint_async", "snapshot"]


class PendingSave:
    """One asynchronous save, as `AsyncSaver.save` returns it.

    `wait()` returns the committed generation directory or raises the save's collective
    `CheckpointError`, the same on every call. `done()` does not block.
    """

    def __init__(self, iteration: int):
        self.iteration = iteration
        self.blocked_s = 0.0  # seconds `AsyncSaver.save` blocked its caller: previous save, plan, snapshot
        self._finished = threading.Event()
        self._generation: str | None = None
        self._error: BaseException | None = None
        self._reported = False  # the error reached a caller (wait() raised it)

    def done(self) -> bool:
        """Whether the save finished, committed or failed."""
        return self._finished.is_set()

    def join(self) -> str | None:
        """Block until the save finished; return its generation, or None if it failed.

        The error is left for `wait()` or the saver to raise, e.g. for a wait on one rank only.
        """
        self._finished.wait()
        return self._generation

    def wait(self) -> str:
        """Block until the save committed; return its generation directory or raise its error.

        Local: peers' background threads go on by themselves.
        """
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

    Constructing one is collective: every rank makes, at the same point, a gloo group with
    `consensus_timeout_s` (or `timeout_s`). A given `consensus` is used instead; nothing else may
    use it while a save is pending. Use one saver per process for a save root.
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
        """Collective. Save with `save_lora_checkpoint`'s arguments, less `peft`.

        Returns the `PendingSave` once the state is copied. It is `submit` with these keywords as
        one `SaveOptions`, and raises as `submit` does.

        `then(generation, consensus)` runs on every rank in the background after the commit, with
        the saver's consensus; its failures must go through `consensus.agree`. Its error is the
        pending save's error.
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
        """Collective. `save` with its options as one value; `options.peft` must be None.

        Waits for the previous save, plans and snapshots while training is blocked, then writes in
        the background. Returns the `PendingSave`. Raises the previous save's unseen error, alike
        on every rank. Raises the same CheckpointError on every rank when planning or the snapshot
        fails.
        """
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
        """Local. Wait for the previous save and return its generation, or None if there was none.

        Raises its error unless `PendingSave.wait()` already raised it.
        """
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
    """Local. `planned` with every tensor it writes copied into host memory, so training may go on.

    Lazily produced optimizer slices are produced now, as fresh tensors. JSON parts are already
    copies. Tensors on a GPU go into pinned host memory on a side stream (`HostCopier`). Returns
    once every copy has landed. Raises ValueError for a save with a PEFT export.
    """
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

    A CPU tensor is copied; a lazily produced one is produced, already a fresh tensor. A CUDA
    tensor goes into a pinned host buffer, copied without blocking on a side stream of its device.
    That stream first waits for the work queued on the current stream, so the copy sees training's
    last writes. The source is recorded on the side stream, so a lazily produced temporary's memory
    is not reused before its copy ran. Copies thus overlap the production of the next slices.
    Pinned buffers come from torch's caching host allocator, reused from one save to the next.
    """

    def __init__(self):
        self.streams: dict = {}  # device -> its side stream (none until a CUDA tensor is copied)
        self.device_bytes = 0  # bytes copied from a GPU

    def copy(self, name: str, tensor):
        """A host copy of `tensor`, named `name`.

        A `LazyTensor` is produced first and checked against its announced shape.
        """
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
    """Collective. `save_lora_checkpoint` that returns once the state is copied.

    It is `AsyncSaver.save` on the process-wide saver, and takes its keywords: `optimizer`,
    `opt_param_scheduler`, `iteration`, `keep`, `optimizer_children`, `then`, `data_state`.
    Returns the `PendingSave`; its `.wait()` returns the committed generation directory or raises
    the save's CheckpointError. Raises as `AsyncSaver.save`.
    """
    return default_saver().save(model, args, save_dir, **kwargs)


def wait_all() -> None:
    """Wait for every live saver's pending save (raising the first unseen error)."""
    for saver in list(_LIVE):
        saver.wait()


@atexit.register
def _wait_at_exit() -> None:
    for saver in list(_LIVE):
        saver._wait_at_exit()
