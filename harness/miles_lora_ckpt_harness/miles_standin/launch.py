"""One launch of the Miles stand-in, as one rank of a harness job: `launch_job(payload, ctx)`.

The job runs the stand-in's driver (Miles' train.py) with `payload["argv"]`, the shape directory
already on sys.path and the launch's environment (e.g. `MILES_LORA_CKPT_CONFIG`) already set by
the launcher, exactly as a user's launch command would run. Miles' GPU image has Megatron-Bridge,
so every rank first installs the Bridge double as `megatron.bridge`. `payload["bridge"]` picks the
variant: "nvidia" by default, "fork", or None for a Miles without Bridge. "real", in the Bridge
tier, has the real Megatron-Bridge 0.6.2 build the model and export it. The harness observes the run
through the driver's probe. It may SIGKILL one rank during one save, or make it raise there
(`payload["crash"]`):

    {"argv": [...], "crash": {"rollout": 5, "rank": 1, "phase": "mid-write", "action": "kill"} | None,
     "send_ckpt": false, "bridge": "nvidia", "drop": ["miles.backends.megatron_utils.lora_utils._load_training_state"],
     "views": false, "hf_merged_fails": [1]}

`drop` (optional) derives a tree variant from the shape: each named function is deleted from its
module before the launch. An example is the lora-utils-2026-08 tree without `_load_training_state`,
as PR #1792's branch and current working branches have it.

`phase` is a save phase of the plugin's protocol (`core.faults.SAVE_PHASES`; stock Miles' save has
`before-write`, `mid-write` and `after-write`), a PEFT export phase (`core.faults.PEFT_PHASES`), or
`between-saves`: right after rollout `rollout` trained, before its save (always a kill). `action`
is "kill" (default) or "raise" (`core.faults.InjectedFault`).

`hf_merged_fails` (optional): the rollouts at which the merged-model half of Miles' `--save-hf`
export (`save_hf_model`, `common.hf_merged`) fails on every rank, as a failed Bridge export would.

Each rank returns the start rollout, the rollouts trained and their losses by global step. It
returns digests of every training-state tensor after init, at each save and at the end
(`sim.snapshot`). It says whether the fp32 masters equal the adapter after init, and gives the
scheduler's step count after init and the adapter digests of ref and old-actor loads. It also
reports what the plugin installed and how many times Miles' `patch_megatron_model` was entered.
With `views` (the resharding demo) it adds the layout-independent global view (`sim.global_view`)
after init (`view_after_init`) and after each rollout trained (`views`, by rollout id).
"""

from __future__ import annotations

import os
import signal
import traceback

from miles_lora_ckpt_harness.miles_standin.common import driver


class _Observer(driver.Probe):
    def __init__(self, rank: int, crash: dict | None, views: bool = False):
        self.rank = rank
        self.crash = crash
        self.views = views
        self._consensus = None
        self.report: dict = {"losses": {}, "rollouts": [], "at_save": {}, "views": {}}

    def _view(self, actor) -> dict:
        """Collective: the global view of the actor's run (every rank reaches the same probe point)."""
        from miles_lora_ckpt.core.consensus import Consensus
        from miles_lora_ckpt_harness.sim.global_view import global_view

        if self._consensus is None:
            self._consensus = Consensus.for_world(timeout_s=120)
        view = global_view(_run(actor), self._consensus)
        return {"digests": view["digests"], "problems": view["problems"]}

    def after_init(self, actor, start_rollout_id: int) -> None:
        self.report["start_rollout_id"] = start_rollout_id
        self.report["after_init"] = _state(actor)
        if self.views:
            self.report["view_after_init"] = self._view(actor)

    def after_rollout(self, actor, rollout_id: int, losses: list[float]) -> None:
        from miles_lora_ckpt_harness.miles_standin.common.training import steps_per_rollout

        per = steps_per_rollout(actor.args)
        self.report["rollouts"].append(rollout_id)
        for step_id, loss in enumerate(losses):
            self.report["losses"][str(rollout_id * per + step_id)] = loss
        if self.views:
            self.report["views"][str(rollout_id)] = self._view(actor)
        if self._crashes_at(rollout_id, "between-saves"):
            os.kill(os.getpid(), signal.SIGKILL)

    def before_save(self, actor, rollout_id: int) -> None:
        # what this save is about to write (a save changes no training state), kept even if it fails
        self.report["at_save"][str(rollout_id)] = _digests(actor)
        if self._crashes_at(rollout_id) and self.crash["phase"] != "between-saves":
            from miles_lora_ckpt.core import faults

            faults.arm(self.crash["phase"], self.rank, self.crash.get("action", "kill"))

    def _crashes_at(self, rollout_id: int, phase: str | None = None) -> bool:
        crash = self.crash
        return (
            bool(crash)
            and crash["rollout"] == rollout_id
            and crash["rank"] == self.rank
            and phase in (None, crash["phase"])
        )

    def after_save(self, actor, rollout_id: int) -> None:
        self.report.setdefault("saved", []).append(rollout_id)

    def prompts(self, rollout_id: int, indices: list[int]) -> None:
        self.report.setdefault("prompts", {})[str(rollout_id)] = indices


