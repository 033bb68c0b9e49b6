"""What the plugin puts in place of Miles' single-LoRA checkpoint functions.

Each entry of `HANDLERS` is a factory `(original, target) -> replacement`, which `bindings` installs
wherever Miles binds the original by name. Replacements bind their arguments to the original's
signature, so one factory serves every shape. They read the process's `runtime` at call time.

`save_checkpoint_with_lora`: a committed generation under the save root, and Megatron's tracker.
`save_lora_checkpoint`: without an optimizer (`--save-hf`), a PEFT adapter in the export root.
`load_checkpoint`: resume, Miles' base load then the newest generation (`integration.resume`); ref
and teacher loads get the adapter the first launch had, as an uninterrupted run does.
`load_lora_adapter`: `--lora-adapter-path`, and ref or teacher loads: weights only.
`load_training_state`: refused, because Miles' version unpickles and nothing of ours calls it.
`initialize_model_and_optimizer`: the scheduler stepped once; the start rollout from the load.
`save`: refuses Miles' in-memory FT checkpoint for LoRA models, which would be lost.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable

from miles_lora_ckpt.core import hyperparameters
from miles_lora_ckpt.core.consensus import Consensus, Outcome, attempt
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.integration import data_state, peft, resume, runtime
from miles_lora_ckpt.integration.startup import UnsupportedConfiguration, validate_startup
from miles_lora_ckpt.megatron import adapter_shards as shards
from miles_lora_ckpt.megatron.scheduler import reposition_scheduler, restore_scheduler, scheduler_state
from miles_lora_ckpt.savers.options import LoadOptions, SaveOptions
from miles_lora_ckpt.savers.single_lora.load import load_adapter_generation
from miles_lora_ckpt.savers.single_lora.save import save_adapter_generation

__all__ = [
    "HANDLERS",
    "save_options",
    "save_lora_checkpoint",
]

log = logging.getLogger("miles_lora_ckpt.integration")

FRESH_START = -1  # returned as the loaded iteration: Miles' actor starts at rollout -1 + 1 = 0


def _binder(original: Callable) -> Callable[[tuple, dict], dict]:
    signature = inspect.signature(original)

    def bind(args: tuple, kwargs: dict) -> dict:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    return bind


def _is_lora_model(model) -> bool:
    lora = importlib.import_module(runtime.current().shape.lora_module)
    return bool(lora.is_lora_model(model))


def _agree_on_rank0(phase: str, fn: Callable, *args, consensus: Consensus | None = None):
    """Collective: `fn` runs on rank 0 only; every rank gets its value, or raises the same error."""
    consensus = consensus or Consensus.default()
    outcome = attempt(fn, *args) if consensus.rank == 0 else Outcome.success()
    return consensus.agree(phase, outcome)[0]


# --------------------------------------------------------------------------- saving


def save_checkpoint_with_lora(original: Callable, target) -> Callable:
    """Factory for `HANDLERS`: Miles' original and its `Target` in, the replacement out.
    It commits a generation under the save root and writes Megatron's tracker."""
    bind = _binder(original)

    @functools.wraps(original)
    def replacement(*args, **kwargs):
        call = bind(args, kwargs)
        model = call["model"]
        if not _is_lora_model(model):
            return original(*args, **kwargs)  # full-model runs keep Megatron's own checkpoint
        rt = runtime.current()
        if not getattr(rt.args, "save", None):
            raise UnsupportedConfiguration("a LoRA save was requested without --save")
        iteration = int(call["iteration"])
        root = resume.save_root(rt.config, rt.args.save)
        options = save_options(rt, iteration, _staged_data_state(rt, root, iteration))
        if rt.config["save.async"]:
            _save_async(rt, model, call["optimizer"], call["opt_param_scheduler"], options)
            return None
        generation = save_adapter_generation(
            model, rt.args, root, options, optimizer=call["optimizer"], opt_param_scheduler=call["opt_param_scheduler"]
        )
        _agree_on_rank0("miles-tracker", resume.write_megatron_tracker, rt.args.save, iteration)
        rt.saved[iteration] = generation
        log.info("miles-lora-ckpt: committed %s (rollout %d)", generation, iteration)
        return None

    return replacement


