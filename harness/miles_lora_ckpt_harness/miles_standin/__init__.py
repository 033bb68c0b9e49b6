"""Stand-ins of Miles' module tree, one per supported shape, for the tests and the demo.

The Miles shapes that exist in no installable wheel (the real miles-rl 0.0.2 wheel runs in the
real-Miles tier: `sim/realmiles`, `make tier-miles`). Each shape's `miles` package is written from the
contract (miles-contract.md; never copied from Miles): module paths, function signatures, the
train actor's call order (init hook, model setup, load, train steps, save, ref/old-actor loads),
and stock Miles' checkpoint behaviour with its defects (§10.4): per-rank pickles, Adam moments
from `torch.empty` and stale fp32 masters after a resume, the scheduler stepped twice, the rollout
counter restarted at 0, a crash on stub optimizer children. Their training runs the real
megatron-core optimizers through the CPU harness (`sim.train`, `sim.model`).

A shape's tree is the shared `base/miles/` plus the shape directory's own modules, less the base
modules it lacks (`trees.py`); `shape_path(name)` materialises the complete tree into a cache
directory keyed by its content and returns that directory. None of these directories is a package
or on sys.path: `import miles` fails everywhere except in a harness job that puts one shape's
`shape_path` on its sys.path.
`common/` holds what the shapes share; it imports `miles.*` only inside functions, from whichever
shape the job put on the path. Where a stand-in differs from Miles (it never unpickles: training
state is read with `weights_only=True`; the base-model "HF checkpoint" is a directory with a
`config.json`, whose architecture picks the harness model: a Qwen2 config gives the Qwen2-shaped
model of the PEFT export path; no Ray or rollout engines), its docstring says so. Megatron-Bridge,
which Miles' GPU image has, is the harness's Bridge double (`sim.bridge_double`), installed in
every rank by the launch job (`launch.launch_job`); every shape has `miles.utils.megatron_bridge_utils.
patch_megatron_model`, the context Miles runs Bridge calls in.

    lora-utils-2026-08     backends/megatron_utils/lora_utils.py: the 2026-08 snapshot (31f1ca961a94)
    lora-package-2026-09   backends/megatron_utils/lora/utils.py; load_lora_adapter(..., load_optimizer=True);
                           saves published through checkpoint_io (staging, version directory, symlink);
                           megatron's gloo switch is `use_gloo_process_groups`
    positional-args-pr     lora-package-2026-09 with load_lora_adapter(model, args, adapter_path, ...) and no
                           _load_training_state (open PRs #2516/#2661 and #1792)

Multi-LoRA (`--multi-lora-n-adapters N`, with the stand-in's `--multi-lora-config` naming the adapters):
lora-utils-2026-08 has v1's `multi_lora_utils.py` and `multi_lora_scheduler.py` (contract §3),
lora-package-2026-09 v2's `lora/checkpoint.py`, `lora/slots.py` and `lora/actor.py` (§10.2), and
Miles' per-adapter data source `rollout/multi_lora/data_source.py` (both shapes' Miles have it; it is
in no installable wheel: its `load` reaches no source at a relaunch, and a re-registered adapter's
source starts over; kept in `common/multi_lora_data_source.py`, re-exported by the v2 tree), each
with its stock defects; both run on the slot model `sim.multi_lora_model` (several adapter slots on
one base linear, Miles' per-slot LayerWise chain) through the loop in `common/multi_lora.py`
(`train_multi_lora_async.py`); `launch_multi_lora.launch_job` is its harness job.
"""

from __future__ import annotations

from miles_lora_ckpt_harness.miles_standin import trees

SHAPES = trees.SHAPE_DIRS
DEFAULT_SHAPE = "lora-utils-2026-08"


def shape_path(name: str) -> str:
    """The directory to put on a harness job's sys.path so that `import miles` imports this shape
    (its tree materialised by `trees.materialise`, built on first use)."""
    return str(trees.materialise(name))
