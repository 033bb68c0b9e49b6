"""A TEST DOUBLE of Megatron-Bridge's adapter export, for the CPU harness. It is not Megatron-Bridge.

The real Megatron-Bridge 0.6.2 runs here only in the Bridge tier (`make tier-bridge`, with the shims
of `sim.bridge_shims`); tiers 1 and 2 and the demos drive the PEFT export path through this double,
written from Bridge's documented contract. Where the two overlap (NVIDIA's two-item export of a
dense Qwen2/Llama decoder at TP=1, TP=2 and PP=2), `tests/test_bridge_real.py` compares them on the
same real-Bridge-built models. They give the same names, each once, the same values, and the same
order within each Megatron module; a negative control shows an altered double fails. What the double
has that 0.6.2 lacks, and why it stays:

- the Miles fork's shape (`ForkAutoBridgeDouble`): three-item `(hf_name, weight, megatron_name)`
  tuples and the fork's narrower signature (the fork, radixark/Megatron-Bridge@7f0fb345, is not
  installable here);
- `multi_lora_layers.expose_adapter_slot` (only on Bridge `main`, not in 0.6.2);
- `expand_shared_outer` in the export signature (Bridge `main`; 0.6.2 has no such parameter).

The real Bridge is the default wherever it can run the scenario. The double is still used where
it cannot, each for its reason:

- `tests/test_peft_export.py`: the harness's Qwen2-shaped model, whose LoRA 0.6.2 cannot export;
  the fp64 reference; the fork's tuples.
- the Miles stand-in launches of `tests/test_miles_peft.py` in tiers 1 and 2: the bf16 harness
  model, the fork's tuples, a Miles without Bridge. In the Bridge tier two of them run on the real
  Bridge.
- the multi-LoRA slot exports (`expose_adapter_slot`).
- the real-Miles launches (`realmiles`), on megatron-core 0.16.1, with which 0.6.2 does not import.

Every remaining difference from the real 0.6.2 where they overlap:

- Order of modules: 0.6.2 yields each layer's modules in Megatron-name order (`mlp.linear_fc1`,
  `mlp.linear_fc2`, `self_attention.linear_proj`, `self_attention.linear_qkv`); the double in block
  order (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`). Within a module both yield
  `lora_A` before `lora_B`, q/k/v and gate/up in that order. The plugin never depends on the order
  (ranks only have to agree with each other).
- Collectives: the double exchanges JSON lists over the PP group, all-gathers TP shards and
  broadcasts from the owning stage; 0.6.2 runs its own gathers. The export's fault matrix runs on
  the real 0.6.2 in `tests/test_bridge_real.py`: a raise at every phase on every rank, and a rank
  killed inside the collective export.
- `from_hf_pretrained` reads `config.json` only (no weights), and maps only `Qwen2ForCausalLM` and
  `LlamaForCausalLM` dense decoders: no MoE experts, no virtual pipeline chunks, no other families.
- `peft_bridge` helpers raise on 3-D expert stacks (0.6.2 packs them).
- Compared at fp32 only (the real-Bridge tests build fp32 models); the double yields each
  parameter's own dtype.

Its parts, written from Bridge's documentation:

- `AutoBridgeDouble.export_adapter_weights(model, cpu=True, show_progress=True, ...)` is a lazy,
  collective generator. Pipeline stages exchange what they hold, and the tensor-parallel shards of
  every adapter tensor are all-gathered over the TP group (gloo here). The owning stage broadcasts
  to the others, and every rank yields the same full tensors in the same order. Fused QKV is
  split into `q_proj`/`k_proj`/`v_proj` (one shared `lora_A`), fused fc1 into `gate_proj`/`up_proj`.
  NVIDIA's shape yields `(param_name, weight)` named tuples; the fork's (`ForkAutoBridgeDouble`)
  yields `(hf_name, weight, megatron_name)` and has the fork's narrower signature.
- `peft_bridge`: the four documented pure conversion helpers.
- `multi_lora_layers.expose_adapter_slot(model, idx)`: one slot of the harness's multi-LoRA slot
  model shown as a single-LoRA `.adapter` while it is open (what Bridge's export of a slot walks).

`install()` puts the double into `sys.modules` as `megatron.bridge` (with
`megatron.bridge.models.conversion.peft_bridge` unless `peft_helpers=False`), and only inside a
harness worker process (`sim.launch` sets `MILES_LORA_CKPT_SIM_WORKER=1`) where no real Bridge
imports; anywhere else it raises. Production code never imports this package.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

from miles_lora_ckpt_harness.bridge_double import peft_bridge
from miles_lora_ckpt_harness.bridge_double.export import VARIANTS, AutoBridgeDouble, ForkAutoBridgeDouble

__all__ = ["VARIANTS", "AutoBridgeDouble", "ForkAutoBridgeDouble", "install", "installed", "uninstall"]

WORKER_ENV = "MILES_LORA_CKPT_SIM_WORKER"  # the same flag cpu_intercepts.install() requires
_NAMES = (
    "megatron.bridge",
    "megatron.bridge.models",
    "megatron.bridge.models.conversion",
    "megatron.bridge.models.conversion.peft_bridge",
    "megatron.bridge.peft",
    "megatron.bridge.peft.multi_lora_layers",
)


def install(*, variant: str = "nvidia", peft_helpers: bool = True) -> type:
    """Make `import megatron.bridge` give the double in this harness worker; returns its AutoBridge.

    `variant`: "nvidia" (two-item named tuples, NVIDIA main's signature) or "fork" (three-item
    tuples, the fork's signature). `peft_helpers=False` models a Bridge without `peft_bridge`.
    Raises RuntimeError outside a harness worker, or where a real `megatron.bridge` is importable.
    """
    if os.environ.get(WORKER_ENV) != "1":
        raise RuntimeError(f"the Bridge double installs only inside harness workers ({WORKER_ENV}=1)")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    if not installed():
        uninstall()
        if importlib.util.find_spec("megatron.bridge") is not None:
            raise RuntimeError("a real megatron.bridge is importable here; the double will not shadow it")
    import megatron

    auto_bridge = VARIANTS[variant]
    root = types.ModuleType("megatron.bridge", "Megatron-Bridge TEST DOUBLE (miles_lora_ckpt_harness.bridge_double)")
    root.AutoBridge = auto_bridge
    root.IS_TEST_DOUBLE = True
    models = types.ModuleType("megatron.bridge.models")
    conversion = types.ModuleType("megatron.bridge.models.conversion")
    root.models, models.conversion = models, conversion
    from miles_lora_ckpt_harness.bridge_double import multi_lora_layers

    peft = types.ModuleType("megatron.bridge.peft")
    root.peft, peft.multi_lora_layers = peft, multi_lora_layers
    modules = {
        "megatron.bridge": root,
        "megatron.bridge.models": models,
        "megatron.bridge.models.conversion": conversion,
        "megatron.bridge.peft": peft,
        "megatron.bridge.peft.multi_lora_layers": multi_lora_layers,
    }
    if peft_helpers:
        conversion.peft_bridge = peft_bridge
        modules["megatron.bridge.models.conversion.peft_bridge"] = peft_bridge
    uninstall()
    sys.modules.update(modules)
    megatron.bridge = root
    return auto_bridge


def installed() -> bool:
    """True when `megatron.bridge` in this process is the double."""
    return getattr(sys.modules.get("megatron.bridge"), "IS_TEST_DOUBLE", False) is True


def uninstall() -> None:
    """Remove the double from `sys.modules` (a no-op when it is not installed)."""
    if "megatron.bridge" in sys.modules and not installed():
        return  # a real Bridge: not ours to remove
    for name in _NAMES:
        sys.modules.pop(name, None)
    megatron = sys.modules.get("megatron")
    if megatron is not None and getattr(getattr(megatron, "bridge", None), "IS_TEST_DOUBLE", False):
        del megatron.bridge