def save_options(rt, iteration: int | None, rollout_data: dict | None = None) -> SaveOptions:
    """The options of this run's LoRA saves, from the plugin config, with `rollout_data` as the data
    state. With `export.peft`, the PEFT export, whose failure fails the save. Not with `save.async`,
    whose snapshot cannot run the export over the live model."""
    export = rt.peft if rt.config["export.peft"] and not rt.config["save.async"] else None
    return SaveOptions(iteration=iteration, keep=rt.config["save.keep"] or None, peft=export, data_state=rollout_data)


def _staged_data_state(rt, root, iteration: int) -> dict | None:
    """Collective: rank 0 takes the rollout data state of this rollout (`integration.data_state`);
    a refusal raises on every rank before anything is written. Only rank 0 keeps the state."""
    consensus = Consensus.default()
    outcome = Outcome.success()
    if consensus.rank == 0:
        outcome = attempt(data_state.staged_for_save, rt.config, rt.args, root, iteration)
    consensus.agree("miles-data-state", outcome.map(lambda _: None))
    return outcome.value


def _save_async(rt, model, optimizer, scheduler, options: SaveOptions) -> None:
    """save.async: copy the state now (collective), then write, commit, publish and write Megatron's
    tracker in the background on the saver's own group (`savers.single_lora.async_save`). The last
    rollout's save (`iteration == --num-rollout - 1`) waits for its commit before returning: Miles'
    driver may end the process as soon as the loop ends."""
    from miles_lora_ckpt.savers.single_lora.async_save import AsyncSaver

    if rt.async_saver is None:
        rt.async_saver = AsyncSaver()  # collective: every rank's first LoRA save makes the group

    iteration = options.iteration

    def after_commit(generation: str, consensus: Consensus) -> None:
        _agree_on_rank0("miles-tracker", resume.write_megatron_tracker, rt.args.save, iteration, consensus=consensus)
        rt.saved[iteration] = generation
        log.info("miles-lora-ckpt: committed %s (rollout %d, in the background)", generation, iteration)

    root = resume.save_root(rt.config, rt.args.save)
    pending = rt.async_saver.submit(
        model, rt.args, root, options, optimizer=optimizer, opt_param_scheduler=scheduler, then=after_commit
    )
    log.info("miles-lora-ckpt: rollout %d copied in %.3f s, committing in the background", iteration, pending.blocked_s)
    last = getattr(rt.args, "num_rollout", None)
    if isinstance(last, int) and iteration >= last - 1:
        wait_for_async_save(rt)


def wait_for_async_save(rt) -> None:
    """save.async: wait for the save in flight to commit; its failure raises here, the same
    CheckpointError on every rank (each rank's wait is local; the error was agreed in the background)."""
    if rt.async_saver is not None:
        rt.async_saver.wait()


def save_lora_checkpoint(original: Callable, target) -> Callable:
    """Factory for `HANDLERS`: Miles' original and its `Target` in, the replacement out.
    Without an optimizer (`--save-hf`) it publishes a PEFT adapter into the export root."""
    bind = _binder(original)

    @functools.wraps(original)
    def replacement(*args, **kwargs):
        call = bind(args, kwargs)
        rt = runtime.current()
        wait_for_async_save(rt)  # --save-hf runs right after the save: publish what it committed
        if call["optimizer"] is None and rt.peft is not None:
            # Miles' --save-hf: save_lora_checkpoint(model, args, "<save-hf dir>/adapter"), no rollout id;
            # it runs right after this process committed that rollout's save
            iteration = call["iteration"] if call["iteration"] is not None else max(rt.saved, default=0)
            options = save_options(rt, iteration)
            published = peft.publish_save_hf_adapter(
                rt.peft, call["model"], call["save_dir"], iteration=iteration, keep=options.keep
            )
            log.info("miles-lora-ckpt: published the HF PEFT adapter %s", published)
            return str(published)
        peft_export = rt.peft if rt.config["export.peft"] else None
        generation = save_adapter_generation(
            call["model"],
            call["args"],
            call["save_dir"],
            SaveOptions(iteration=call["iteration"], peft=peft_export),
            optimizer=call["optimizer"],
            opt_param_scheduler=call["opt_param_scheduler"],
        )
        log.info("miles-lora-ckpt: committed %s", generation)
        return generation

    return replacement


