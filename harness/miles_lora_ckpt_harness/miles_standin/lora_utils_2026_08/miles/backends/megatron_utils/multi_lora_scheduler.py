"""Stand-in of miles/backends/megatron_utils/multi_lora_scheduler.py: per-slot schedulers."""

from miles_lora_ckpt_harness.miles_standin.common.multi_lora import (  # noqa: F401 - the shape's names
    drop_slot_scheduler,
    install_slot_scheduler,
)
