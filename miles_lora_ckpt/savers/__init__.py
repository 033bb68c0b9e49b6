"""Savers: what a checkpoint of each kind holds, written and read through `core.protocol`.

- `single_lora`: one adapter with its fp32 masters, every moment and the scheduler.
- `peft_export`: HF PEFT adapter directories through Megatron-Bridge (an export root, or `peft/`
  inside a checkpoint generation).
"""
