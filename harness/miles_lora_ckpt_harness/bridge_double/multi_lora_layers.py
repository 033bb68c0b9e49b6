"""TEST DOUBLE of Megatron-Bridge's `megatron.bridge.peft.multi_lora_layers` (multi-LoRA slots), for the harness.

Only what the plugin and the Miles stand-in call: `expose_adapter_slot(model, idx)`, a context
manager that shows one adapter slot of every multi-LoRA linear as its single-LoRA `.adapter`, so
that `export_adapter_weights` (which looks for `.adapter.linear_in.weight`) exports that slot.
The harness's slot model is `sim.multi_lora_model`; this module forwards to its implementation.
"""

from __future__ import annotations

from miles_lora_ckpt_harness.sim.multi_lora_model import expose_adapter_slot

__all__ = ["expose_adapter_slot"]
