"""Stand-in of Miles, shape lora-package-2026-09 (lora/utils.py, load_optimizer keyword): NOT Miles.

Written from miles-lora-ckpt's contract (§10.1) for its test harness; see harness/miles_lora_ckpt_harness/miles_standin.
"""
