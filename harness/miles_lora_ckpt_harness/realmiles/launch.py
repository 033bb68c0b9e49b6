"""One launch of the real Miles wheel (miles-rl 0.0.2), as one rank of a harness job: `launch_job`.

Real here: the wheel's `miles.backends.megatron_utils` modules `lora_utils`, `checkpoint` and
`model`, `miles.utils.misc`, the wheel's Megatron-LM `megatron.training.global_vars`, and
megatron-core's optimizers. The plugin, when the command has its init hook, binds to these very
module objects.

The harness's part, and why:

- Argument parsing is the stand-in parser (`miles_standin.common.args`) plus the attributes the
  wheel's functions read. The wheel's own `parse_args` forces `start_rollout_id = 0` in bridge mode
  (before Miles #2682), so its driver would replay from rollout 0. `realmiles/wheel_args.py` runs
  the wheel's parsing, validation and `init` for real and shows the hook refusing that relaunch.
- `initialize.init`: the harness sets the args, builds megatron's parallel state and Miles'
  `ParallelState` from it, and calls the hook with the wheel's `load_function`, as `init` does.
- The train actor: with `wheel_actor`, the wheel's actor module is imported before the hook, and
  its own `MegatronTrainRayActor.save_model` saves. Its `init` and `train` need Ray and rollout
  data, so `RealWheelActor` follows their order of calls.
- In the wheel's `model` module, `setup_model_and_optimizer` builds the harness's model and
  optimizers (`sim.train.build_run`), because Miles' builds a GPTModel on GPU. `clear_memory` is gc
  only.
- The driver loop starts at rollout 0 when `--load` has no Megatron tracker, else at the actors'
  returned rollout, as radixark/miles 31f1ca961a94 does. It trains and saves at Miles' cadence.
- Megatron-Bridge is the harness's double (`bridge_double`), whose `load_hf_weights` writes
  nothing: the frozen base weights are the run's seeded ones.

Payload and report are those of `miles_standin.launch`, plus `tier` (the wheel's folder) and
`wheel_actor`. The latter loads the wheel's train actor module before the hook, as Miles does, and
saves through its `MegatronTrainRayActor.save_model` (`standins.ACTOR_STANDINS`).
"""

from __future__ import annotations

import copy
import gc
import importlib
import sys
import traceback

# attributes the wheel's functions read that the stand-in parser does not declare (Miles' defaults)
WHEEL_DEFAULTS = {
    "ci_test": False,
    "ci_save_model_hash": False,
    "ci_check_model_hash": False,
    "moe_use_upcycling": False,
    "pretrained_checkpoint": None,
    "debug_disable_optimizer": False,
    "load_main_params_from_ckpt": False,
    "low_memory_resume": False,
    "overlap_param_gather": False,
    "align_param_gather": False,
    "debug_rollout_only": False,
    "offload_train": False,
    # what the wheel's data source reads (the rollout manager, `miles_standin.common.rollout`)
    "chat_template_path": None,
    "dump_details": None,
    "rollout_max_prompt_len": None,
    "multimodal_keys": None,
    "metadata_key": "metadata",
    "tool_key": "tools",
    "apply_chat_template": False,
    "apply_chat_template_kwargs": {},
    "buffer_filter_path": None,
}


