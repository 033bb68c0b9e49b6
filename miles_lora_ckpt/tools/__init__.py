"""Operator tools: the `miles-lora-ckpt` command, its benchmark and its demo."""
