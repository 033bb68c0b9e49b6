"""The train side of the rollout data state in a Miles launch (stand-in, W=2, CPU, gloo).

With `--data-source-path miles_lora_ckpt.hooks.CheckpointedDataSource` the save of rollout N must
commit rollout N's data state; here no rollout manager runs (no `--prompt-data`), so nothing is
staged: the save is refused on every rank, nothing is committed (`data_state.missing = refuse`), or
the generation is committed without it under `warn`. The committed data state itself, with the
rollout manager running, is checked by the `--via miles` demo tests (tests/test_demo_miles.py).
"""

from __future__ import annotations

import pytest
from test_miles_resume import Run, failed, ok

from miles_lora_ckpt.core import data_state
from miles_lora_ckpt.core.verify import committed_candidates, is_save_root

pytestmark = [pytest.mark.megatron, pytest.mark.multirank]

SOURCE = ["--data-source-path", "miles_lora_ckpt.hooks.CheckpointedDataSource"]


def test_a_save_without_its_rollouts_data_state_is_refused_on_every_rank(prewarmed, tmp_path):
    run = Run(prewarmed, tmp_path / "refuse", "lora-utils-2026-08", 2, "dense", "fp32")
    errors = failed(run.launch(run.command(*SOURCE)))
    assert all("data_state_000000000.json: no data state was staged for rollout 0" in e for e in errors)
    assert all("is not committed" in e and "data_state.missing = 'warn'" in e for e in errors)
    root = run.save / "lora"
    assert not is_save_root(root) or not committed_candidates(root)[0]

    warn = Run(prewarmed, tmp_path / "warn", "lora-utils-2026-08", 2, "dense", "fp32")
    ok(warn.launch(warn.command(*SOURCE), env={"MILES_LORA_CKPT_DATA_STATE_MISSING": "warn"}))
    newest = committed_candidates(warn.save / "lora")[0][0]
    assert not (newest / data_state.DATA_STATE).exists()
