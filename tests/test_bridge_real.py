"""The real Megatron-Bridge, wherever `megatron.bridge` imports (Miles' GPU image); skipped elsewhere.

Binds the plugin's adapter to the installed `AutoBridge.export_adapter_weights` by signature, and
checks that Bridge's own `peft_bridge` helpers and ours produce the same PEFT state and config.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from miles_lora_ckpt.megatron import bridge_export as bx
from miles_lora_ckpt.savers.peft_export import ExportedWeight, LoraSpec, StaticSource
from miles_lora_ckpt.savers.peft_export import format as fmt
from miles_lora_ckpt.savers.peft_export.convert import convert_and_check

pytestmark = pytest.mark.bridge
REASON = bx.import_error()
if REASON is not None:
    pytest.skip(f"megatron.bridge does not import here ({REASON}); see bridge-and-peft.md", allow_module_level=True)


def test_the_installed_export_binds_by_signature():
    from megatron.bridge import AutoBridge

    export = AutoBridge.export_adapter_weights
    assert "model" in inspect.signature(export).parameters
    kwargs = bx.bind_options(export, required={}, optional={"cpu": True, "show_progress": False})
    assert kwargs.get("cpu") is True


def test_bridge_helpers_and_ours_agree_on_a_qwen2_shaped_adapter():
    helpers = bx.peft_helpers()
    if helpers.convert is None:
        pytest.skip("this Bridge build has no convert_adapter_weights_to_peft_state")
    gen = torch.Generator().manual_seed(0)
    weights = []
    for layer in range(2):
        for module, out in (("self_attn.q_proj", 16), ("self_attn.k_proj", 8), ("mlp.down_proj", 16)):
            base = f"model.layers.{layer}.{module}"
            weights.append(ExportedWeight(f"{base}.lora_A.weight", torch.randn(4, 16, generator=gen)))
            weights.append(ExportedWeight(f"{base}.lora_B.weight", torch.randn(out, 4, generator=gen)))
    theirs, _, params = helpers.convert(weights)
    ours, _, _ = fmt.to_peft_state(weights)
    assert params == [] and sorted(theirs) == sorted(ours) and all(torch.equal(theirs[k], ours[k]) for k in ours)
    source = type("S", (), {"kind": "megatron-bridge", "conversion_helpers": staticmethod(lambda: helpers)})()
    files = convert_and_check(weights, LoraSpec(r=4, alpha=8.0), None, source)
    fmt.check_state(files.state, files.config)
    assert files.config["target_modules"] == ["down_proj", "k_proj", "q_proj"]
    assert StaticSource(weights).export(None) == weights
