"""Stand-in of miles/backends/megatron_utils/hf_export.py: `--save-hf` (imported lazily by the actor)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from miles.backends.megatron_utils.lora.utils import is_lora_model, save_lora_checkpoint

log = logging.getLogger("miles.stand-in")
HF_EXPORT_COMPLETE_MARKER = ".complete"


def save_hf_model(args, rollout_id: int, model, *, path=None, raise_on_error: bool = False) -> None:
    path = Path(path or args.save_hf.format(rollout_id=rollout_id))
    try:
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
            (path / "config.json").write_text("{}\n")  # the HF base model export (stand-in: its config)
        if is_lora_model(model):
            save_lora_checkpoint(model, args, str(path / "adapter"))
        dist.barrier()
        if dist.get_rank() == 0:
            (path / HF_EXPORT_COMPLETE_MARKER).touch()
    except Exception:
        log.exception("save_hf_model failed for rollout %s", rollout_id)
        if raise_on_error:
            raise
