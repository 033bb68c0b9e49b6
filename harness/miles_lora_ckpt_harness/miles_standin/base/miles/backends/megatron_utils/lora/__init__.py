"""Stand-in of the miles/backends/megatron_utils/lora package."""
