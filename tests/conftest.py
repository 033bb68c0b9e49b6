"""Shared test set-up. Multi-rank tests launch real processes through miles_lora_ckpt_harness.sim.launch;
each test module holds its own rank jobs, which the ranks import from the tests directory
(`jobs_paths.TESTS`)."""

from __future__ import annotations

import os

import pytest

from miles_lora_ckpt_harness.sim.cpu_intercepts import install_typing_override

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
    """One pre-warmed fork launcher (sim.prewarmed), started on first use, for the whole session."""
    from miles_lora_ckpt_harness.sim.prewarmed import PrewarmedLauncher

    with PrewarmedLauncher() as launcher:
        yield launcher


@pytest.fixture(scope="session", autouse=True)
def megatron_jobs_forked(prewarmed):
    """Every megatron job of the suite (`sim.launch.run_workers`) is forked from the pre-warmed launcher.

    Same worker code, environment and results, without seconds of torch and megatron imports per
    rank. The launcher's own tests (test_launcher.py) spawn, as the `demo` and `bench` commands
    always do. `MILES_LORA_CKPT_TEST_SPAWN=1` spawns every job of the suite instead.
    """
    from miles_lora_ckpt_harness.sim import launch

    if os.environ.get("MILES_LORA_CKPT_TEST_SPAWN") == "1":
        yield
        return
    with launch.route_megatron_jobs(prewarmed):
        yield
