"""One launch of the Miles stand-in's multi-LoRA loop, as one rank of a harness job: `launch_job(payload, ctx)`.

The job runs `common.multi_lora.run` (Miles' `train_multi_lora_async.py`) with `payload["argv"]`,
the shape directory on sys.path and the launch's environment set by the launcher. It may SIGKILL
one rank during one save (`payload["crash"]`):

    {"argv": [...], "crash": {"adapter": "b", "step": 4, "rank": 1, "phase": "mid-write",
                              "reason": "periodic" | "retire"} | None, "bridge": "nvidia",
     "prompts_log": "<file>" | None}

Miles' GPU image has Megatron-Bridge, so every rank first installs the harness's Bridge double as
`megatron.bridge` (`bridge_double`, with `peft.multi_lora_layers.expose_adapter_slot`;
`payload["bridge"]`: "nvidia" by default, "fork", or None for a Miles without Bridge).

`phase` is a save phase of the plugin's protocol (`core.faults.SAVE_PHASES`; the stock saves have
before-write, mid-write and after-write).

Each rank returns, per adapter, the digests of its slot's state (`slot_digests`) after every one of
its steps and at the end. It adds those of a slot as it retires (`retired`) and as it comes back
(`joined`, right after its resume), the steps it trained and what the plugin installed. Under v1 it
also returns what `find_latest_checkpoint` gives for every adapter at the end. With prompt files,
rank 0 returns the prompt indices each adapter's steps trained on (`prompts`). It also appends them,
one JSON line a step, to `payload["prompts_log"]` when given, so a killed launch keeps them.
"""

from __future__ import annotations

import hashlib
import json
import traceback

from miles_lora_ckpt_harness.miles_standin.common import multi_lora
from miles_lora_ckpt_harness.miles_standin.common.multi_lora_lifecycles import lifecycle_for_shape


def slot_digests(model, optimizer, slot: int) -> dict[str, str]:
    """sha256 of every tensor and counter of one slot: adapter, fp32 masters, moments, steps, scheduler."""
    import torch

    from miles_lora_ckpt_harness.sim import multi_lora_model as slots

    out = {}

    def put(key, tensor):
        t = tensor.detach().cpu().contiguous().reshape(-1)
        out[key] = (
            f"{t.dtype}{list(tensor.shape)}:" + hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
        )

    names = {id(p): slots.slot_independent_name(n) for n, p in slots.slot_parameters(model, slot).items()}
    for pid, name in names.items():
        param = next(p for p in slots.slot_parameters(model, slot).values() if id(p) == pid)
        put(f"adapter/{name}", param)
    for child in slots.slot_children(optimizer, slot):
        for model_group, main_group in zip(child.float16_groups, child.fp32_from_float16_groups, strict=True):
            for model_param, main_param in zip(model_group, main_group, strict=True):
                name = names.get(id(model_param), "?")
                put(f"master/{name}", main_param)
                for key, value in child.optimizer.state.get(main_param, {}).items():
                    if torch.is_tensor(value):
                        put(f"state/{name}/{key}", value)
                    else:
                        out[f"state/{name}/{key}"] = repr(value)
        for index, group in enumerate(child.optimizer.param_groups):
            out[f"group{index}"] = repr({k: v for k, v in sorted(group.items()) if k != "params"})
    scheduler = getattr(optimizer, "miles_slot_schedulers", {}).get(slot)
    if scheduler is not None:
        out["scheduler"] = repr(sorted(scheduler.state_dict().items()))
    return out


