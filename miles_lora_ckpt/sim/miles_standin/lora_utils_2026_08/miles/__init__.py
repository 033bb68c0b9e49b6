"""Stand-in of Miles, shape lora-utils-2026-08 (the 2026-08 snapshot): NOT Miles.

Written from miles-lora-ckpt's contract for its test harness; see miles_lora_ckpt/sim/miles_standin.
"""
