"""What the plugin puts in place of Miles' multi-LoRA checkpoint functions (v1 and v2).

Each entry of `HANDLERS` is a factory `(original, target) -> replacement`, which `bindings` installs
wherever Miles binds the original by name. Replacements read the process's `runtime` at call time.
Each is collective, as the function it replaces, and saves or loads one slot root per adapter
through `savers.multi_lora`.

Miles v1 (`multi_lora_utils`; slot root `{adapter.config.save}/checkpoints`, reader names `step_N`):

`save_multi_lora_checkpoints`: each adapter's slot saved at its step, with its staged data state.
`find_latest_checkpoint`: the newest intact generation's step, agreed by every rank.
`_register_adapter`: Miles' own slot init, then the slot resumed.
`load_adapters`: Miles' loop without its whole-chain `reload_model_params`; then each slot's saved
scheduler state.
`_deregister_adapter`: the final save, then the slot cleared and its children reset.

Miles v2 (`lora/checkpoint.py`; slot root the named path's directory, reader name its basename):

`save_slot`: the slot saved at its children's agreed Adam step, the name a link.
`load_slot`: the named generation restored; only the slot's children touched.

Every slot save also exports the slot as an HF PEFT adapter when `runtime.slot_peft` says so
(`slot_export`), under stock v1's names at the top of the generation. A failed export fails that
save on every rank. docs/multi-lora.md, "Multi-LoRA in Miles", has the details.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch

from miles_lora_ckpt.core.consensus import Consensus, Outcome, attempt
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.integration import data_state, runtime
from miles_lora_ckpt.integration.startup import UnsupportedConfiguration
from miles_lora_ckpt.megatron import bridge_export
from miles_lora_ckpt.savers import multi_lora as saver
from miles_lora_ckpt.savers.peft_export import BridgeSource, ExportedWeight, PeftExport
from miles_lora_ckpt.savers.peft_export import format as peft_format

__all__ = [
    "HANDLERS",
    "slot_export",
    "slot_filter",
    "supported_kind",
]

log = logging.getLogger("miles_lora_ckpt.integration")

V1_HANDLERS = (
    "multi_lora_save",
    "multi_lora_find_latest",
    "multi_lora_register",
    "multi_lora_load_adapters",
    "multi_lora_deregister",
)
V2_HANDLERS = ("slot_save", "slot_load")
V1_HELPERS = ("clear_adapter_slot", "zero_adapter_slot_grads", "drop_slot_scheduler")  # read from the module
_SLOT_NAME = re.compile(r"\.adapter\.adapters\.(\d+)\.")


def supported_kind(bound_handlers) -> str | None:
    """ "v1" or "v2" when every replacement of that multi-LoRA shape is in the plan, else None."""
    handlers = set(bound_handlers)
    if set(V1_HANDLERS) <= handlers:
        return "v1"
    if set(V2_HANDLERS) <= handlers:
        return "v2"
    return None


# a slot generation saved from slot i resumes into slot j: `...adapter.adapters.{i}.` -> `{j}`
rename_miles_slot = saver.rename_by_pattern(_SLOT_NAME)


def slot_filter(slot: int) -> Callable[[str], bool]:
    """The adapter names of slot `slot`, as Miles/Bridge name them (`...adapter.adapters.{slot}.linear_in...`)."""

    def in_slot(name: str) -> bool:
        match = _SLOT_NAME.search(name)
        return match is not None and int(match.group(1)) == slot

    in_slot.__qualname__ = f"slot_filter({slot})"
    return in_slot


def _children(optimizer, slot: int) -> list[int] | None:
    if optimizer is None:
        return None
    indices = getattr(optimizer, "miles_slot_child_indices", None)
    if indices is None or slot not in indices:
        raise UnsupportedConfiguration(
            f"the optimizer has no miles_slot_child_indices[{slot}]: not Miles' multi-LoRA optimizer chain"
        )
    return list(indices[slot])


def _slot_spec(root: Path, slot: int, optimizer) -> saver.SlotSpec:
    """Slot `slot` of this run at `root`: Miles' slot filter and the slot's optimizer children."""
    return saver.SlotSpec.of(root, slot, slot_filter(slot), _children(optimizer, slot))


def _scheduler(optimizer, slot: int):
    return None if optimizer is None else getattr(optimizer, "miles_slot_schedulers", {}).get(slot)


def _keep() -> int | None:
    keep = runtime.current().config["save.keep"]
    return keep or None


PEFT_PREFIX = ""  # a slot generation holds its PEFT files at its top: Miles v1's stock names in step_N


def slot_export(slot: int, rank: int, alpha: float) -> PeftExport | None:
    """The PEFT export of slot `slot` (adapter rank `rank`, alpha `alpha`) for this run's slot saves,
    or None when the run does not export slots (`runtime.slot_peft`)."""
    rt = runtime.current()
    if not rt.slot_peft or rt.peft is None:
        return None
    base: PeftExport = rt.peft
    patch = base.source.model_context
    expose = bridge_export.expose_adapter_slot()

    def select_slot(model):
        stack = contextlib.ExitStack()
        if patch is not None:
            stack.enter_context(patch(model))
        stack.enter_context(expose(model, slot))
        return stack

    def to_rank(weight: ExportedWeight) -> ExportedWeight:
        cut = peft_format.slice_to_rank(weight.param_name, weight.weight, rank)
        return ExportedWeight(weight.param_name, cut, weight.megatron_name, weight.megatron_param_names)

    source = BridgeSource(
        base.source.bridge,
        hf_checkpoint=base.source.hf_checkpoint,
        model_context=select_slot,
        transform=to_rank,
        export_options=base.source.export_options,
    )
    return PeftExport(source=source, lora=dataclasses.replace(base.lora, r=int(rank), alpha=float(alpha)))


def _agreed_export(slot: int, rank, alpha) -> PeftExport | None:
    """Collective when the run exports slots: `slot_export`, built on every rank and agreed (a rank
    that cannot build it fails the save everywhere, before any collective of the save)."""
    if not runtime.current().slot_peft:
        return None
    built = attempt(slot_export, slot, rank, alpha)
    Consensus.default().agree("multi-lora slot export", built.map(lambda e: e is not None))
    return built.value


def _adapter_export(adapter) -> PeftExport | None:
    config, args = adapter.config, runtime.current().args
    rank = getattr(config, "rank", None) or args.lora_rank
    alpha = getattr(config, "alpha", None) or getattr(args, "lora_alpha", None) or rank
    return _agreed_export(adapter.slot, rank, alpha)


def _module(target) -> object:
    return importlib.import_module(target.module)


def _optimizer_of(model):
    rt = runtime.current()
    return rt.multi_lora_optimizers.get(id(model))


# --------------------------------------------------------------------------- v1


def _v1_root(adapter) -> Path | None:
    save = getattr(adapter.config, "save", None)
    return None if save is None else Path(save) / "checkpoints"


def multi_lora_save(original: Callable, target) -> Callable:
    """Factory for `HANDLERS`: Miles' original and its `Target` in, the replacement out.
    It saves each due adapter's slot at its step (module docstring, v1)."""

    @functools.wraps(original)
    def save_multi_lora_checkpoints(args, model, adapter_steps, adapters):
        optimizer = _optimizer_of(model)
        for name, adapter in adapters.items():  # dict order, the same on every rank (as Miles)
            root = _v1_root(adapter)
            if root is None:
                continue
            step = int(adapter_steps[name])
            rollout_data = _staged_slot_data_state(runtime.current(), root.parent, step, adapter.slot)
            save = saver.SlotSave(
                step=step,
                keep=_keep(),
                peft=_adapter_export(adapter),
                peft_prefix=PEFT_PREFIX,
                data_state=rollout_data,
                reader_names=[saver.v1_step_name(step)],
            )
            saver.save_slot(
                model,
                args,
                _slot_spec(root, adapter.slot, optimizer),
                save,
                optimizer=optimizer,
                opt_param_scheduler=_scheduler(optimizer, adapter.slot),
            )
            log.info("miles-lora-ckpt: adapter %s (slot %d) saved at step %d in %s", name, adapter.slot, step, root)

    return save_multi_lora_checkpoints


