"""Stand-ins of Miles' module tree, one per supported shape, for the tests and the demo.

These are the Miles shapes that exist in no installable wheel; the real miles-rl 0.0.2 wheel runs
in the real-Miles tier (`realmiles`, `make tier-miles`). Each shape's `miles` package is written
from a description of Miles, never copied from it. It has Miles' module paths, function signatures
and train actor call order. It keeps stock Miles' checkpoint defects, which the plugin must fix:
per-rank pickles, Adam moments from `torch.empty`, stale fp32 masters after a resume, the scheduler
stepped twice, the rollout counter restarted at 0, a crash on stub optimizer children. Training runs
the real megatron-core optimizers through the CPU harness (`sim.train`, `sim.model`).

A shape's tree is the shared `base/miles/` plus the shape directory's own modules, less the base
modules it lacks (`trees.py`). `shape_path(name)` materialises it into a cache directory keyed by
its content. `import miles` works only in a harness job that puts one shape's `shape_path` on its
sys.path. `common/` holds what the shapes share and imports `miles.*` only inside functions.
Where a stand-in differs from Miles (it never unpickles, has no Ray or rollout engines, uses the
harness's Bridge double), its docstring says so.

    lora-utils-2026-08     backends/megatron_utils/lora_utils.py, radixark/miles 31f1ca961a94
    lora-package-2026-09   backends/megatron_utils/lora/utils.py; load_lora_adapter(..., load_optimizer=True);
                           saves published through checkpoint_io (staging, version directory, symlink);
                           megatron's gloo switch is `use_gloo_process_groups`
    positional-args-pr     lora-package-2026-09 with load_lora_adapter(model, args, adapter_path, ...) and no
                           _load_training_state (open PRs #2516/#2661 and #1792)

Multi-LoRA (`--multi-lora-n-adapters N`): lora-utils-2026-08 has v1's `multi_lora_utils.py`, and
lora-package-2026-09 has v2's `lora/checkpoint.py`, `lora/slots.py` and `lora/actor.py`. Both have
Miles' per-adapter data source (`common/multi_lora_data_source.py`), each with its stock defects.
Both run on the slot model `sim.multi_lora_model` through the loop in `common/multi_lora.py`;
`launch_multi_lora.launch_job` is its harness job.
"""

from __future__ import annotations

from miles_lora_ckpt_harness.miles_standin import trees

SHAPES = trees.SHAPE_DIRS
DEFAULT_SHAPE = "lora-utils-2026-08"


def shape_path(name: str) -> str:
    """The directory to put on a harness job's sys.path so that `import miles` imports this shape
    (its tree materialised by `trees.materialise`, built on first use)."""
    return str(trees.materialise(name))
