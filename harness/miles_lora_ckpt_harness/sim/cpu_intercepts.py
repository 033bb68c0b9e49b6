"""Every interception the CPU harness needs to drive the real megatron-core DistributedOptimizer.

These items live here, and nothing else in the package patches torch or megatron:

* Device stand-ins, needed ONLY because the harness machine has no GPU. megatron-core allocates
  tensors on ``'cuda'``, asks ``torch.cuda`` for devices, streams, events and RNG states, and
  checks ``Tensor.type()`` against ``'torch.cuda.XTensor'`` strings. Gloo itself needs nothing.
* Fixes for three megatron-core bugs on the torch.optim fallback path (no Transformer Engine, no
  Apex), present in 0.16.1 and 0.19.2. Production code runs with TE/Apex, where these paths are
  not taken; a test that relies on a fix must say so.
* One gloo limitation: ``LayerWiseDistributedOptimizer`` all-gathers updated parameters with
  uneven sizes per rank, which NCCL accepts and gloo refuses; the harness pads to the largest
  size and slices back. Tests of layer-wise chains rely on it and say so.
* ``install_typing_override``: Python 3.11 lacks ``typing.override``, which emerging-optimizers
  (megatron 0.19's Lion and Muon) imports.
* Speed only: ``torch.compile`` is off in harness workers. emerging-optimizers compiles Lion's update
  function with inductor, which on CPU costs seconds per process and per new shape; run eagerly, it
  is the same function, and every run it is compared with runs the same way.

Nothing is active at import. ``install()`` activates everything in the calling process (and the
device mode in the calling thread); it is idempotent and is called only by harness workers
(``miles_lora_ckpt_harness.sim.worker``). ``active()`` tells whether it ran.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch.overrides import TorchFunctionMode

WORKER_ENV = "MILES_LORA_CKPT_SIM_WORKER"  # set by sim.launch for its worker processes only

_installed = False
_device_mode: TorchFunctionMode | None = None


def install() -> None:
    """Activate every interception in this harness worker process; a second call does nothing.

    Raises ``RuntimeError`` outside a worker started by ``sim.launch.run_workers``.
    """
    global _installed, _device_mode
    if _installed:
        return
    if os.environ.get(WORKER_ENV) != "1":
        raise RuntimeError(f"cpu_intercepts.install() runs only in harness workers ({WORKER_ENV}=1)")
    install_typing_override()
    import megatron.core  # noqa: F401  (patch targets must exist before we patch them)

    _install_torch_cuda_shims()
    _install_megatron_rng_shims()
    _install_fallback_path_fixes()
    _install_layer_wise_gloo_allgather()
    _run_compiled_functions_eagerly()
    _device_mode = _CpuDeviceMode()
    _device_mode.__enter__()  # stays pushed for the life of the worker (modes are per thread)
    _installed = True


def install_typing_override() -> None:
    """Python 3.11 only: give ``typing`` the ``override`` decorator of 3.12 (from typing_extensions).

    emerging-optimizers 0.3.0 (megatron 0.19's Lion and Muon) declares Python >= 3.12 and imports
    ``from typing import override``; megatron-core 0.19 imports it unguarded once it is installed.
    The CPU harness runs on 3.11, so every harness process (workers, and the test process itself)
    calls this before importing megatron. A no-op on 3.12+, and never called by production code.
    """
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def active() -> bool:
    """True once ``install()`` ran in this process and the device mode is pushed."""
    return _installed and _device_mode is not None


def enter_device_mode_in_this_thread() -> None:
    """Push the device mode in another thread: torch function modes are per thread.

    ``install()`` pushes it in its own thread only; a worker thread that runs megatron code (an
    async checkpoint writer, say) calls this first.
    """
    if not _installed:
        raise RuntimeError("cpu_intercepts.install() has not run in this process")
    _CpuDeviceMode().__enter__()


# --------------------------------------------------------------------------------------------
# Device stand-ins (only because there is no GPU)
# --------------------------------------------------------------------------------------------


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # torch.cuda.current_device() returns an int
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_type_name(name: str) -> str:
    return name.replace("torch.cuda.", "torch.", 1)


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA devices to CPU and makes CPU tensors report CUDA type names.

    - ``device='cuda'`` / ``'cuda:N'`` / ``torch.device('cuda')`` / an int device in factory calls
      and ``Tensor.to``: optimizer constructors, clip_grads (grad norm), utils, grad buffers.
    - ``Tensor.type()`` with no argument: distrib_optimizer and clip_grads accept only
      ``'torch.cuda.{Half,BFloat16,Float}Tensor'`` and raise ``TypeError`` otherwise.
    - ``Tensor.cuda()``: optimizer state reload paths move tensors back to the GPU.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type:
            return _tensor_type(func, args, kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _tensor_type(func, args, kwargs):
    dtype = args[1] if len(args) > 1 else kwargs.pop("dtype", None)
    if dtype is None:
        name = func(args[0])
        return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
    if isinstance(dtype, str):
        dtype = _cpu_type_name(dtype)
    return func(args[0], dtype, *args[2:], **kwargs)


class _NullStream:
    """Stands in for torch.cuda.Stream / current_stream(): CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _NullEvent:
    """Stands in for torch.cuda.Event (timers, stream ordering)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cpu_get_rng_state(device="cuda"):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device="cuda"):
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed):
    # Not torch.manual_seed: that one calls torch.cuda.manual_seed_all, i.e. this shim.
    torch.default_generator.manual_seed(int(seed))


def _install_torch_cuda_shims() -> None:
    """torch.cuda entry points megatron calls; without them: "Torch not compiled with CUDA"."""
    shims = {
        # DDP grad buffers, dummy optimizer state on load, TP layers: device=current_device().
        "current_device": lambda: 0,
        # start_grad_sync / finish_grad_sync order communication against the compute stream.
        "current_stream": lambda device=None: _NullStream(),
        "default_stream": lambda device=None: _NullStream(),
        "Stream": _NullStream,
        "Event": _NullEvent,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "set_device": lambda device: None,
        # The RNG tracker (model_parallel_cuda_manual_seed) seeds and forks the "GPU" generator;
        # the CPU generator plays that role.
        "get_rng_state": _cpu_get_rng_state,
        "set_rng_state": _cpu_set_rng_state,
        "manual_seed": _cpu_manual_seed,
        "manual_seed_all": _cpu_manual_seed,
    }
    for name, shim in shims.items():
        setattr(torch.cuda, name, shim)
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):
        setattr(torch.cuda.random, name, shims[name])


def _install_megatron_rng_shims() -> None:
    """megatron's private RNG getters/setters index torch.cuda.default_generators directly."""
    from megatron.core.tensor_parallel import random as mp_random

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    mp_random._set_cuda_rng_state = set_state
    mp_random._get_cuda_rng_state = get_state


# --------------------------------------------------------------------------------------------
# Fixes for megatron-core bugs on the torch.optim fallback path (0.16.1 and 0.19.2)
# --------------------------------------------------------------------------------------------


def _install_fallback_path_fixes() -> None:
    from megatron.core.optimizer import distrib_optimizer as dopt

    cls = dopt.DistributedOptimizer
    cls._set_main_param_and_optimizer_states = _skip_step_on_set(cls._set_main_param_and_optimizer_states)
    cls.load_state_dict = _unshare_step_after_load(cls.load_state_dict)
    cls.state_dict = _step_zero_when_state_empty(cls.state_dict, dopt)


def _skip_step_on_set(original):
    """Bug 1: ``KeyError: 'step'`` when loading dp-zero state.

    megatron copies every tensor of the torch AdamW state, ``step`` included, from a payload that
    has no ``step``. ``step`` is restored by ``load_state_dict``, so it is not copied here.
    """

    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destinations = {"param": main_param, **self.optimizer.state[main_param]}
        for key, destination in destinations.items():
            if key == "step" or not isinstance(destination, torch.Tensor):
                continue
            if isinstance(tensors[key], torch.Tensor):  # 0.19 skips non-tensor payload entries too
                destination.copy_(tensors[key])

    return set_states


def _unshare_step_after_load(original):
    """Bug 2: after ``load_state_dict`` every param's ``step`` is the SAME 0-d tensor.

    torch AdamW increments it once per param, so 2 resumed steps over 3 params count 7 instead of
    5 and resumed runs diverge. Each param gets its own clone.
    """

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        original(self, state_dict)
        if self.optimizer is None:
            return
        for param_state in self.optimizer.state.values():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = param_state["step"].clone()

    return load_state_dict


def _step_zero_when_state_empty(original, dopt_module):
    """Bug 3: ``assert len(steps) == 1`` in ``state_dict()`` when the inner state is empty.

    That happens on a fresh optimizer and on a DP rank whose shard is only padding (tiny models at
    DP>=3). With no per-param state there is no step to agree on: report step 0.
    """

    @functools.wraps(original)
    def state_dict(self):
        inner = self.optimizer
        if dopt_module.HAVE_APEX_OR_TE or inner is None or len(inner.state) > 0:
            return original(self)
        unpatched = inner.state_dict

        def with_step_zero():
            inner_sd = unpatched()
            inner_sd["state"] = {0: {"step": torch.tensor(0.0)}}  # read for 'step' only, then dropped
            return inner_sd

        inner.state_dict = with_step_zero
        try:
            return original(self)
        finally:
            del inner.state_dict

    return state_dict


def _run_compiled_functions_eagerly() -> None:
    """torch.compile'd functions (emerging-optimizers' Lion update) run as plain Python here."""
    import torch._dynamo

    torch._dynamo.config.disable = True


# --------------------------------------------------------------------------------------------
# gloo: LayerWiseDistributedOptimizer's uneven all-gather (0.16.1 and 0.19.2)
# --------------------------------------------------------------------------------------------


def _install_layer_wise_gloo_allgather() -> None:
    """``ProcessGroupGloo::allgather: invalid tensor size`` after every layer-wise step.

    megatron gathers each rank's flattened updated parameters with per-rank sizes (whole
    parameters are sharded unevenly); NCCL accepts that, gloo needs equal sizes. Each rank's
    parameters are padded to the largest rank's size, gathered, and unpadded back into the model.
    """
    from megatron.core.optimizer import layer_wise_optimizer as lwo

    lwo.LayerWiseDistributedOptimizer.allgather_params = _padded_allgather_params


@torch.no_grad()
def _padded_allgather_params(self) -> None:
    collection = self.pg_collection
    if collection is None:
        return
    dp_cp = getattr(self, "dp_cp", None) or collection.dp_cp  # 0.19 keeps the groups on self
    expt_dp = getattr(self, "expt_dp", None) or collection.expt_dp
    for params_list, group in ((self.dp_cp_params_list, dp_cp), (self.expt_dp_params_list, expt_dp)):
        if params_list:
            _padded_allgather(params_list, group)


def _padded_allgather(params_list: list[list[torch.Tensor]], group) -> None:
    import torch.distributed as dist

    sizes = [sum(p.numel() for p in params) for params in params_list]
    if max(sizes) == 0:
        return
    rank = dist.get_rank(group)
    sample = next(p for params in params_list for p in params)
    local = torch.zeros(max(sizes), dtype=sample.dtype, device=sample.device)
    offset = 0
    for param in params_list[rank]:
        local[offset : offset + param.numel()] = param.data.reshape(-1)
        offset += param.numel()
    gathered = [torch.empty_like(local) for _ in params_list]
    dist.all_gather(gathered, local, group=group)
    for source, params in enumerate(params_list):
        if source == rank:
            continue
        offset = 0
        for param in params:
            param.data.copy_(gathered[source][offset : offset + param.numel()].view_as(param))
            offset += param.numel()
