"""Stand-in of Miles, shape positional-args-pr (load_lora_adapter(model, args, adapter_path, ...)): NOT Miles.

Written from a description of Miles (open PRs #2516/#2661 insert a positional `args`,
#1792 deletes `_load_training_state`) for its test harness; see harness/miles_lora_ckpt_harness/miles_standin.
"""
