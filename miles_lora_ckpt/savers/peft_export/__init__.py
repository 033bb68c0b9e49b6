"""PEFT export: HF PEFT adapter directories converted by Megatron-Bridge, published by the protocol.

Both placements, a standalone export root and `peft/` inside a generation, go through
`core.protocol.save_generation`. The guide is docs/peft-export.md.

- `export`: the phases. `export_peft` writes a standalone export root for serving. `plan_export`
  and `ExportStep` make the export steps of any generation's save. `PeftExport` is what
  `save_lora_checkpoint(..., peft=...)` takes.
- `convert`: sources (`AdapterSource`, `StaticSource` for weights already in HF names), conversion
  to PEFT keys and config, coverage (partial adapters), `PeftFiles`.
- `format`: the PEFT file format, our conversion helpers, PEFT's matching rules and the self-check.
- `offline`: export a committed generation without a live model (`miles-lora-ckpt export-peft`).

The live source is `miles_lora_ckpt.megatron.bridge_export.BridgeSource` (re-exported here).
"""

from miles_lora_ckpt.core.layout import LATEST
from miles_lora_ckpt.megatron.bridge_export import BridgeSource, ExportedWeight
from miles_lora_ckpt.savers.peft_export.convert import PeftFiles, StaticSource
from miles_lora_ckpt.savers.peft_export.export import (
    EXPORT_SAVER,
    FAULT_PHASES,
    GENERATION_SUBDIR,
    ExportStep,
    PeftExport,
    export_peft,
    plan_export,
)
from miles_lora_ckpt.savers.peft_export.format import CONFIG_NAME, WEIGHTS_NAME, LoraSpec, check_peft_dir

__all__ = [
    "CONFIG_NAME",
    "EXPORT_SAVER",
    "FAULT_PHASES",
    "GENERATION_SUBDIR",
    "LATEST",
    "WEIGHTS_NAME",
    "BridgeSource",
    "ExportStep",
    "ExportedWeight",
    "LoraSpec",
    "PeftExport",
    "PeftFiles",
    "StaticSource",
    "check_peft_dir",
    "export_peft",
    "plan_export",
]
