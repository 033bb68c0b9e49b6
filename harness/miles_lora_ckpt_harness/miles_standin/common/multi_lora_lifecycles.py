"""The two Miles multi-LoRA shapes' slot lifecycles in the stand-in, and which one the running shape has.

- `V1Lifecycle`: multi-LoRA v1, through the shape's `multi_lora_utils`;
- `V2Lifecycle`: multi-LoRA v2, through the shape's `lora/actor.py`;
- `lifecycle_for_shape()`: the one the running shape has, for `common.multi_lora.run`.

Kept out of `common/multi_lora.py`, which those modules of the shapes import: each lifecycle calls its
shape's modules (imported inside, as before), so in `multi_lora` they would close an import circle.
"""

from __future__ import annotations

from miles_lora_ckpt_harness.miles_standin.common.multi_lora import AdapterRun, Lifecycle, Probe


class V1Lifecycle(Lifecycle):
    """Multi-LoRA v1: `load_adapters`, `cleanup_adapters`, `save_due_adapter_checkpoints`."""

    @staticmethod
    def _mlu():
        import importlib

        return importlib.import_module("miles.backends.megatron_utils.multi_lora_utils")

    def register(self, adapters: list[AdapterRun]) -> None:
        self._mlu().load_adapters(self.args, self.model, self.optimizer, adapters)

    def retire(self, adapters: list[AdapterRun]) -> None:
        self._mlu().cleanup_adapters(self.args, self.model, self.optimizer, adapters)

    def save_due(self, trained: list[AdapterRun], probe: Probe) -> None:
        for adapter in self.due(trained):
            probe.before_save(self, adapter, "periodic")
        self._mlu().save_due_adapter_checkpoints(self.args, self.model)


class V2Lifecycle(Lifecycle):
    """Multi-LoRA v2: the actor's `load_slot` / `save_slot` / `unload_slot` at named paths."""

    def __init__(self, args, model, optimizer):
        from miles.backends.megatron_utils.lora.actor import MultiLoRATrainRayActor

        super().__init__(args, model, optimizer)
        self.actor = MultiLoRATrainRayActor(args, model, optimizer)

    def register(self, adapters: list[AdapterRun]) -> None:
        for adapter in adapters:
            self.actor.load_slot(adapter)

    def retire(self, adapters: list[AdapterRun]) -> None:
        for adapter in adapters:
            self.actor.unload_slot(adapter)

    def save_due(self, trained: list[AdapterRun], probe: Probe) -> None:
        for adapter in self.due(trained):
            probe.before_save(self, adapter, "periodic")
            self.actor.save_slot(adapter)


def lifecycle_for_shape():
    """The running shape's lifecycle: v1 where `multi_lora_utils` exists, v2 where `lora/actor.py` does."""
    import importlib.util

    if importlib.util.find_spec("miles.backends.megatron_utils.multi_lora_utils") is not None:
        return V1Lifecycle
    return V2Lifecycle
