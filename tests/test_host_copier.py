"""The asynchronous save's host copy (`async_save.HostCopier`): CPU tensors are copied as before,
without touching CUDA; a CUDA tensor goes into pinned memory on a side stream that first waits for
the current stream, and `finish()` waits for that stream.

No GPU is available to CI: the CUDA branch's order of calls is checked with CPU tensors that say
they are on CUDA and a recording stand-in for `torch.cuda`'s streams (the GPU check,
`make gpu-check`, runs the real thing)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from miles_lora_ckpt.core.safetensors_write import LazyTensor
from miles_lora_ckpt.savers.single_lora import async_save
from miles_lora_ckpt.savers.single_lora.async_save import HostCopier


def _no_cuda(*args, **kwargs):
    raise AssertionError("the CPU path touched CUDA")


def test_cpu_tensors_are_copied_as_before_and_never_touch_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", _no_cuda)
    monkeypatch.setattr(torch.cuda, "current_stream", _no_cuda)
    source = torch.arange(6, dtype=torch.float32)
    lazy = LazyTensor(torch.bfloat16, (3,), lambda: torch.ones(3, dtype=torch.bfloat16))
    copier = HostCopier()
    copy, produced = copier.copy("a", source), copier.copy("b", lazy)
    copier.finish()
    source += 1  # training goes on: the copy keeps the snapshot's bits
    assert copy.tolist() == [0, 1, 2, 3, 4, 5] and copy.data_ptr() != source.data_ptr()
    assert produced.dtype == torch.bfloat16 and produced.tolist() == [1, 1, 1]
    assert copier.streams == {} and copier.device_bytes == 0


def test_a_lazy_tensor_that_breaks_its_announcement_is_refused_by_name():
    lazy = LazyTensor(torch.float32, (4,), lambda: torch.zeros(3))
    with pytest.raises(ValueError, match=r"tensor 'opt.exp_avg': produced torch.float32\[3\], announced"):
        HostCopier().copy("opt.exp_avg", lazy)


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on cuda:0 and logs `record_stream`."""

    log: list = []

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return "cuda:0"

    def record_stream(self, stream):
        _OnCuda.log.append(("record_stream", stream.name))


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))

    def synchronize(self):
        self.log.append(("synchronize", self.name))


def test_a_cuda_tensor_goes_to_pinned_memory_on_a_side_stream_after_the_current_one(monkeypatch):
    log: list = []
    _OnCuda.log = log
    current = _Stream("current", log)
    made: list[_Stream] = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(_Stream(f"side:{device}", log)) or made[-1])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: current)

    @contextlib.contextmanager
    def on(stream):
        log.append(("enter", stream.name))
        yield
        log.append(("exit", stream.name))

    monkeypatch.setattr(torch.cuda, "stream", on)
    real_empty = torch.empty

    def empty(*shape, dtype=None, pin_memory=False):
        log.append(("empty", pin_memory))
        return real_empty(*shape, dtype=dtype)

    monkeypatch.setattr(torch, "empty", empty)
    weights = torch.arange(4, dtype=torch.float32).as_subclass(_OnCuda)
    moments = torch.full((2,), 7.0).as_subclass(_OnCuda)
    lazy = LazyTensor(torch.float32, (2,), lambda: moments)
    copier = HostCopier()
    first, second = copier.copy("w", weights), copier.copy("m", lazy)
    assert ("synchronize", "side:cuda:0") not in log  # the copies are queued, not yet waited for
    copier.finish()
    assert [type(t) for t in (first, second)] == [torch.Tensor, torch.Tensor]
    assert first.tolist() == [0, 1, 2, 3] and second.tolist() == [7, 7]
    assert len(made) == 1 and copier.device_bytes == 24  # one side stream for the device
    per_copy = [
        ("wait", "side:cuda:0", "current"),  # training's queued writes come first
        ("empty", True),  # pinned host memory
        ("enter", "side:cuda:0"),
        ("exit", "side:cuda:0"),
        ("record_stream", "side:cuda:0"),  # the source lives until its copy ran
    ]
    assert log == [*per_copy, *per_copy, ("synchronize", "side:cuda:0")]


def test_snapshot_uses_the_copier(monkeypatch):
    finished = []
    monkeypatch.setattr(HostCopier, "finish", lambda self: finished.append(self))
    from miles_lora_ckpt.savers.single_lora.save import RankFile

    planned = type("Planned", (), {})()
    planned.peft_step = None
    planned.files = {"f": RankFile({}, {"t": torch.ones(2)}, False)}
    assert async_save.snapshot(planned).files["f"].tensors["t"].tolist() == [1, 1]
    assert len(finished) == 1
