"""Shared test set-up. Multi-rank tests launch real processes through miles_lora_ckpt.sim.launch;
their worker functions live in tests/jobs/ (see jobs_paths.JOBS)."""

from __future__ import annotations

import sys

from jobs_paths import JOBS

sys.path.insert(0, JOBS)


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", help="also run the long fuzz/chaos runs (marker `long`)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--long"):
        return
    import pytest

    skip = pytest.mark.skip(reason="long run: pass --long (make test-long)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
