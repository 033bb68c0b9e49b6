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


HF_EXPORT_COMPLETE_MARKER = ".complete"


def save_hf_model_flow(
    args, rollout_id: int, model, *, path, raise_on_error: bool, is_lora_model, save_lora_checkpoint, log
) -> None:
    """The body every stand-in tree's `save_hf_model` runs, with that tree's `is_lora_model` and
    `save_lora_checkpoint` as its module holds them at call time (the plugin rebinds the latter):
    the control flow of radixark/miles 31f1ca961a94, described in the trees' `hf_export.py`."""
    path = Path(path or args.save_hf.format(rollout_id=rollout_id))
    try:  # the merged model; Miles clears a stale marker first
        if dist.get_rank() == 0 and path.is_dir():
            (path / HF_EXPORT_COMPLETE_MARKER).unlink(missing_ok=True)
        export_merged(path, rollout_id)
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
