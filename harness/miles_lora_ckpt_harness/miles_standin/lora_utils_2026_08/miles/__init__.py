"""Stand-in of Miles, shape lora-utils-2026-08 (the 2026-08 snapshot): NOT Miles.

Written from miles-lora-ckpt's contract for its test harness; see harness/miles_lora_ckpt_harness/miles_standin.
"""
