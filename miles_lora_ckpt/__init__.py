"""miles-lora-ckpt: complete, crash-safe, portable LoRA checkpoints for Miles (Megatron backend).

The package imports with nothing but the standard library; torch, megatron-core, Miles and
Megatron-Bridge are imported lazily by the modules that need them.
"""

__version__ = "0.1.0"
