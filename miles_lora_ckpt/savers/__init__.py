"""Savers: what a checkpoint of each kind holds, written and read through `core.protocol`.

- `options`: what a save or a load is asked to do (`SaveOptions`, `LoadOptions`).
- `single_lora`: one adapter with its fp32 masters, every moment and the scheduler.
- `multi_lora`: one slot of a multi-LoRA model, each slot under its own root.
- `peft_export`: HF PEFT adapter directories through Megatron-Bridge (an export root, or `peft/`
  inside a checkpoint generation).
"""
