"""Stand-in of miles/backends/megatron_utils/actor.py: the train actor's order of calls."""

from __future__ import annotations

import torch.distributed as dist
from miles.backends.megatron_utils.checkpoint import load_checkpoint
from miles.backends.megatron_utils.initialize import init
from miles.backends.megatron_utils.model import harness_train_step, initialize_model_and_optimizer, save
from miles.utils.misc import load_function

from miles_lora_ckpt_harness.miles_standin.common import send_ckpt, training
from miles_lora_ckpt_harness.miles_standin.common.megatron_lm import get_checkpoint_name
from miles_lora_ckpt_harness.miles_standin.common.weights import WeightBackups


class MegatronTrainRayActor:
    def init(
        self, args, role, *, with_ref=False, with_opd_teacher=False, recv_ckpt_src_rank=None, indep_dp_info
    ) -> int:
        """`indep_dp_info`: the actor's data-parallel cell (`common/indep_dp.py`), passed on as in Miles."""
        self.args, self.role = args, role
        init(args, indep_dp_store_addr=None, indep_dp_info=indep_dp_info)  # ends with the init hook
        checkpointing_context = None
        if args.non_persistent_ckpt_type == "local":
            from miles.backends.megatron_utils.ft.in_memory_checkpoint import InMemoryCheckpointManager

            checkpointing_context = {"local_checkpoint_manager": InMemoryCheckpointManager()}
        self.model, self.optimizer, self.opt_param_scheduler, loaded_rollout_id = initialize_model_and_optimizer(
            args, role, checkpointing_context=checkpointing_context
        )
        start_rollout_id = loaded_rollout_id + 1
        self._last_rollout_id = loaded_rollout_id  # Miles: set by `train` only; here `send_ckpt` works after a load
        self.weights = WeightBackups(self.model)
        if with_ref:
            self.load_other_checkpoint("ref", args.ref_load)
        if args.keep_old_actor:
            self.load_other_checkpoint("old_actor", args.load)
        return start_rollout_id

    def train(
        self, rollout_id: int, rollout_data_ref, witness_info=None, attempt: int = 0, external_data=None
    ) -> list[float]:
        """`rollout_data_ref`: Miles' Ray object ref (None: the harness's data is seeded); the others unused."""
        self._last_rollout_id = rollout_id
        return [
            harness_train_step(self.args, rollout_id, step_id, self.model, self.optimizer, self.opt_param_scheduler)
            for step_id in range(training.steps_per_rollout(self.args))
        ]

    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        """`force_sync`: Miles finalises an async save before returning; the stand-in saves synchronously."""
        save(rollout_id, self.model, self.optimizer, self.opt_param_scheduler)
        if self.args.save_hf is not None and self.role == "actor":
            from miles.backends.megatron_utils.hf_export import save_hf_model

            save_hf_model(self.args, rollout_id, self.model)
        if self.args.custom_megatron_post_save_hook_path is not None and dist.get_rank() == 0:
            checkpoint_dir = get_checkpoint_name(self.args.save, rollout_id, return_base_dir=True)
            hf_checkpoint_dir = (
                self.args.save_hf.format(rollout_id=rollout_id)
                if self.args.save_hf is not None and self.role == "actor"
                else None
            )
            post_save_hook = load_function(self.args.custom_megatron_post_save_hook_path)
            post_save_hook(self.args, rollout_id, checkpoint_dir, hf_checkpoint_dir)

    def load_other_checkpoint(self, model_tag: str, path: str) -> None:
        names = ("load", "no_load_optim", "no_load_rng", "finetune")
        old = {name: getattr(self.args, name) for name in names}
        self.args.load, self.args.no_load_optim, self.args.no_load_rng, self.args.finetune = path, True, True, True
        try:
            with self.weights.loading(model_tag):
                load_checkpoint(self.model, None, None, checkpointing_context={}, skip_load_to_model_and_opt=False)
        finally:
            for name, value in old.items():
                setattr(self.args, name, value)

    def send_ckpt(self, dst_rank: int):
        """Miles sends to `dst_rank`; one cell here: `send_ckpt.in_memory_checkpoint` returns it."""
        return send_ckpt.in_memory_checkpoint(self)
