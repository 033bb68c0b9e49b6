"""Shared test set-up. Multi-rank tests launch real processes through miles_lora_ckpt.sim.launch;
their worker functions live in tests/jobs/ (see jobs_paths.JOBS)."""

from __future__ import annotations

import sys

from jobs_paths import JOBS

sys.path.insert(0, JOBS)
