"""Shared test set-up. Multi-rank tests launch real processes through miles_lora_ckpt.sim.launch;
their worker functions live in tests/jobs/ (see jobs_paths.JOBS)."""

from __future__ import annotations

import sys

from jobs_paths import JOBS

from miles_lora_ckpt.sim.cpu_intercepts import install_typing_override

sys.path.insert(0, JOBS)
# Tests that import megatron in this process (tier 2: megatron-core 0.19 with emerging-optimizers,
# which needs Python 3.12's typing.override) get the harness's 3.11 shim first.
install_typing_override()
