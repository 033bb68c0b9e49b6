"""Stand-in of the miles/utils/lora package (§10.1)."""