def save(original: Callable, target) -> Callable:
    """Factory for `HANDLERS`: Miles' original and its `Target` in, the replacement out.
    It refuses Miles' in-memory FT checkpoint for LoRA models."""
    bind = _binder(original)

    @functools.wraps(original)
    def replacement(*args, **kwargs):
        call = bind(args, kwargs)
        # the miles-rl 0.0.2 wheel's save has neither parameter
        in_memory = call.get("non_persistent_ckpt") or _in_memory(call.get("checkpointing_context"))
        if in_memory and _is_lora_model(call["model"]):
            raise UnsupportedConfiguration(_IN_MEMORY_REFUSAL)
        return original(*args, **kwargs)

    return replacement


_IN_MEMORY_REFUSAL = (
    "Miles' in-memory fault-tolerance checkpoint (--non-persistent-ckpt-type local, FT heal) cannot hold "
    "a LoRA optimizer state: stock Miles writes such a save to disk and leaves the manager empty; "
    "miles-lora-ckpt refuses it instead. Resume from the committed generation: relaunch the same command"
)


def _in_memory(context) -> bool:
    return bool(context) and "local_checkpoint_manager" in context


# --------------------------------------------------------------------------- loading


def load_checkpoint(original: Callable, target) -> Callable:
    """Factory for `HANDLERS`: Miles' original and its `Target` in, the replacement out.
    It runs Miles' base load, then restores the newest generation (`integration.resume`)."""
    bind = _binder(original)

    @functools.wraps(original)
    def replacement(*args, **kwargs):
        call = bind(args, kwargs)
        rt = runtime.current()
        wait_for_async_save(rt)
        model, optimizer = call["ddp_model"], call["optimizer"]
        if _in_memory(call["checkpointing_context"]) and _is_lora_model(model):
            raise UnsupportedConfiguration(_IN_MEMORY_REFUSAL)
        if optimizer is not None:
            _agree_optimizer_supported(optimizer, model)
        root = resume.plugin_root(rt.config, getattr(rt.args, "load", None))
        if root is None:
            if optimizer is None and rt.initial_adapter is not None:
                _put_initial_adapter(rt, model)  # ref/teacher: what the first launch's load saw
            return original(*args, **kwargs)  # a fresh run, or a ref/teacher load: Miles' own path
        flags = resume.LoadFlags.from_args(rt.args)
        with resume.overridden(rt.args, resume.base_load_overrides(rt.args)):
            _, flops = original(*args, **kwargs)  # the base model, as on a first launch
        iteration = _restore_generation(rt, root, model, optimizer, call["opt_param_scheduler"], flags)
        return iteration, flops

    return replacement


def _agree_optimizer_supported(optimizer, model) -> None:
    """Collective: `validate_startup` on the built optimizer and its model chunks, once per optimizer."""
    rt = runtime.current()
    if id(optimizer) in rt.validated_optimizers:
        return
    # stub children can differ between pipeline stages: agree, so a refusal stops every rank
    Consensus.default().agree("miles-optimizer-check", attempt(validate_startup, None, optimizer, model))
    rt.validated_optimizers.add(id(optimizer))


def _restore_generation(rt, root, model, optimizer, scheduler, flags: resume.LoadFlags) -> int:
    """Collective: plan (rank 0 picks the generation) -> agree -> load -> scheduler position."""
    with_optimizer = optimizer is not None
    path = _agree_on_rank0(
        "miles-resume-plan",
        lambda: resume.choose_generation(rt.config, root, flags, with_optimizer=with_optimizer),
    )
    if path is None:
        log.warning("miles-lora-ckpt: %s has no committed generation yet: starting from rollout 0", root)
        rt.fresh_start = with_optimizer
        return 0
    if with_optimizer:  # the adapter as Miles built it: ref and teacher loads start from it, as before
        rt.initial_adapter = {name: p.detach().cpu().clone() for name, p in shards.adapter_params(model).items()}
    restore_optimizer = with_optimizer and not flags.finetune
    options = resume.load_options(rt.config, rt.args, flags, with_optimizer=with_optimizer)
    try:
        result = load_adapter_generation(
            model, path, options, optimizer=optimizer, opt_param_scheduler=scheduler if restore_optimizer else None
        )
    except CheckpointError as exc:  # raised on every rank alike; model and optimizer were rolled back
        if "OptimizerParamScheduler" not in str(exc) and hyperparameters.REFUSED not in str(exc):
            raise
        raise resume.ResumeRefused(
            f"{exc}\nThe command's optimizer hyperparameters or learning-rate schedule differ from the checkpoint's: "
            "add --use-checkpoint-opt-param-scheduler (continue with the checkpoint's) or "
            "--override-opt-param-scheduler (use the command's), or set resume.hyperparameters, or relaunch the "
            "original command"
        ) from exc
    for warning in result.warnings:
        log.warning("miles-lora-ckpt: %s", warning)
    if not result.loaded:
        raise resume.ResumeRefused(f"nothing could be loaded from {path}: {'; '.join(result.warnings)}")
    if restore_optimizer and scheduler is not None:
        if not result.scheduler_restored:  # --no-load-optim, or saved with --no-save-optim
            reposition_scheduler(scheduler, resume.scheduler_position(rt.args, result.iteration), 1)
        rt.scheduler_pin = scheduler_state(scheduler)
    if with_optimizer:
        restored = "adapter" + (", fp32 masters, moments" if result.optimizer_restored else ", masters refreshed")
        restored += ", scheduler" if result.scheduler_restored else ""
        log.info("miles-lora-ckpt: resumed %s from %s (rollout %s)", restored, result.path, result.iteration)
    if flags.finetune and with_optimizer:
        rt.fresh_start = True  # --finetune: the adapter only, and the rollout counter starts over
        return 0
    return int(result.iteration)


