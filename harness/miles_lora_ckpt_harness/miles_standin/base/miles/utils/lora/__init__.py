"""Stand-in of the miles/utils/lora package."""
