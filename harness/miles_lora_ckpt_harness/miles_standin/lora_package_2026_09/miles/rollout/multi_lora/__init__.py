"""Stand-in of Miles' `miles/rollout/multi_lora` package (multi-LoRA v2): only `data_source`."""