def multi_lora_find_latest(original: Callable, target) -> Callable:
    """Factory for `HANDLERS`: Miles' original and its `Target` in, the replacement out.
    It returns the newest intact generation's step, agreed by every rank."""

    @functools.wraps(original)
    def find_latest_checkpoint(ckpt_dir):
        step = saver.latest_slot_step(ckpt_dir)
        if step is None:
            return None, 0
        return Path(ckpt_dir) / saver.v1_step_name(step), int(step)

    return find_latest_checkpoint


class _SchedulerCapture:
    """Stands for a v1 slot's scheduler during its load: Miles installs the real one only after
    `_register_adapter` returns. Keeps the saved state the load restores (`load_state_dict`); a
    reposition (no saved state) is left to Miles' `install_slot_scheduler`."""

    def __init__(self):
        self.num_steps = 0
        self.saved: dict | None = None

    def state_dict(self) -> dict:
        """No live schedule yet (Miles installs the slot's scheduler after the load), so the load's
        hyperparameter check has no launch values to compare the saved scheduler with."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        self.saved = copy.deepcopy(state)

    def step(self, increment: int = 1) -> None:
        """A reposition from the iteration: Miles' `install_slot_scheduler` does the same."""


def _resume_slot(adapter, model, optimizer, args) -> int:
    root = _v1_root(adapter)
    children = _children(optimizer, adapter.slot)
    result = None
    capture = _SchedulerCapture() if optimizer is not None else None
    if root is not None:
        result = saver.load_slot(
            model,
            _slot_spec(root, adapter.slot, optimizer),
            optimizer=optimizer,
            opt_param_scheduler=capture,
            load_optim=not getattr(args, "no_load_optim", False),
            rename_slot=rename_miles_slot,
        )
    if result is not None and result.loaded and capture is not None and capture.saved is not None:
        runtime.current().multi_lora_schedulers.setdefault(id(model), {})[adapter.slot] = capture.saved
    if (result is None or not result.loaded) and optimizer is not None:
        fresh = attempt(saver.reset_slot_optimizer, optimizer, children, model)  # only this slot's masters
        Consensus.default().agree("multi-lora fresh slot", fresh)
    if result is None or not result.loaded:
        log.info("miles-lora-ckpt: adapter %s (slot %d) starts fresh", adapter.name, adapter.slot)
        return 0
    log.info(
        "miles-lora-ckpt: adapter %s (slot %d) resumed at step %d from %s",
        adapter.name,
        adapter.slot,
        result.iteration,
        result.path,
    )
    return int(result.iteration)


