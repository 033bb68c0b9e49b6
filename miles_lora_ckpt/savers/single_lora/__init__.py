"""The single-LoRA API: `save_lora_checkpoint`, `load_lora_adapter`, `load_lora_checkpoint`.

They have the signatures of Miles' `lora_utils` functions, so the Miles hooks only register them.
All are collective: every rank calls them. Each builds its options (`savers.options`) once from
its keywords and passes them down whole.

- `save`: the save; `save_adapter_generation` takes the options directly.
- `load`: the resume; `load_adapter_generation` takes the options directly.
- `async_save`: the opt-in asynchronous save (`AsyncSaver`, `save_lora_checkpoint_async`).
- `legacy_miles`, `native_warm`: warm starts from stock Miles' adapter and native checkpoints.
- `common`: file names, the saver's spec and the result type.
"""

from miles_lora_ckpt.savers.single_lora.common import SAVER, TRAINING_STATE, LoadResult
from miles_lora_ckpt.savers.single_lora.load import load_lora_adapter, load_lora_checkpoint
from miles_lora_ckpt.savers.single_lora.save import save_lora_checkpoint

__all__ = [
    "SAVER",
    "TRAINING_STATE",
    "LoadResult",
    "load_lora_adapter",
    "load_lora_checkpoint",
    "save_lora_checkpoint",
]