class RealWheelActor:
    """The train actor's order of calls (init hook, model setup + load, train, save) on the wheel."""

    def __init__(self, wheel_actor: bool = False):
        self.wheel_actor = wheel_actor  # save through the wheel's MegatronTrainRayActor.save_model

    def init(self, args, role: str = "actor") -> int:
        from megatron.training.global_vars import set_args
        from miles.backends.megatron_utils import model as wheel_model
        from miles.backends.megatron_utils.parallel import create_megatron_parallel_state
        from miles.backends.training_utils.parallel import set_parallel_state
        from miles.utils.misc import load_function

        from miles_lora_ckpt_harness.miles_standin.common import training
        from miles_lora_ckpt_harness.miles_standin.common.weights import WeightBackups

        self.args, self.role = args, role
        set_args(args)
        training.initialize_model_parallel(args)
        set_parallel_state(create_megatron_parallel_state())  # as the wheel's init does
        if self.wheel_actor:  # in Miles the actor module is loaded before its init calls the hook
            from miles_lora_ckpt_harness.realmiles import standins

            standins.install_for_actor()
            importlib.import_module("miles.backends.megatron_utils.actor")
        if args.custom_megatron_init_path:
            load_function(args.custom_megatron_init_path)(args)
        wheel_model.setup_model_and_optimizer = training.setup_model_and_optimizer
        wheel_model.clear_memory = lambda *a, **k: gc.collect()
        # the module attribute, rebound by the plugin when its hook ran
        self.model, self.optimizer, self.opt_param_scheduler, loaded = wheel_model.initialize_model_and_optimizer(
            args, role
        )
        self.weights = WeightBackups(self.model)
        return loaded + 1

    def train(self, rollout_id: int, rollout_data_ref=None) -> list[float]:
        from miles_lora_ckpt_harness.miles_standin.common import training

        return [
            training.train_one_step(
                self.args, rollout_id, step_id, self.model, self.optimizer, self.opt_param_scheduler
            )
            for step_id in range(training.steps_per_rollout(self.args))
        ]

    def save_model(self, rollout_id: int) -> None:
        """The actor's save_model on the wheel: model.save, then save_hf_model with --save-hf.

        With `wheel_actor`, the wheel's own `MegatronTrainRayActor.save_model` runs on this object (it
        reads `args`, `role`, `model`, `optimizer`, `opt_param_scheduler`, and calls the `save` the actor
        module bound by name at import, which the plugin rebinds as a late consumer)."""
        from miles.backends.megatron_utils import model as wheel_model

        if self.wheel_actor:
            from miles.backends.megatron_utils.actor import MegatronTrainRayActor

            MegatronTrainRayActor.save_model(self, rollout_id)
            return

        wheel_model.save(rollout_id, self.model, self.optimizer, self.opt_param_scheduler)
        if self.args.save_hf is not None and self.role == "actor":
            wheel_model.save_hf_model(self.args, rollout_id, self.model)


def run(argv: list[str], probe, wheel_actor: bool = False):
    """Parse, init, train every rollout from the actors' start rollout, saving at Miles' cadence."""
    from miles.utils.misc import should_run_periodic_action

    from miles_lora_ckpt_harness.miles_standin.common import args as standin_args
    from miles_lora_ckpt_harness.miles_standin.common.driver import drive

    args = standin_args.build_parser("enable_gloo_process_groups").parse_args(argv)
    standin_args.validate(args)
    for name, value in WHEEL_DEFAULTS.items():
        setattr(args, name, getattr(args, name, value))
    actor = RealWheelActor(wheel_actor)
    start = actor.init(copy.deepcopy(args), "actor")
    return drive(actor, args, start, probe, should_run_periodic_action)  # with the wheel's cadence


def wheel_modules() -> dict[str, str]:
    """`__file__` of every loaded `miles`/`megatron.training` module (the test checks they are the wheel's)."""
    return {
        name: getattr(module, "__file__", None) or ""
        for name, module in sys.modules.items()
        if module is not None and (name == "miles" or name.startswith(("miles.", "megatron.training")))
    }


def launch_job(payload: dict, ctx) -> dict:
    """Run the launch on the wheel; a rank whose run raised returns what it saw so far, with `failed` set."""
    from miles_lora_ckpt_harness import bridge_double
    from miles_lora_ckpt_harness.miles_standin import launch as standin_launch
    from miles_lora_ckpt_harness.realmiles import standins

    folder = standins.activate(payload["tier"])
    # the double: the real-Miles tier runs on megatron-core 0.16.1, with which Bridge 0.6.2 does not import
    bridge_double.install(variant="nvidia")
    bridge_double.AutoBridgeDouble.load_hf_weights = lambda self, model: None
    observer = standin_launch._Observer(ctx.rank, payload.get("crash"))
    report = observer.report
    report["failed"] = None
    try:
        actor = run(list(payload["argv"]), observer, payload.get("wheel_actor", False))
        report["final"] = standin_launch._digests(actor)
    except Exception:  # noqa: BLE001 - the launch failed on this rank: say how, keep what was observed
        report["failed"] = traceback.format_exc()[-4000:]
    report["plugin"] = standin_launch._plugin_report()
    report["modules"] = wheel_modules()
    report["tier"] = str(folder)
    report["standins"] = standins.installed()
    return report
