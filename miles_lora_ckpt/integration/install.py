"""What `--custom-megatron-init-path miles_lora_ckpt.hooks.megatron_init` does, on every rank.

Miles calls the hook once per training process, after torch.distributed and megatron's parallel
state are up, before the model, the optimizer and any checkpoint load: the last moment to rebind
Miles' functions before they run. It reads as phases, and nothing in Miles changes before the last.
Prepare reads the config, detects the Miles shape, plans the bindings, runs the startup checks and
builds Bridge when the run exports. Then every rank agrees. Rank 0 prepares the save directory:
it refuses a relaunch Miles would restart at rollout 0 and writes Megatron's tracker. Every rank
agrees again. Bind applies every planned replacement, logged, and routes the user's post-save hook
through the plugin.

A problem in any phase raises the same error on every rank. A second call binds nothing.
docs/use-with-miles.md, "What the hook does", has the details.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from miles_lora_ckpt.core.consensus import Consensus, Outcome, attempt
from miles_lora_ckpt.integration import bindings, data_state, multi_lora, peft, resume, runtime
from miles_lora_ckpt.integration.config import PluginConfig, apply_core_settings, load_config
from miles_lora_ckpt.integration.shapes import Shape, detect_shape
from miles_lora_ckpt.integration.startup import validate_miles_launch
from miles_lora_ckpt.savers.peft_export import PeftExport

__all__ = [
    "install",
    "run_user_post_save_hook",
]

log = logging.getLogger("miles_lora_ckpt.integration")

POST_SAVE_HOOK = "miles_lora_ckpt.hooks.post_save"


@dataclass
class Prepared:
    """What the prepare phase decided on this rank, before anything in Miles changes."""

    config: PluginConfig
    shape: Shape
    plan: bindings.Plan
    peft: PeftExport | None = None  # the PEFT export this launch runs (see integration.peft)
    slot_peft: bool = False  # multi-LoRA: every slot save exports the slot (integration.multi_lora)

    @property
    def summary(self) -> dict:
        return {"shape": self.shape.name, "names": len(self.plan.bindings)}


def install(
    args,
    *,
    environ: Mapping[str, str] | None = None,
    import_module: Callable = importlib.import_module,
) -> runtime.Runtime:
    """Collective. Configure, detect, check, then bind the plugin into this Miles process."""
    # prepare: read and check everything; nothing is changed yet
    prepared = attempt(_prepare, args, environ, import_module)
    if prepared.ok:
        apply_core_settings(prepared.value.config)  # before the consensus group takes its timeout
    consensus = Consensus.default()
    consensus.agree("miles-lora-ckpt startup", prepared.map(lambda p: p.summary))
    ready: Prepared = prepared.value

    # save directory: rank 0 looks at --save and --load, the others wait for its verdict
    checked = attempt(_prepare_save_dir, args, ready.config) if consensus.rank == 0 else Outcome.success([])
    notes = consensus.agree("miles-lora-ckpt save directory", checked)[0]

    # bind: every replacement of the plan, then the user's post-save hook behind ours
    previous = runtime.installed()
    rt = (
        previous if previous is not None and previous.args is args else runtime.Runtime(args, ready.config, ready.shape)
    )
    rt.config, rt.shape, rt.peft = ready.config, ready.shape, ready.peft
    rt.slot_peft = ready.slot_peft
    runtime.set_current(rt)
    try:
        rt.bindings = bindings.apply(ready.plan)
    except BaseException:
        runtime.set_current(previous)
        raise
    _route_post_save_hook(args, rt)
    for note in notes:
        log.info("miles-lora-ckpt: %s", note)
    if consensus.rank == 0:
        log.info(
            "miles-lora-ckpt: bound to Miles shape %s (%d names); config %s",
            ready.shape.name,
            len(rt.bindings),
            "; ".join(ready.config.describe()),
        )
        if ready.slot_peft:
            log.info("miles-lora-ckpt: every slot save exports the slot as an HF PEFT adapter (stock v1 names)")
        if ready.peft is not None:
            log.info(
                "miles-lora-ckpt: PEFT export through Megatron-Bridge (%s, model context %s): %s",
                ready.shape.name,
                ready.shape.bridge_model_context,
                "; ".join(peft.reasons(args, ready.config, lora=_lora_enabled(args))),
            )
    return rt


def _prepare(args, environ, import_module) -> Prepared:
    config = load_config(environ)
    shape = detect_shape(import_module)
    plan = bindings.plan(shape, import_module)
    bound = [b.target.handler for b in plan.bindings]
    multi = multi_lora.supported_kind(bound) if (getattr(args, "multi_lora_n_adapters", 0) or 0) > 0 else None
    validate_miles_launch(args, config, multi_lora=multi_lora.supported_kind(bound))
    lora = _lora_enabled(args)
    export = peft.prepare(args, config, shape, lora=lora, multi_lora=multi, import_module=import_module)
    slot_peft = export is not None and peft.exports_slots(config, multi, lora=lora)
    return Prepared(config, shape, plan, export, slot_peft)


def _prepare_save_dir(args, config: PluginConfig) -> list[str]:
    if not _lora_enabled(args):
        return ["LoRA is not enabled in this run: the plugin leaves Megatron's own checkpoints alone"]
    if (getattr(args, "multi_lora_n_adapters", 0) or 0) > 0:
        return ["multi-LoRA: every adapter's checkpoints live in its own slot root (v1: <adapter save>/checkpoints)"]
    notes = resume.check_relaunch(config, args)
    if getattr(args, "save", None):
        notes.append(resume.prepare_save_dir(config, args.save))
        notes.append(data_state.startup_note(args))
    return notes


def _lora_enabled(args) -> bool:
    # Miles' is_lora_enabled: a rank, or an adapter path alone
    return (getattr(args, "lora_rank", 0) or 0) > 0 or getattr(args, "lora_adapter_path", None) is not None


def _route_post_save_hook(args, rt: runtime.Runtime) -> None:
    path = getattr(args, "custom_megatron_post_save_hook_path", None)
    if path and path != POST_SAVE_HOOK:
        rt.user_post_save_hook = path
        args.custom_megatron_post_save_hook_path = POST_SAVE_HOOK
        log.info("miles-lora-ckpt: the post-save hook %s now receives the committed generation directory", path)


def run_user_post_save_hook(args, rollout_id: int, checkpoint_dir, hf_checkpoint_dir) -> None:
    """Miles calls this on global rank 0 after a save: the user's hook, with the generation directory.

    Miles passes `{save}/iter_{rollout_id:07d}`, which a LoRA save under the plugin does not create;
    the user's hook gets the committed generation directory of that rollout instead. With save.async
    it first waits for that save to commit (blocking rank 0's training until then).
    """
    rt = runtime.current()
    if rt.user_post_save_hook is None:
        return
    pending = rt.async_saver.pending if rt.async_saver is not None else None
    if pending is not None and pending.join() is None:  # save.async: rank 0 only, so no raise here
        log.error(
            "miles-lora-ckpt: the save of rollout %s failed (every rank raises it at its next save): the post-save "
            "hook %s is not called",
            rollout_id,
            rt.user_post_save_hook,
        )
        return
    module_name, _, function_name = rt.user_post_save_hook.rpartition(".")
    hook = getattr(importlib.import_module(module_name), function_name)
    hook(args, rollout_id, rt.saved.get(int(rollout_id), checkpoint_dir), hf_checkpoint_dir)
