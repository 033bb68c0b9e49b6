"""Shared test set-up. Multi-rank tests launch real processes through miles_lora_ckpt.sim.launch;
their worker functions live in tests/jobs/ (see jobs_paths.JOBS)."""

from __future__ import annotations

import sys

import pytest
from jobs_paths import JOBS

from miles_lora_ckpt.sim.cpu_intercepts import install_typing_override

sys.path.insert(0, JOBS)
# Tests that import megatron in this process (tier 2: megatron-core 0.19 with emerging-optimizers,
# which needs Python 3.12's typing.override) get the harness's 3.11 shim first.
install_typing_override()


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", help="also run the long fuzz/chaos runs (marker `long`)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long run: pass --long (make test-long)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def prewarmed():
    """One pre-warmed fork launcher (sim.prewarmed) for every test that launches the Miles stand-in."""
    from miles_lora_ckpt.sim.prewarmed import PrewarmedLauncher

    with PrewarmedLauncher() as launcher:
        yield launcher
