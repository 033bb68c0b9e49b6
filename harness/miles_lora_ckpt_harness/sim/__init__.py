"""CPU test harness: the real megatron-core optimizers (every child megatron builds for LoRA) in gloo workers.

Only the demo, the benchmarks and the tests import this package; production code never does. It
re-exports `run_workers`, `check_all` and `RankResult` from `launch`, which needs only the standard
library. The modules that import torch or megatron are not imported here, so the launching side
stays light. docs/architecture.md maps its modules.
"""

from miles_lora_ckpt_harness.sim.launch import RankResult, check_all, run_workers

__all__ = ["RankResult", "check_all", "run_workers"]