def _without_save(adapter):
    """A shallow copy of Miles' AdapterRun whose config has no save: Miles' own init, no scan."""
    view = copy.copy(adapter)
    view.config = copy.copy(adapter.config)
    view.config.save = None
    return view


def multi_lora_register(original: Callable, target) -> Callable:
    """Factory for `HANDLERS`: Miles' original and its `Target` in, the replacement out.
    It runs Miles' slot init, then resumes the slot from its slot root."""

    @functools.wraps(original)
    def _register_adapter(adapter, model):
        original(_without_save(adapter), model)  # Miles' slot init (rank, alpha; fresh weights)
        rt = runtime.current()
        pending = rt.multi_lora_pending.get(id(model))
        optimizer, args = pending if pending is not None else (None, rt.args)
        return _resume_slot(adapter, model, optimizer, args)

    return _register_adapter


class _NoChainRefresh:
    """The optimizer as Miles' `load_adapters` sees it under the plugin: everything is the optimizer's,
    except `reload_model_params`, which would copy every slot's bf16 params over its fp32 masters."""

    def __init__(self, optimizer):
        object.__setattr__(self, "_optimizer", optimizer)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_optimizer"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_optimizer"), name, value)

    def reload_model_params(self, state_dict=None) -> None:
        log.info("miles-lora-ckpt: the whole-chain master refresh after load_adapters is skipped")


