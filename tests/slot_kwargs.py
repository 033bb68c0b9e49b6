"""The keyword arguments of a slot save or load (used by the rank jobs in test_multi_lora and test_reshard)."""

from __future__ import annotations


def slot_kwargs(run, trainer, slot, consensus, **extra) -> dict:
    return {
        "slot": slot,
        "adapter_filter": trainer.adapter_filter(slot),
        "optimizer": run.optimizer,
        "opt_param_scheduler": trainer.schedulers[slot],
        "optimizer_children": trainer.children[slot],
        "consensus": consensus,
        **extra,
    }
