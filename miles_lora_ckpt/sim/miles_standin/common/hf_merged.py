"""The merged-model half of the stand-in's `save_hf_model` (Miles' `--save-hf`), and its fault.

In Miles, `save_hf_model` first exports the merged HF model (Bridge's `save_hf_pretrained`, adapter
weights folded into the base), then, for a LoRA model, the adapter (`save_lora_checkpoint(model,
args, <path>/adapter)`, which the plugin replaces). The stand-in's merged export writes only the
base model's `config.json` on rank 0. A harness launch can make it fail on every rank at chosen
rollouts (`fail_at`, set from the launch payload's `hf_merged_fails`), as a Bridge export failure
would, to observe what Miles' `save_hf_model` does then.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

fail_at: set[int] = set()


class MergedExportFailed(RuntimeError):
    """The injected failure of the stand-in's merged HF export."""


def export_merged(path: Path, rollout_id: int) -> None:
    """Collective: the merged HF export into `path` (rank 0 writes), or the injected failure on every rank."""
    if rollout_id in fail_at:
        raise MergedExportFailed(f"injected merged HF export failure at rollout {rollout_id} ({path})")
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text("{}\n")