def multi_lora_load_adapters(original: Callable, target) -> Callable:
    """Factory for `HANDLERS`: Miles' original and its `Target` in, the replacement out.
    It runs Miles' loop without the whole-chain refresh, then restores each slot's scheduler."""

    @functools.wraps(original)
    def load_adapters(args, model, optimizer, adapters):
        rt = runtime.current()
        rt.multi_lora_optimizers[id(model)] = optimizer
        rt.multi_lora_pending[id(model)] = (optimizer, args)
        rt.multi_lora_schedulers.pop(id(model), None)
        try:
            count = original(args, model, _NoChainRefresh(optimizer), adapters)
        finally:
            rt.multi_lora_pending.pop(id(model), None)
            saved = rt.multi_lora_schedulers.pop(id(model), {})
        # Miles installed each slot's scheduler, repositioned from the resumed step: the saved state wins
        restored = attempt(_restore_slot_schedulers, optimizer, saved)
        Consensus.default().agree("multi-lora slot schedulers", restored)
        return count

    return load_adapters


def _restore_slot_schedulers(optimizer, saved: dict[int, dict]) -> dict[int, int]:
    """Local. Each resumed slot's saved scheduler state into the scheduler Miles installed for it
    (megatron's `load_state_dict` steps by the saved count: from 0, so it lands exactly there)."""
    installed = getattr(optimizer, "miles_slot_schedulers", {})
    missing = sorted(slot for slot in saved if slot not in installed)
    if missing:
        raise UnsupportedConfiguration(
            f"Miles installed no scheduler for slot(s) {missing} in load_adapters (optimizer.miles_slot_schedulers): "
            "the saved scheduler state has nowhere to go"
        )
    done = {}
    for slot, state in sorted(saved.items()):
        scheduler = installed[slot]
        scheduler.num_steps = 0
        scheduler.load_state_dict(copy.deepcopy(state))
        done[slot] = int(scheduler.num_steps)
    runtime.current().multi_lora_scheduler_restores.update(done)
    return done


def multi_lora_deregister(original: Callable, target) -> Callable:
    """Factory for `HANDLERS`: Miles' original and its `Target` in, the replacement out.
    It makes the retiring adapter's final save, then clears the slot."""

    @functools.wraps(original)
    def _deregister_adapter(adapter, args, model, optimizer):
        module = _module(target)
        helpers = {name: getattr(module, name, None) for name in V1_HELPERS}
        missing = [name for name, fn in helpers.items() if fn is None]
        if missing:
            raise UnsupportedConfiguration(f"{target.module} has no {missing}: cannot retire a slot safely")
        slot, root = adapter.slot, _v1_root(adapter)
        children = _children(optimizer, slot)
        runtime.current().multi_lora_optimizers[id(model)] = optimizer

        def clear() -> None:
            helpers["clear_adapter_slot"](model, slot)

        if getattr(args, "save_interval", None) and root is not None:
            step = int(adapter.step)
            rollout_data = _staged_slot_data_state(runtime.current(), root.parent, step, slot)
            save = saver.SlotSave(
                step=step,
                keep=_keep(),
                peft=_adapter_export(adapter),
                peft_prefix=PEFT_PREFIX,
                reader_names=[saver.v1_step_name(step)],
                data_state=rollout_data,
            )
            saver.retire_slot(
                model,
                args,
                _slot_spec(root, slot, optimizer),
                save,
                optimizer=optimizer,
                opt_param_scheduler=_scheduler(optimizer, slot),
                clear_slot=clear,
            )
            log.info("miles-lora-ckpt: adapter %s (slot %d) retired at step %d", adapter.name, slot, step)
        else:
            cleared = attempt(lambda: (clear(), saver.reset_slot_optimizer(optimizer, children, model)))
            Consensus.default().agree("multi-lora retire", cleared)
        helpers["zero_adapter_slot_grads"](model, slot)
        helpers["drop_slot_scheduler"](optimizer, slot)

    return _deregister_adapter


