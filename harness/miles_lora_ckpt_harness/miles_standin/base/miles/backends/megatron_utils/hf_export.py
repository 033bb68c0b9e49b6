"""Stand-in of miles/backends/megatron_utils/hf_export.py: `--save-hf` (imported lazily by the actor).

`save_hf_model` follows Miles' 2026-08 control flow (`main` 31f1ca961a94): the merged
HF export runs first; if it fails, the error is re-raised under `raise_on_error`, else logged, and the
function returns at once: no `<path>/adapter` and no `.complete` for that rollout. Only after a
merged export succeeded does a LoRA model's adapter export run (`save_lora_checkpoint(model, args,
<path>/adapter)`, the plugin's replacement), in its own try: a failure there is re-raised or logged
and returns, again without `.complete`. Rank 0 touches `.complete` last. The merged export itself
is the stand-in's `common.hf_merged` (the base model's config only; a harness can make it fail).
Later Miles writes the export through a staging directory, with the adapter export inside it after
the merged one: a merged failure skips the adapter export there too. Every shape's: it binds the LoRA
functions from the shape's LoRA module, `lora/utils.py` (2026-09 on) or `lora_utils.py` (2026-08).
"""

from __future__ import annotations

import logging

try:
    from miles.backends.megatron_utils.lora.utils import is_lora_model, save_lora_checkpoint
except ModuleNotFoundError as error:  # 2026-08: lora_utils.py
    if error.name != "miles.backends.megatron_utils.lora":
        raise
    from miles.backends.megatron_utils.lora_utils import is_lora_model, save_lora_checkpoint

from miles_lora_ckpt_harness.miles_standin.common import hf_merged
from miles_lora_ckpt_harness.miles_standin.common.hf_merged import HF_EXPORT_COMPLETE_MARKER  # noqa: F401 (Miles' name)

log = logging.getLogger("miles.stand-in")


def save_hf_model(args, rollout_id: int, model, *, path=None, raise_on_error: bool = False) -> None:
    hf_merged.save_hf_model_flow(
        args,
        rollout_id,
        model,
        path=path,
        raise_on_error=raise_on_error,
        is_lora_model=is_lora_model,
        save_lora_checkpoint=save_lora_checkpoint,  # this module's name, as the plugin may have rebound it
        log=log,
    )
