"""Shared fixtures. Multi-rank tests launch real processes through miles_lora_ckpt.sim.launch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

JOBS_DIR = str(Path(__file__).parent / "jobs")
REPO_ROOT = Path(__file__).resolve().parents[1]
TIER = os.environ.get("MILES_LORA_CKPT_TIER", "mcore-0.16")

sys.path.insert(0, JOBS_DIR)


@pytest.fixture
def jobs_dir() -> str:
    return JOBS_DIR
