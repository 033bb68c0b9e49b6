"""Stand-in of Miles' TensorBackuper for model switching: ref, teacher and old-actor weights.

Miles loads those models into the actor's own model object (`load_other_checkpoint`) and keeps a
host copy per tag. The stand-in records what each tag's load put into the adapter (digests, for
tests) and puts the actor's weights back.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from miles_lora_ckpt_harness.miles_standin.common.stock import is_adapter_param_name
from miles_lora_ckpt_harness.sim.snapshot import tensor_digest


class WeightBackups:
    def __init__(self, model):
        self.model = model
        self.tags: dict[str, dict[str, str]] = {}  # tag -> {adapter param name: digest}

    @contextmanager
    def loading(self, tag: str):
        """Load into the live model inside the block; afterwards record it as `tag` and restore the actor."""
        actor = {name: p.detach().clone() for chunk in self.model for name, p in chunk.named_parameters()}
        try:
            yield
            self.tags[tag] = {
                name: tensor_digest(p)
                for chunk in self.model
                for name, p in chunk.named_parameters()
                if is_adapter_param_name(name)
            }
        finally:
            with torch.no_grad():
                for chunk in self.model:
                    for name, param in chunk.named_parameters():
                        param.copy_(actor[name])
