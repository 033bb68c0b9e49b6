"""PEFT export in a Miles run: `export.peft` (in every checkpoint) and Miles' `--save-hf` (HF PEFT adapter).

Both go through `savers.peft_export`: Megatron-Bridge converts, and the plugin owns every phase and
barrier. With `export.peft = true`, every generation committed for Miles' `save` also holds `peft/`.
Under `--save-hf DIR`, `DIR/adapter` becomes an export root whose `latest` names the newest export.
A multi-LoRA run exports per slot instead (`integration.multi_lora`); a v1 run does so by default
when it can.

`prepare` checks, in the init hook, everything an export needs and builds Bridge there. A run that
could not export is then refused at startup, on every rank and before anything is patched.
docs/peft-export.md, "PEFT export in a Miles run", and docs/multi-lora.md have the details.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from pathlib import Path

from miles_lora_ckpt.core import lease
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.integration.config import PluginConfig
from miles_lora_ckpt.integration.shapes import Shape
from miles_lora_ckpt.integration.startup import UnsupportedConfiguration
from miles_lora_ckpt.megatron import bridge_export
from miles_lora_ckpt.savers.peft_export import PeftExport

__all__ = [
    "prepare",
    "reasons",
    "exports_slots",
    "model_context",
    "publish_save_hf_adapter",
]

log = logging.getLogger("miles_lora_ckpt.integration")


def reasons(args, config: PluginConfig, *, lora: bool = True) -> list[str]:
    """Why this launch exports PEFT adapters: `export.peft = true (<source>)` and/or, in a LoRA run,
    `--save-hf DIR` (in a full-model run `--save-hf` is Miles' own HF export, untouched)."""
    found = []
    if config["export.peft"]:
        found.append(f"export.peft = true ({config.sources.get('export.peft', 'default')})")
    if lora and getattr(args, "save_hf", None):
        found.append(f"--save-hf {args.save_hf}")
    return found


def prepare(
    args,
    config: PluginConfig,
    shape: Shape,
    *,
    lora: bool,
    multi_lora: str | None = None,
    import_module: Callable = importlib.import_module,
    bridge_error: Callable[[], str | None] = bridge_export.import_error,
    slot_error: Callable[[], str | None] = bridge_export.slot_export_error,
) -> PeftExport | None:
    """Rank-local, in the init hook. The export this launch will run, Bridge already built; None when
    it exports nothing (export.peft off and, in a LoRA run (`lora`), no --save-hf). Raises
    UnsupportedConfiguration naming every problem, the key or flag, and the remedy.

    `multi_lora`: the bound multi-LoRA shape ("v1", "v2") of a `--multi-lora-n-adapters` run, else
    None. Per-slot exports also need Bridge's `expose_adapter_slot`; a v1 run with `export.peft` at
    its default exports when everything is there (`auto_slot_export`), and otherwise logs why not."""
    wanted = reasons(args, config, lora=lora)
    auto = not wanted and auto_slot_export(config, multi_lora, lora=lora)
    if not wanted and not auto:
        return None
    who = " and ".join(wanted) or "Miles v1 multi-LoRA (stock v1 writes adapter_model.safetensors in every step_N)"
    problems = []
    error = bridge_error()
    if error is not None:
        problems.append(f"the export runs through Megatron-Bridge, but `import megatron.bridge` fails here: {error}")
    elif multi_lora is not None and (why := slot_error()) is not None:
        problems.append(bridge_export.slot_problem_message(why))  # names the Bridge version and the remedy
    context, why = model_context(shape, import_module)
    if context is None:
        problems.append(why)
    if not getattr(args, "hf_checkpoint", None):
        problems.append("--hf-checkpoint is not set: pass the HF base model Bridge maps the adapter onto")
    if (getattr(args, "lora_rank", 0) or 0) <= 0:
        trains = "" if lora else " (this run trains no LoRA adapter, so there is nothing to export)"
        problems.append(f"--lora-rank is not set{trains}: the adapter's rank (adapter_config.json's r) comes from it")
    if not problems:
        export = PeftExport.from_miles_args(args, model_context=context)
        try:
            export.source.prepare()  # AutoBridge.from_hf_pretrained(--hf-checkpoint): refuses what it cannot map
        except Exception as exc:  # noqa: BLE001 - any failure to build Bridge is the refusal's reason
            problems.append(
                f"Megatron-Bridge cannot be built from --hf-checkpoint {args.hf_checkpoint}: {type(exc).__name__}: {exc}"
            )
        else:
            return export
    if auto:
        log.warning(
            "miles-lora-ckpt: Miles v1 multi-LoRA: the slot checkpoints will hold no PEFT adapter "
            "(adapter_model.safetensors, adapter_config.json), because:\n  - %s\nSet export.peft = false to "
            "silence this, or fix the above to export each slot as stock v1 does",
            "\n  - ".join(problems),
        )
        return None
    remedy = [
        "set export.peft = false (or MILES_LORA_CKPT_PEFT_EXPORT=0)" if config["export.peft"] else None,
        "drop --save-hf" if lora and getattr(args, "save_hf", None) else None,
    ]
    raise UnsupportedConfiguration(
        f"miles-lora-ckpt cannot export PEFT adapters for {who}:\n  - "
        + "\n  - ".join(problems)
        + f"\nFix the above, or {' and '.join(r for r in remedy if r)}."
    )


def auto_slot_export(config: PluginConfig, multi_lora: str | None, *, lora: bool) -> bool:
    """Whether a run exports each slot without `export.peft` asking: Miles v1 multi-LoRA with
    `export.peft` left at its default (stock v1 writes PEFT files in every step_N)."""
    return lora and multi_lora == "v1" and config.sources.get("export.peft", "default") == "default"


def exports_slots(config: PluginConfig, multi_lora: str | None, *, lora: bool) -> bool:
    """Whether the slot saves of a multi-LoRA run export (when `prepare` built an export)."""
    return multi_lora is not None and (bool(config["export.peft"]) or auto_slot_export(config, multi_lora, lora=lora))


def model_context(shape: Shape, import_module: Callable = importlib.import_module) -> tuple[Callable | None, str]:
    """`(Miles' patch_megatron_model, "")` for `shape`, or `(None, why not)`."""
    path = shape.bridge_model_context
    if path is None:
        return None, f"Miles shape {shape.name!r} names no context manager for Bridge calls (patch_megatron_model)"
    module_name, _, name = path.rpartition(".")
    try:
        module = import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        return None, f"Miles shape {shape.name!r}: {module_name} cannot be imported ({type(exc).__name__}: {exc})"
    function = getattr(module, name, None)
    if not callable(function):
        return None, f"Miles shape {shape.name!r}: {path} is absent"
    return function, ""


def publish_save_hf_adapter(export: PeftExport, model, root, *, iteration: int, keep: int | None) -> Path:
    """Collective. Miles' `--save-hf` LoRA export: publish the adapter as a new export of the export
    root `root` (`<save-hf dir>/adapter`); returns the export directory (`root/latest` points at it).

    Raises the same CheckpointError on every rank if any rank fails, with nothing published; Miles'
    `save_hf_model` around it then logs it on every rank (or re-raises with `raise_on_error`) and
    does not mark the directory `.complete`. Either way the coordinator releases the root's writer
    lease afterwards: each `--save-hf` directory is written once, and a held lease would be renewed
    for the rest of the run.
    """
    try:
        return export.publish(model, root, iteration=iteration, keep=keep)
    finally:
        if Consensus.default().rank == 0:
            try:  # after the last collective (or its error): must not raise on one rank only
                lease.release(Path(root))
            except OSError as exc:
                log.warning("miles-lora-ckpt: could not release the writer lease of %s: %s", root, exc)
