"""Every in-process shim the real Megatron-Bridge 0.6.2 needs to import and run on this CPU machine.

The Bridge tier (`make tier-bridge`) installs `megatron-bridge==0.6.2` next to megatron-core 0.19.2
(docs/testing.md, "The Bridge tier"). Its wheel declares Python >= 3.12 and expects
Transformer Engine; three shims, each for the reason given, make it import on Python 3.11 without
TE. Nothing else in the package patches Bridge:

1. ``typing.override`` (Python 3.12's): Bridge and emerging-optimizers import it unguarded; on 3.11 it
   comes from typing_extensions (`cpu_intercepts.install_typing_override`, the same shim).
2. A fake ``transformer_engine.pytorch`` seen ONLY by ``megatron.bridge.peft.lora_layers``'s own
   ``import transformer_engine.pytorch as te`` while Bridge is imported: that module imports TE
   unconditionally and evaluates ``te.ops.Sequential`` (return annotations), ``te.Linear`` and
   ``te.LayerNormLinear`` at class-definition time. The fake holds empty placeholder classes (no
   instance ever matches them). A wrapper of ``builtins.__import__`` hands it out to
   that one module's import statement only; it is never put in ``sys.modules``. So every other
   module, megatron-core's ``HAVE_TE`` probes included, still finds no TE. The wrapper is removed
   once Bridge is imported (``fake_te_present()`` is False).
3. Bridge's own ``HAVE_TE`` flags (``megatron.bridge.peft.utils`` and ``...peft.module_matcher``)
   forced to False. They test only that TE class names import from
   ``megatron.core.extensions.transformer_engine``, where megatron-core 0.19 defines placeholders
   without TE. Bridge's LoRA would then call ``isinstance(m, <placeholder>)`` and crash with
   ``isinstance() arg 2 must be a type``.

A megatron forward pass also needs the harness's device stand-ins (CUDA RNG and devices), which
`cpu_intercepts.install()` provides; building, LoRA and export need none.

``install()`` runs only in harness workers (``MILES_LORA_CKPT_SIM_WORKER=1``, set by ``sim.launch``)
and refuses elsewhere; it is idempotent. Production code never imports this module.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import os
import sys
import types

WORKER_ENV = "MILES_LORA_CKPT_SIM_WORKER"  # the same flag cpu_intercepts.install() requires
BRIDGE_VERSION = "0.6.2"  # the release the Bridge tier installs and these shims are written for
LORA_LAYERS = "megatron.bridge.peft.lora_layers"
_TE_NAMES = ("transformer_engine", "transformer_engine.pytorch")

_installed = False


def available() -> bool:
    """True when a real `megatron.bridge` is on the path (no import: the test process may ask)."""
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except ModuleNotFoundError:
        return False


def install() -> None:
    """Apply the three shims and import Bridge (its LoRA module included) in this harness worker.

    Raises RuntimeError outside a harness worker, ModuleNotFoundError where Bridge is not installed.
    """
    global _installed
    if _installed:
        return
    if os.environ.get(WORKER_ENV) != "1":
        raise RuntimeError(f"bridge_shims.install() runs only in harness workers ({WORKER_ENV}=1)")
    if not available():
        raise ModuleNotFoundError("megatron.bridge is not installed here (make tier-bridge installs 0.6.2)")
    from miles_lora_ckpt_harness.sim.cpu_intercepts import install_typing_override

    install_typing_override()  # shim 1
    _import_lora_layers_with_fake_te()  # shim 2
    _force_bridge_have_te_false()  # shim 3
    importlib.import_module("megatron.bridge")
    _installed = True


def installed() -> bool:
    """True once `install()` ran in this process."""
    return _installed


def fake_te_present() -> bool:
    """True when any `transformer_engine` module is in `sys.modules` (must be False after install)."""
    return any(name == "transformer_engine" or name.startswith("transformer_engine.") for name in sys.modules)


def _fake_transformer_engine() -> dict[str, types.ModuleType]:
    """Placeholder TE modules with just the names lora_layers evaluates while its classes are defined."""
    root = types.ModuleType("transformer_engine", "FAKE transformer_engine (sim.bridge_shims; import time only)")
    pytorch = types.ModuleType("transformer_engine.pytorch", "FAKE transformer_engine.pytorch (sim.bridge_shims)")
    ops = types.ModuleType("transformer_engine.pytorch.ops")
    for name in ("Sequential", "Linear", "LayerNorm", "RMSNorm", "Quantize", "MakeExtraOutput", "Dropout"):
        setattr(ops, name, type(name, (), {"__module__": ops.__name__}))
    for name in ("Linear", "LayerNormLinear"):
        setattr(pytorch, name, type(name, (), {"__module__": pytorch.__name__}))
    pytorch.ops = ops
    root.pytorch = pytorch
    return {"transformer_engine": root, "transformer_engine.pytorch": pytorch}


def _import_lora_layers_with_fake_te() -> None:
    if LORA_LAYERS in sys.modules:
        return
    if fake_te_present() or importlib.util.find_spec("transformer_engine") is not None:
        raise RuntimeError("a transformer_engine is present here; the fake one would shadow it")
    fake = _fake_transformer_engine()
    original = builtins.__import__

    def only_for_lora_layers(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.split(".")[0] == "transformer_engine" and (globals or {}).get("__name__") == LORA_LAYERS:
            return fake[name] if fromlist else fake["transformer_engine"]
        return original(name, globals, locals, fromlist, level)

    builtins.__import__ = only_for_lora_layers
    try:
        importlib.import_module(LORA_LAYERS)
    finally:
        builtins.__import__ = original


def _force_bridge_have_te_false() -> None:
    for name in ("megatron.bridge.peft.utils", "megatron.bridge.peft.module_matcher"):
        module = importlib.import_module(name)
        module.HAVE_TE = False
