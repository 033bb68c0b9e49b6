"""The protocol core: layout, storage, consensus, verification, retention, the save/load phases.

Imports neither megatron nor Miles nor Bridge (and torch only where tensors are read or written),
so `miles-lora-ckpt verify` runs on a login node.
"""