# --------------------------------------------------------------------------- v2


def _split(path) -> tuple[Path, str]:
    path = Path(path)
    return path.parent, path.name


def _local_slot_step(optimizer, children) -> int:
    """The largest Adam `step` among this rank's params of the slot's children (0 if none)."""
    from miles_lora_ckpt.megatron.optimizer_children import chain

    best = 0
    for child in chain.select(optimizer, children):
        inner = getattr(child.optimizer, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            step = state.get("step")
            if step is not None:
                best = max(best, int(step.item() if isinstance(step, torch.Tensor) else step))
    return best


def slot_save(original: Callable, target) -> Callable:
    """Factory for `HANDLERS`: Miles' original and its `Target` in, the replacement out.
    It saves one slot as a generation of the named path's root (v2)."""

    @functools.wraps(original)
    def save_slot(model, optimizer, slot, path):
        rt = runtime.current()
        rt.multi_lora_optimizers[id(model)] = optimizer
        root, name = _split(path)
        children = _children(optimizer, slot)
        # the slot's step: its children's Adam step (whole params are sharded over ranks: agree on the max)
        steps = Consensus.default().agree("multi-lora slot step", attempt(_local_slot_step, optimizer, children))
        step = max(steps)
        rollout_data = _staged_slot_data_state(rt, root, step, int(slot))
        save = saver.SlotSave(
            step=step,
            keep=_keep(),
            peft=_agreed_export(
                int(slot), rt.args.lora_rank, getattr(rt.args, "lora_alpha", None) or rt.args.lora_rank
            ),
            peft_prefix=PEFT_PREFIX,
            reader_names=[name],
            data_state=rollout_data,
        )
        saver.save_slot(
            model,
            rt.args,
            _slot_spec(root, int(slot), optimizer),
            save,
            optimizer=optimizer,
            opt_param_scheduler=_scheduler(optimizer, slot),
        )
        log.info("miles-lora-ckpt: slot %d saved at step %d as %s", slot, step, path)

    return save_slot


def _staged_slot_data_state(rt, root: Path, step: int, slot: int) -> dict | None:
    """Collective: rank 0 takes the adapter's data state staged for this step under `root`.

    `root` is the adapter's save directory: v2's slot root, the parent of v1's `checkpoints`. A
    refusal raises on every rank before anything is written. Only rank 0 keeps the state."""
    consensus = Consensus.default()
    outcome = Outcome.success()
    if consensus.rank == 0:
        outcome = attempt(data_state.staged_for_slot, rt.config, rt.args, root, step, slot)
    consensus.agree("multi-lora data state", outcome.map(lambda _: None))
    return outcome.value


def slot_load(original: Callable, target) -> Callable:
    """Factory for `HANDLERS`: Miles' original and its `Target` in, the replacement out.
    It restores the named generation into one slot; only the slot's children change (v2)."""

    @functools.wraps(original)
    def load_slot(model, optimizer, slot, path, load_optimizer):
        runtime.current().multi_lora_optimizers[id(model)] = optimizer
        root, name = _split(path)
        result = saver.load_slot(
            model,
            _slot_spec(root, int(slot), optimizer),
            optimizer=optimizer,
            opt_param_scheduler=_scheduler(optimizer, slot),
            name=name,
            load_optim=bool(load_optimizer),
            rename_slot=rename_miles_slot,
        )
        if not result.loaded:
            raise CheckpointError(f"load_slot: nothing committed at {path}")
        log.info("miles-lora-ckpt: slot %d loaded step %d from %s", slot, result.iteration, result.path)

    return load_slot


HANDLERS: dict[str, Callable] = {
    "multi_lora_save": multi_lora_save,
    "multi_lora_find_latest": multi_lora_find_latest,
    "multi_lora_register": multi_lora_register,
    "multi_lora_load_adapters": multi_lora_load_adapters,
    "multi_lora_deregister": multi_lora_deregister,
    "slot_save": slot_save,
    "slot_load": slot_load,
}
