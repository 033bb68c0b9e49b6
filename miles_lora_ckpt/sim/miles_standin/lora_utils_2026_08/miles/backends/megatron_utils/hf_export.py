"""Stand-in of miles/backends/megatron_utils/hf_export.py: `--save-hf` (imported lazily by the actor).

`save_hf_model` follows Miles' 2026-08 control flow (`main` 31f1ca961a94): the merged
HF export runs first; if it fails, the error is re-raised under `raise_on_error`, else logged, and the
function returns at once: no `<path>/adapter` and no `.complete` for that rollout. Only after a
merged export succeeded does a LoRA model's adapter export run (`save_lora_checkpoint(model, args,
<path>/adapter)`, the plugin's replacement), in its own try: a failure there is re-raised or logged
and returns, again without `.complete`. Rank 0 touches `.complete` last. The merged export itself
is the stand-in's `common.hf_merged` (the base model's config only; a harness can make it fail).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from miles.backends.megatron_utils.lora_utils import is_lora_model, save_lora_checkpoint
from miles_lora_ckpt.sim.miles_standin.common import hf_merged

log = logging.getLogger("miles.stand-in")
HF_EXPORT_COMPLETE_MARKER = ".complete"


def save_hf_model(args, rollout_id: int, model, *, path=None, raise_on_error: bool = False) -> None:
    path = Path(path or args.save_hf.format(rollout_id=rollout_id))
    try:  # the merged model; Miles clears a stale marker first
        if dist.get_rank() == 0 and path.is_dir():
            (path / HF_EXPORT_COMPLETE_MARKER).unlink(missing_ok=True)
        hf_merged.export_merged(path, rollout_id)
        dist.barrier()
    except Exception as exc:
        log.error("save_hf_model failed for rollout %s: merged HF export: %s", rollout_id, exc)
        if raise_on_error:
            raise
        return  # as Miles: the adapter export below does not run for this rollout
    if is_lora_model(model):
        try:
            save_lora_checkpoint(model, args, str(path / "adapter"))
        except Exception as exc:
            log.error("save_hf_model failed for rollout %s: LoRA adapter export: %s", rollout_id, exc)
            if raise_on_error:
                raise
            return
    if dist.get_rank() == 0:
        (path / HF_EXPORT_COMPLETE_MARKER).touch()
