"""Operator tools: the `miles-lora-ckpt` command line and its commands."""
