"""Stand-in of Miles, shape lora-utils-2026-08 (radixark/miles 31f1ca961a94): NOT Miles.

Written from a description of Miles for miles-lora-ckpt's test harness; see harness/miles_lora_ckpt_harness/miles_standin.
"""
