"""Resume with the same launch command: where generations live, Miles' tracker, the base-model load.

Stock Miles restarts a LoRA run at rollout 0. LoRA saves write no Megatron tracker, so Miles'
validation replaces `--load` by the base model and forces `start_rollout_id = 0`.

The plugin makes `--save` hold Megatron's tracker and the plugin's save root (`save_root`). A
relaunch then keeps `--load` and starts at the loaded iteration + 1. Its `load_checkpoint` runs
Miles' own base load with the `--load` validation would have chosen (`base_load_overrides`). It
then restores the newest committed generation; with none yet, the run starts at rollout 0. Miles
steps the scheduler again after the load, so the plugin re-applies the scheduler state its load
decided once `initialize_model_and_optimizer` returns. A launch that would restart at rollout 0
over committed generations is refused at startup (`check_relaunch`).

docs/use-with-miles.md, "What the hook does", has the details.
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from miles_lora_ckpt.core import atomic_files, native_dist
from miles_lora_ckpt.core.errors import MilesLoraCkptError, NotACheckpoint, NothingCommitted
from miles_lora_ckpt.core.hyperparameters import HyperparameterPolicy
from miles_lora_ckpt.core.layout import parse_generation_dir_name
from miles_lora_ckpt.core.verify import check_structure, committed_candidates, is_save_root
from miles_lora_ckpt.integration.config import AUTO_HYPERPARAMETERS, PluginConfig, RootLayout
from miles_lora_ckpt.savers.options import LoadOptions

__all__ = [
    "ResumeRefused",
    "LoadFlags",
    "save_root",
    "plugin_root",
    "prepare_save_dir",
    "write_megatron_tracker",
    "check_relaunch",
    "newest_committed",
    "choose_generation",
    "base_load_overrides",
    "overridden",
    "hyperparameter_policy",
    "load_options",
    "scheduler_position",
]

log = logging.getLogger("miles_lora_ckpt.integration")

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's; Miles' validation tests for it
_MEGATRON_ITER_DIR = re.compile(r"iter_[0-9]{7}\Z", re.ASCII)


class ResumeRefused(MilesLoraCkptError, RuntimeError):
    """This launch cannot resume correctly as configured; the message says which flag to change."""


# --------------------------------------------------------------------------- layout


def save_root(config: PluginConfig, directory: str | os.PathLike) -> Path:
    """The plugin's save root for Miles' `--save` (or `--load`) directory."""
    if config["save.layout"] == RootLayout.FLAT:
        return Path(directory)
    return Path(directory) / config["save.subdir"]


def plugin_root(config: PluginConfig, load: str | os.PathLike | None) -> Path | None:
    """The save root to resume from when `--load` is a directory the plugin prepared, else None.

    A directory is the plugin's when it holds Megatron's tracker and the plugin's save root (with
    layout 'flat': and no Megatron `iter_NNNNNNN` checkpoint directories).
    """
    if load is None or not (Path(load) / MEGATRON_TRACKER).is_file():
        return None
    root = save_root(config, load)
    if not root.is_dir():
        return None
    if config["save.layout"] == RootLayout.FLAT and not is_save_root(root):
        if any(_MEGATRON_ITER_DIR.match(name) for name in os.listdir(root)):
            return None
    return root


def newest_committed(root: Path) -> Path | None:
    """The most recently committed generation directory of `root` (damaged or not), or None."""
    if not is_save_root(root):
        return None
    try:
        candidates, _ = committed_candidates(root)
    except (NotACheckpoint, NothingCommitted):
        return None
    return candidates[0]


def write_megatron_tracker(save_dir: str | os.PathLike, iteration: int) -> None:
    """Atomically write Megatron's tracker (the iteration as text) into `save_dir`."""
    directory = Path(save_dir)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_files.write_file_atomic(directory / MEGATRON_TRACKER, [f"{int(iteration)}\n".encode()])
    atomic_files.fsync_dir(directory)


def prepare_save_dir(config: PluginConfig, save_dir: str | os.PathLike) -> str:
    """Init hook, rank 0: create the save root and Megatron's tracker if missing (see step 1)."""
    root = save_root(config, save_dir)
    root.mkdir(parents=True, exist_ok=True)
    if (Path(save_dir) / MEGATRON_TRACKER).is_file():
        return f"{save_dir} holds Miles' tracker and the save root {root}"
    newest = newest_committed(root)
    parsed = parse_generation_dir_name(newest.name) if newest is not None else None
    write_megatron_tracker(save_dir, parsed[0] if parsed else 0)
    return f"wrote {Path(save_dir) / MEGATRON_TRACKER} so that a relaunch of this command resumes"