class _Observer(multi_lora.Probe):
    def __init__(self, rank: int, crash: dict | None, prompts_log: str | None = None):
        self.rank, self.crash, self.prompts_log = rank, crash, prompts_log
        self.report: dict = {"steps": {}, "losses": {}}

    def after_register(self, lifecycle, adapters) -> None:
        self.report["registered_at"] = {a.name: a.step for a in adapters}

    def before_join(self, lifecycle, adapters, active) -> None:
        self.cotenants = {a.name: slot_digests(lifecycle.model, lifecycle.optimizer, a.slot) for a in active}

    def after_join(self, lifecycle, adapters, active) -> None:
        for adapter in adapters:  # what the slot holds right after it resumed (this rank's part)
            digests = slot_digests(lifecycle.model, lifecycle.optimizer, adapter.slot)
            self.report.setdefault("joined", {})[adapter.name] = {"slot": adapter.slot, "digests": digests}
        # the co-tenants' slots across those loads: the digest keys that changed (or appeared/vanished)
        changed = {}
        for other in active:
            before, after = self.cotenants[other.name], slot_digests(lifecycle.model, lifecycle.optimizer, other.slot)
            changed[other.name] = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        self.report["cotenants_changed_by_join"] = changed

    def after_step(self, lifecycle, adapter) -> None:
        self.report["steps"].setdefault(adapter.name, []).append(adapter.step)
        prompts = lifecycle.prompts.get(adapter.name, {}).get(adapter.step)
        if self.prompts_log and prompts is not None:  # appended as it trains: a killed launch keeps its lines
            line = {"adapter": adapter.name, "step": adapter.step, "prompts": prompts}
            with open(self.prompts_log, "a") as log:
                log.write(json.dumps(line) + "\n")

    def before_save(self, lifecycle, adapter, reason: str) -> None:
        if reason == "retire":  # what the slot holds when it leaves (this rank's part)
            digests = slot_digests(lifecycle.model, lifecycle.optimizer, adapter.slot)
            self.report.setdefault("retired", {})[adapter.name] = {"slot": adapter.slot, "digests": digests}
        crash = self.crash
        if crash and crash["rank"] == self.rank and crash["adapter"] == adapter.name and crash["step"] == adapter.step:
            if crash.get("reason", "periodic") == reason:
                from miles_lora_ckpt.core import faults

                faults.arm(crash["phase"], self.rank, "kill")


def launch_job(payload: dict, ctx) -> dict:
    """Run the launch; a rank whose run raised returns what it saw so far, with `failed` set."""
    if payload.get("bridge", "nvidia") is not None:
        from miles_lora_ckpt_harness import bridge_double

        # the double: slot exports need multi_lora_layers.expose_adapter_slot (Bridge main only, not 0.6.2)
        bridge_double.install(variant=payload.get("bridge", "nvidia"))
    observer = _Observer(ctx.rank, payload.get("crash"), payload.get("prompts_log"))
    report = observer.report
    report["failed"] = None
    try:
        lifecycle = multi_lora.run(list(payload["argv"]), lifecycle_for_shape(), observer)
    except Exception:  # noqa: BLE001 - the launch failed on this rank: say how
        report["failed"] = traceback.format_exc()[-4000:]
        return report
    adapters = multi_lora.controller().adapters.values()
    report["final"] = {a.name: slot_digests(lifecycle.model, lifecycle.optimizer, a.slot) for a in adapters}
    report["final_steps"] = {a.name: a.step for a in adapters}
    report["final_slots"] = {a.name: a.slot for a in adapters}
    report["prompts"] = {name: {str(k): v for k, v in steps.items()} for name, steps in lifecycle.prompts.items()}
    report["plugin"] = _plugin_report()
    report["find_latest"] = _find_latest(adapters)
    return report


def _find_latest(adapters) -> dict | None:
    """v1 only (collective): what `multi_lora_utils.find_latest_checkpoint` says of each adapter's root."""
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("miles.backends.megatron_utils.multi_lora_utils") is None:
        return None
    from miles.backends.megatron_utils import multi_lora_utils

    found = {}
    for adapter in adapters:
        if adapter.config.save is not None:
            path, step = multi_lora_utils.find_latest_checkpoint(Path(adapter.config.save) / "checkpoints")
            found[adapter.name] = [None if path is None else str(path), step]
    return found


def _plugin_report() -> dict | None:
    from miles_lora_ckpt.integration import runtime

    rt = runtime.installed()
    if rt is None:
        return None
    restores = {str(slot): steps for slot, steps in sorted(rt.multi_lora_scheduler_restores.items())}
    return {"shape": rt.shape.name, "bindings": rt.bindings, "slot_schedulers_restored": restores}