def launch_job(payload: dict, ctx) -> dict:
    """Run the launch; a rank whose run raised returns what it saw so far, with `failed` set."""
    from miles_lora_ckpt_harness.miles_standin.common import bridge_utils

    if payload.get("bridge") == "real":  # the Bridge tier: the real Megatron-Bridge builds and exports
        from miles_lora_ckpt_harness.miles_standin.common import training

        training.use_real_bridge()
    elif payload.get("bridge", "nvidia") is not None:
        from miles_lora_ckpt_harness import bridge_double

        # the double: the stand-in trains the harness's own model (our LoRA), which 0.6.2 cannot export
        bridge_double.install(variant=payload.get("bridge", "nvidia"))
    for qualified in payload.get("drop", ()):
        import importlib

        module, _, name = qualified.rpartition(".")
        delattr(importlib.import_module(module), name)
    if payload.get("hf_merged_fails"):
        from miles_lora_ckpt_harness.miles_standin.common import hf_merged

        hf_merged.fail_at.update(int(r) for r in payload["hf_merged_fails"])
    observer = _Observer(ctx.rank, payload.get("crash"), bool(payload.get("views")))
    report = observer.report
    report["failed"] = None
    try:
        actor = driver.run(list(payload["argv"]), observer)
    except Exception:  # noqa: BLE001 - the launch failed on this rank: say how, keep what was observed
        report["failed"] = traceback.format_exc()[-4000:]
        report["plugin"] = _plugin_report()
        report["bridge_context_entries"] = bridge_utils.entries()
        return report
    if payload.get("bridge") == "real":
        report["real_bridge"] = _real_bridge_facts(actor)
    report["final"] = _digests(actor)
    report["tags"] = actor.weights.tags
    report["plugin"] = _plugin_report()
    report["bridge_context_entries"] = bridge_utils.entries()
    if payload.get("send_ckpt"):
        try:
            actor.send_ckpt(0)  # to alive rank 0 of the cross-cell group (the stand-in: one cell)
            report["send_ckpt_error"] = None
        except Exception as exc:  # noqa: BLE001 - the report says what Miles' FT path did
            report["send_ckpt_error"] = f"{type(exc).__name__}: {exc}"
    return report


def _real_bridge_facts(actor) -> dict:
    """Which Megatron-Bridge this rank ran, and whose LoRA wraps the model's fused QKV."""
    import megatron.bridge

    qkv = _run(actor).inner_model.decoder.layers[0].self_attention.linear_qkv
    return {
        "version": megatron.bridge.__version__,
        "is_double": getattr(megatron.bridge, "IS_TEST_DOUBLE", False),
        "qkv_wrapper": f"{type(qkv).__module__}.{type(qkv).__name__}",
    }


def _run(actor):
    from miles_lora_ckpt_harness.miles_standin.common.training import run_of

    return run_of(actor.model)


def _digests(actor) -> dict[str, str]:
    from miles_lora_ckpt_harness.sim.snapshot import snapshot, snapshot_digests

    return snapshot_digests(snapshot(_run(actor)))


def _state(actor) -> dict:
    from miles_lora_ckpt_harness.sim.snapshot import snapshot, snapshot_digests

    snap = snapshot(_run(actor))
    return {
        "digests": snapshot_digests(snap),
        "masters_match_adapter": masters_match_adapter(_run(actor)),
        "moments": sorted(name for name in snap if "/state/" in name and not name.endswith("/step")),
        "scheduler_num_steps": int(actor.opt_param_scheduler.num_steps),
    }


def masters_match_adapter(run) -> bool:
    """Every fp32 master (a DistributedOptimizer's shard, or a whole parameter) equals float() of
    its model parameter (the slice of it the shard covers): masters refreshed from the adapter."""
    from miles_lora_ckpt.megatron.optimizer_children import DISTRIBUTED
    from miles_lora_ckpt.megatron.optimizer_children.chain import param_states, select

    for child in select(run.optimizer):
        sharded = child.class_name == DISTRIBUTED and not child.layer_wise
        for model_param, master, _ in param_states(child):
            expected = model_param.detach().view(-1)
            if sharded:
                span = child.optimizer._get_model_param_range_map(model_param)["param"]
                expected = expected[span.start : span.end]
            if not master.detach().view(-1).equal(expected.float()):
                return False
    return True


def _plugin_report() -> dict | None:
    from miles_lora_ckpt.integration import runtime

    rt = runtime.installed()
    if rt is None:
        return None
    return {
        "shape": rt.shape.name,
        "bindings": rt.bindings,
        "saved": {str(k): v for k, v in rt.saved.items()},
        "async_saves": rt.async_saver is not None,  # save.async made the process's AsyncSaver
    }