# --------------------------------------------------------------------------- startup check


def check_relaunch(config: PluginConfig, args) -> list[str]:
    """Init hook, rank 0: refuse a launch that Miles would restart at rollout 0 over saved progress.

    Returns notes to log. Raises ResumeRefused when `--save` holds a committed generation but
    Miles' validation replaced `--load` (no `--load`, another directory, or a deleted tracker).
    """
    save, load = getattr(args, "save", None), getattr(args, "load", None)
    _refuse_native_checkpoints(config, args)
    if not save:
        return []
    root = save_root(config, save)
    newest = newest_committed(root)
    if newest is None:
        return []
    resume_root = plugin_root(config, load)
    forced = getattr(args, "start_rollout_id", None)
    if resume_root is not None and forced is not None and not getattr(args, "finetune", False):
        parsed = parse_generation_dir_name(newest.name)
        raise ResumeRefused(
            f"--load {load} holds committed generations (newest rollout {parsed[0] if parsed else '?'}), but Miles' "
            f"start_rollout_id is already {forced}: Miles' driver would train from rollout {forced} on top of the "
            "resumed state instead of continuing after it. Miles before PR #2682 (e.g. the miles-rl 0.0.2 wheel) "
            "sets start_rollout_id = 0 in bridge mode even when --load holds a checkpoint: upgrade Miles; "
            "or drop --start-rollout-id if you passed it; or start a new run with a new --save directory."
        )
    if resume_root is not None:
        if resume_root.resolve() != root.resolve():
            return [f"resuming from --load {load} although --save {save} also holds generations ({newest.name})"]
        return []
    if not (Path(save) / MEGATRON_TRACKER).is_file():
        parsed = parse_generation_dir_name(newest.name)
        write_megatron_tracker(save, parsed[0] if parsed else 0)
    raise ResumeRefused(
        f"{root} holds committed generations (newest {newest.name}), but Miles' --load is {load!r}, so Miles "
        f"would restart the rollout counter at 0 on top of them. Pass --load {save} (the same directory as "
        f"--save) and relaunch; {Path(save) / MEGATRON_TRACKER} is in place. To start a new run instead, use a "
        "new --save directory."
    )


def _refuse_native_checkpoints(config: PluginConfig, args) -> None:
    """Raise ResumeRefused when `--load`/`--save` hold a stock Miles native (raw-mode, `torch_dist`)
    LoRA checkpoint and no plugin generation.

    Resuming from it needs optimizer state the plugin does not restore (`core.native_dist.refusal`),
    and a fresh adapter would silently replace it. `--lora-adapter-path` naming one is a deliberate
    warm start of its adapter weights (`savers.single_lora.native_warm`), not refused."""
    for flag in ("load", "save"):
        directory = getattr(args, flag, None)
        if not directory or newest_committed(save_root(config, directory)) is not None:
            continue
        try:
            found = native_dist.native_checkpoints_in(directory)
        except ValueError as exc:  # a FIFO or device where megatron's metadata is expected: named
            raise ResumeRefused(f"--{flag}: {exc}") from None
        if found:
            raise ResumeRefused(
                f"--{flag}: {native_dist.refusal(directory, found[-1])} Stock native checkpoints found: "
                f"{[str(f) for f in found]}; to start a new plugin run instead, use a new --save directory."
            )


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class LoadFlags:
    """Miles' load flags as the user gave them (read before any temporary override)."""

    no_load_optim: bool
    no_save_optim: bool
    finetune: bool
    no_load_rng: bool = False  # Megatron's --no-load-rng: the RNG states stay as this launch seeded them

    @classmethod
    def from_args(cls, args) -> LoadFlags:
        return cls(
            no_load_optim=bool(getattr(args, "no_load_optim", False)),
            no_save_optim=bool(getattr(args, "no_save_optim", False)),
            finetune=bool(getattr(args, "finetune", False)),
            no_load_rng=bool(getattr(args, "no_load_rng", False)),
        )


