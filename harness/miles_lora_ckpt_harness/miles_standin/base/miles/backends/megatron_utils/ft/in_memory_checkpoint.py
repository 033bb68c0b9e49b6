"""Stand-in of miles/backends/megatron_utils/ft/in_memory_checkpoint.py (`send_ckpt`)."""

from __future__ import annotations

from miles.backends.megatron_utils.model import save


class InMemoryCheckpointManager:
    def __init__(self):
        self.state = None

    def load(self):
        assert self.state is not None, "the in-memory checkpoint manager holds nothing"
        return self.state


def save_to_memory(iteration: int, model, optimizer, opt_param_scheduler):
    manager = InMemoryCheckpointManager()
    save(
        iteration,
        model,
        optimizer,
        opt_param_scheduler,
        checkpointing_context={"local_checkpoint_manager": manager},
        non_persistent_ckpt=True,
    )
    return manager.load()  # stock LoRA: the save went to disk, the manager is empty
