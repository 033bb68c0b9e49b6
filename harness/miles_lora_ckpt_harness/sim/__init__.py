"""CPU test harness: the real megatron-core optimizers (every child megatron builds for LoRA) in gloo workers.

Only the demo, the benchmarks and the tests import this package; production code never does.

- ``launch``: ``run_workers`` / ``check_all`` / ``RankResult`` (standard library only, re-exported here).
- ``prewarmed``: ``PrewarmedLauncher``: the same jobs, forked per launch from one pre-warmed process.
- ``miles_standin``: stand-ins of Miles' module tree, one per supported shape (``shape_path``).
- ``worker``: the per-rank entry point and ``WorkerContext``.
- ``cpu_intercepts``: every device interception, megatron fallback-path fix and gloo fix; ``install()``;
  ``install_typing_override()`` (Python 3.11, for emerging-optimizers).
- ``model``: ``SimConfig`` and the tiny LoRA model.
- ``optimizers``: the optimizer megatron builds for a ``SimConfig`` (``NotBuildable`` where it cannot).
- ``lion``: the stand-in Lion for megatron-core 0.16, which has none.
- ``train``: ``build_run`` / ``train_step`` / ``teardown`` / ``SimRun``.
- ``snapshot``: ``snapshot`` / ``snapshot_digests`` / ``compare_snapshots``.
- ``qwen2_model``: ``Qwen2SimConfig`` and a Qwen2-shaped model with Bridge-style LoRA (PEFT export).
- ``hf_base``: the matching tiny HF ``Qwen2ForCausalLM``, built from a config (no hub).
- ``bridge_double``: a test double of Megatron-Bridge's adapter export (``install()`` in workers only).

The modules that import torch or megatron are not imported here, so the launching side stays light.
"""

from miles_lora_ckpt_harness.sim.launch import RankResult, check_all, run_workers

__all__ = ["RankResult", "check_all", "run_workers"]