def base_load_overrides(args) -> dict[str, object]:
    """The args Miles' validation sets when `--load` has no tracker: the base model load.

    Bridge mode: `--load` becomes `--ref-load` or `--hf-checkpoint`. Raw mode also sets
    `no_load_optim`, `no_load_rng`, `finetune` and `ckpt_step = ref_ckpt_step`. `lora_adapter_path`
    is cleared because the plugin restores the adapter itself, after the base.
    """
    if getattr(args, "megatron_to_hf_mode", "bridge") == "raw":
        values: dict[str, object] = {
            "load": getattr(args, "ref_load", None),
            "no_load_optim": True,
            "no_load_rng": True,
            "finetune": True,
        }
        if getattr(args, "ref_ckpt_step", None) is not None:
            values["ckpt_step"] = args.ref_ckpt_step
    else:
        values = {"load": getattr(args, "ref_load", None) or getattr(args, "hf_checkpoint", None)}
    values["lora_adapter_path"] = None
    return values


@contextmanager
def overridden(args, values: dict[str, object]):
    """Set attributes of `args` for the duration of the block, then put the old values back."""
    missing = object()
    old = {name: getattr(args, name, missing) for name in values}
    try:
        for name, value in values.items():
            setattr(args, name, value)
        yield
    finally:
        for name, value in old.items():
            if value is missing:
                delattr(args, name)
            else:
                setattr(args, name, value)


def choose_generation(config: PluginConfig, root: Path, flags: LoadFlags, *, with_optimizer: bool) -> str | None:
    """Rank 0: the path to load, or None when nothing is committed yet (a fresh start).

    Strict: the newest committed generation itself (a damaged one fails the load; one without
    optimizer state fails unless the flags accept an inexact resume). Lenient: the root, which
    resolves to the newest intact generation.
    """
    newest = newest_committed(root)
    if newest is None:
        return None
    if not config["resume.strict"]:
        return str(root)
    inexact_ok = flags.no_load_optim or flags.no_save_optim or flags.finetune
    if with_optimizer and not inexact_ok:
        manifest = check_structure(newest).manifest
        if manifest is not None and not manifest.metadata.get("optimizer_saved", False):
            raise ResumeRefused(
                f"{newest} holds no optimizer state (saved with --no-save-optim), so this resume would not be "
                "exact; add --no-load-optim to resume from the adapter alone, or set resume.strict = false"
            )
    return str(newest)


def hyperparameter_policy(config: PluginConfig, args) -> HyperparameterPolicy:
    """The `core.hyperparameters` policy of this resume: `resume.hyperparameters`, or with "auto"
    Miles' scheduler flags as megatron reads them (override wins), else "refuse" under
    `resume.strict` and "checkpoint" without it."""
    chosen = config["resume.hyperparameters"]
    if chosen != AUTO_HYPERPARAMETERS:
        return HyperparameterPolicy(chosen)
    if getattr(args, "override_opt_param_scheduler", False):
        return HyperparameterPolicy.LAUNCH
    if getattr(args, "use_checkpoint_opt_param_scheduler", False):
        return HyperparameterPolicy.CHECKPOINT
    return HyperparameterPolicy.REFUSE if config["resume.strict"] else HyperparameterPolicy.CHECKPOINT


def load_options(config: PluginConfig, args, flags: LoadFlags, *, with_optimizer: bool) -> LoadOptions:
    """The options of a resume's load, from Miles' flags and the plugin config.

    The adapter only with --finetune or without an optimizer (ref and teacher loads). No optimizer
    state with --no-load-optim. No RNG state with --no-load-rng or --finetune, as megatron does."""
    return LoadOptions(
        load_optim=not flags.no_load_optim,
        weights_only=flags.finetune or not with_optimizer,
        load_rng=not flags.no_load_rng,
        hyperparameters=hyperparameter_policy(config, args),
    )


def samples_per_rollout(args) -> int:
    """Samples one rollout trains on: what Miles' scheduler advances per rollout."""
    try:
        return int(args.rollout_batch_size) * int(args.n_samples_per_prompt)
    except (AttributeError, TypeError) as exc:
        raise ResumeRefused(
            f"cannot reposition the scheduler: args lack rollout_batch_size / n_samples_per_prompt ({exc})"
        ) from None


def scheduler_position(args, iteration: int) -> int:
    """Where rollouts 0..iteration left the scheduler: (iteration + 1) x samples per rollout."""
    return (int(iteration) + 1) * samples_per_rollout(args)
