"""The Miles-shaped single-LoRA API: `save_lora_checkpoint`, `load_lora_adapter`, `load_lora_checkpoint`.

Same signatures as Miles' `lora_utils` functions, so the Miles hooks only have to register them.
All are collective: every rank calls them. Saving lives in `save`, resuming in `load`,
the stock-Miles warm start in `legacy_miles`; file names and the result type in `common`; the
opt-in asynchronous save (`AsyncSaver`, `save_lora_checkpoint_async`) in `async_save`. Each builds
its options (`savers.options.SaveOptions`, `LoadOptions`) once from its keywords and passes them
down whole; `save.save_adapter_generation` and `load.load_adapter_generation` take them directly.
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
