"""Stand-in of Miles' `miles/rollout` package (shape lora-package-2026-09): only the multi-LoRA data source."""
