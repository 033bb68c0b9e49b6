"""The rollout data state on the real `miles-rl` wheel's data source classes (real-Miles tier).

One subprocess (`realmiles/data_source_run.py`) drives the wheel's `RolloutDataSourceWithBuffer`
over 64 prompts (12 a rollout, 8 rollouts, a kill at rollout 3, a relaunch) in four scenarios, each
with the plugin's data source and, as the negative control, with the stock class; and each next to
its uninterrupted reference. A rollout's prompt indices are the labels of the groups it trains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_lora_ckpt_harness.realmiles import standins

TIER = standins.tier_folder()
pytestmark = [
    pytest.mark.realmiles,
    pytest.mark.skipif(TIER is None, reason=f"no real Miles wheel: {standins.ENV} unset (make tier-miles)"),
]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("data-source")
    out = work / "results.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("MILES_LORA_CKPT_CONFIG", None)
    done = subprocess.run(
        [sys.executable, "-m", "miles_lora_ckpt_harness.realmiles.data_source_run", str(work), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def _first(rollout: list[int]) -> tuple[int, int]:
    return rollout[0], rollout[-1]


def test_kill_after_the_train_commit_resumes_the_same_prompts(results):
    plugin, reference = results["commit-then-kill-plugin"], results["commit-then-kill-plugin-reference"]
    assert plugin["killed"] == "after-train-commit 3" and plugin["relaunch_error"] is None
    assert plugin["trained"] == reference["trained"]
    # stock Miles: generation 3 is committed, its data file never written: rollout 4 restarts at cursor 0
    stock = results["commit-then-kill-stock"]
    assert stock["relaunch_error"] is None
    assert _first(stock["trained"]["4"]) == (0, 11) and _first(reference["trained"]["4"]) == (48, 59)


def test_kill_inside_the_data_write_never_blocks_the_relaunch(results):
    plugin, reference = results["kill-in-data-save-plugin"], results["kill-in-data-save-plugin-reference"]
    assert plugin["killed"].startswith("inside the write of") and "data_state_000000003" in plugin["killed"]
    assert plugin["relaunch_error"] is None
    assert plugin["trained"] == reference["trained"]
    # stock Miles: a torn global_dataset_state_dict_3.pt stops the relaunch in torch.load
    stock = results["kill-in-data-save-stock"]
    assert "global_dataset_state_dict_3.pt" in stock["killed"]
    assert stock["relaunch_error"] is not None and "PytorchStreamReader" in stock["relaunch_error"]
    assert sorted(stock["trained"]) == ["0", "1", "2", "3"]


def test_async_driver_commits_the_state_of_its_own_rollout(results):
    plugin, reference = results["async-plugin"], results["async-plugin-reference"]
    assert plugin["killed"] == "after-data-save 3" and plugin["relaunch_error"] is None
    assert plugin["trained"] == reference["trained"]
    # stock Miles: save(3) ran after rollout 4's draw, so the relaunch skips rollout 4's prompts 48..59
    stock = results["async-stock"]
    assert _first(stock["trained"]["4"]) == (60, 7)
    trained = {i for rollout in stock["trained"].values() for i in rollout}
    assert not set(range(48, 60)) & trained


def test_buffered_groups_survive_the_relaunch(results):
    plugin, reference = results["buffer-plugin"], results["buffer-plugin-reference"]
    assert plugin["relaunch_error"] is None
    assert plugin["trained"] == reference["trained"]
    assert _first(reference["trained"]["4"]) == (48, 59)  # 48..51 come from the buffer
    # stock Miles: the 4 aborted groups in the buffer at save(3) (prompts 48..51) are lost
    stock = results["buffer-stock"]
    assert _first(stock["trained"]["4"]) == (52, 63)


def test_a_generation_without_data_state_reads_miles_own_file_weights_only_or_refuses_it(results):
    legacy = results["legacy"]
    # rollouts 0..3 stock (Miles' .pt files, generations without a data state), then the plugin's data
    # source resumes rollout 4 from global_dataset_state_dict_3.pt, read with weights_only=True
    assert [_first(legacy["trained"][str(r)]) for r in range(6)] == [
        (0, 11),
        (12, 23),
        (24, 35),
        (36, 47),
        (48, 59),
        (60, 7),
    ]
    assert legacy["refused"] is not None and legacy["stock_file"] in legacy["refused"]
    assert "cannot be read with torch.load(weights_only=True)" in legacy["refused"]
