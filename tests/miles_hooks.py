"""A user's Miles post-save hook, for tests: records what Miles (through the plugin) passed to it."""

from __future__ import annotations

import json
from pathlib import Path


def record_post_save(args, rollout_id, checkpoint_dir, hf_checkpoint_dir) -> None:
    record = {"checkpoint_dir": str(checkpoint_dir), "hf_checkpoint_dir": hf_checkpoint_dir}
    Path(args.save, f"post_save_{rollout_id}.json").write_text(json.dumps(record))