def _put_initial_adapter(rt, model) -> None:
    params = shards.adapter_params(model)
    if sorted(params) != sorted(rt.initial_adapter):
        raise UnsupportedConfiguration("a ref/teacher load got a model whose adapter differs from the actor's")
    shards.copy_into(params, rt.initial_adapter)


def load_lora_adapter(original: Callable, target) -> Callable:
    """Factory for `HANDLERS`: Miles' original and its `Target` in, the replacement out.
    It loads the adapter weights only (`--lora-adapter-path`, ref and teacher loads)."""
    bind = _binder(original)

    @functools.wraps(original)
    def replacement(*args, **kwargs):
        call = bind(args, kwargs)
        wait_for_async_save(runtime.current())
        # --lora-adapter-path: the initial adapter. Actor: a warm start (weights, masters refreshed,
        # fresh moments and scheduler; the rollout counter stays where Miles put it). Ref, teacher,
        # old actor (optimizer None): the weights, as stock Miles loads them.
        result = load_adapter_generation(
            call["model"], call["adapter_path"], LoadOptions(weights_only=True), optimizer=call["optimizer"]
        )
        for warning in result.warnings:
            log.warning("miles-lora-ckpt: %s", warning)
        return result.loaded, None

    return replacement


def load_training_state(original: Callable, target) -> Callable:
    """Factory for `HANDLERS`: Miles' original and its `Target` in, the replacement out.
    It refuses: Miles' version unpickles, and nothing of the plugin calls it."""

    @functools.wraps(original)
    def replacement(*args, **kwargs):
        raise UnsupportedConfiguration(
            f"{target.qualified} was called, but miles-lora-ckpt replaced the LoRA load that calls it; it would "
            "unpickle a training state that cannot restore a DistributedOptimizer anyway: refusing"
        )

    return replacement


def initialize_model_and_optimizer(original: Callable, target) -> Callable:
    """Factory for `HANDLERS`: Miles' original and its `Target` in, the replacement out.
    It re-applies the scheduler state the load decided, so the scheduler is stepped once."""

    @functools.wraps(original)
    def replacement(*args, **kwargs):
        rt = runtime.current()
        rt.scheduler_pin, rt.fresh_start = None, False
        model, optimizer, scheduler, iteration = original(*args, **kwargs)
        if optimizer is not None:
            _agree_optimizer_supported(optimizer, model)
        if rt.scheduler_pin is not None and scheduler is not None:
            scheduler.num_steps = 0  # undo Miles' step(iteration * global_batch_size) on top of it
            restore_scheduler(scheduler, rt.scheduler_pin)
        if rt.fresh_start:
            iteration = FRESH_START
        rt.scheduler_pin, rt.fresh_start = None, False
        return model, optimizer, scheduler, iteration

    return replacement


HANDLERS: dict[str, Callable] = {
    "save_checkpoint_with_lora": save_checkpoint_with_lora,
    "save_lora_checkpoint": save_lora_checkpoint,
    "save": save,
    "load_checkpoint": load_checkpoint,
    "load_lora_adapter": load_lora_adapter,
    "load_training_state": load_training_state,
    "initialize_model_and_optimizer": initialize_model_and_optimizer,
}
