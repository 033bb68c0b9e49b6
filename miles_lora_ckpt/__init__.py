"""miles-lora-ckpt: complete, crash-safe, portable LoRA checkpoints for Miles (Megatron backend).

The package imports with nothing but the standard library; torch, megatron-core, Miles and
Megatron-Bridge are imported lazily by the modules that need them.
"""

from miles_lora_ckpt.core.errors import (
    CheckpointError,
    CommittedButFailed,
    GenerationDamaged,
    IncompatibleCheckpoint,
    MilesLoraCkptError,
    NotACheckpoint,
)

__version__ = "0.1.0"

# The errors a caller catches (every one derives from MilesLoraCkptError; see docs/python-api.md).
__all__ = [
    "CheckpointError",
    "CommittedButFailed",
    "GenerationDamaged",
    "IncompatibleCheckpoint",
    "MilesLoraCkptError",
    "NotACheckpoint",
    "__version__",
]
