"""Stand-in of Miles, shape lora-package-2026-09 (lora/utils.py, load_optimizer keyword): NOT Miles.

Written from a description of Miles for miles-lora-ckpt's test harness; see harness/miles_lora_ckpt_harness/miles_standin.
"""
