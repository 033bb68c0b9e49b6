"""Facts: the real Miles signatures the stand-ins define, and what they define that Miles lacks.

Read from radixark/miles at commit `SOURCE_COMMIT` (31f1ca961a94, the snapshot the
`lora-utils-2026-08` shape stands for), as `ast` writes a `def`'s parameters without annotations,
with the file and line of the `def`. Only signatures are recorded here, no Miles code.
`tests/test_miles_standin_signatures.py` compares every stand-in function of all three shape
directories with this table. `scripts/check_standin_signatures.py` re-reads a Miles mirror and
reports where this table, or the list of stand-in modules, no longer says what the source says.

The other two shapes change only modules this source does not have (`lora/`, `function_registry`,
`training_utils/checkpoint_io`, `utils/lora/utils`). So every stand-in function in a module of
`SOURCE_MODULES`, in any shape, is compared with this one table.
"""

from __future__ import annotations

SOURCE_REPOSITORY = "radixark/miles"
SOURCE_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"

# the stand-in modules (any shape) that the source at SOURCE_COMMIT has, as a module or a package
SOURCE_MODULES = frozenset(
    {
        "miles",
        "miles.backends",
        "miles.backends.megatron_utils",
        "miles.backends.megatron_utils.actor",
        "miles.backends.megatron_utils.checkpoint",
        "miles.backends.megatron_utils.ft",
        "miles.backends.megatron_utils.ft.in_memory_checkpoint",
        "miles.backends.megatron_utils.hf_export",
        "miles.backends.megatron_utils.initialize",
        "miles.backends.megatron_utils.lora_utils",
        "miles.backends.megatron_utils.model",
        "miles.backends.megatron_utils.multi_lora_scheduler",
        "miles.backends.megatron_utils.multi_lora_utils",
        "miles.backends.training_utils",
        "miles.utils",
        "miles.utils.arguments",
        "miles.utils.lora",
        "miles.utils.megatron_bridge_utils",
        "miles.utils.misc",
    }
)

# dotted name -> (signature as `ast.unparse` writes the def's parameters without annotations, "file:line")
SIGNATURES_2026_08 = {
    "miles.backends.megatron_utils.actor.MegatronTrainRayActor.init": (
        "(self, args, role, *, with_ref=False, with_opd_teacher=False, recv_ckpt_src_rank=None, indep_dp_info)",
        "miles/backends/megatron_utils/actor.py:91",
    ),
    "miles.backends.megatron_utils.actor.MegatronTrainRayActor.load_other_checkpoint": (
        "(self, model_tag, path)",
        "miles/backends/megatron_utils/actor.py:814",
    ),
    "miles.backends.megatron_utils.actor.MegatronTrainRayActor.save_model": (
        "(self, rollout_id, force_sync=False)",
        "miles/backends/megatron_utils/actor.py:672",
    ),
    "miles.backends.megatron_utils.actor.MegatronTrainRayActor.send_ckpt": (
        "(self, dst_rank)",
        "miles/backends/megatron_utils/actor.py:850",
    ),
    "miles.backends.megatron_utils.actor.MegatronTrainRayActor.train": (
        "(self, rollout_id, rollout_data_ref, witness_info=None, attempt=0, external_data=None)",
        "miles/backends/megatron_utils/actor.py:386",
    ),
    "miles.backends.megatron_utils.checkpoint._is_megatron_checkpoint": (
        "(path)",
        "miles/backends/megatron_utils/checkpoint.py:173",
    ),
    "miles.backends.megatron_utils.checkpoint.load_checkpoint": (
        "(ddp_model, optimizer, opt_param_scheduler, checkpointing_context, skip_load_to_model_and_opt)",
        "miles/backends/megatron_utils/checkpoint.py:100",
    ),
    "miles.backends.megatron_utils.checkpoint.save_checkpoint_with_lora": (
        "(iteration, model, optimizer, opt_param_scheduler)",
        "miles/backends/megatron_utils/checkpoint.py:154",
    ),
    "miles.backends.megatron_utils.ft.in_memory_checkpoint.InMemoryCheckpointManager.__init__": (
        "(self)",
        "miles/backends/megatron_utils/ft/in_memory_checkpoint.py:15",
    ),
    "miles.backends.megatron_utils.ft.in_memory_checkpoint.InMemoryCheckpointManager.load": (
        "(self)",
        "miles/backends/megatron_utils/ft/in_memory_checkpoint.py:33",
    ),
    "miles.backends.megatron_utils.ft.in_memory_checkpoint.save_to_memory": (
        "(iteration, model, optimizer, opt_param_scheduler)",
        "miles/backends/megatron_utils/ft/in_memory_checkpoint.py:42",
    ),
    "miles.backends.megatron_utils.hf_export.save_hf_model": (
        "(args, rollout_id, model, *, path=None, raise_on_error=False)",
        "miles/backends/megatron_utils/hf_export.py:105",
    ),
    "miles.backends.megatron_utils.initialize.init": (
        "(args, indep_dp_store_addr=None, indep_dp_info=None)",
        "miles/backends/megatron_utils/initialize.py:64",
    ),
    "miles.backends.megatron_utils.lora_utils._is_adapter_param_name": (
        "(name)",
        "miles/backends/megatron_utils/lora_utils.py:188",
    ),
    "miles.backends.megatron_utils.lora_utils._load_training_state": (
        "(adapter_dir, optimizer, opt_param_scheduler)",
        "miles/backends/megatron_utils/lora_utils.py:593",
    ),
    "miles.backends.megatron_utils.lora_utils.is_lora_model": (
        "(model)",
        "miles/backends/megatron_utils/lora_utils.py:172",
    ),
    "miles.backends.megatron_utils.lora_utils.load_lora_adapter": (
        "(model, adapter_path, *, optimizer=None, opt_param_scheduler=None)",
        "miles/backends/megatron_utils/lora_utils.py:522",
    ),
    "miles.backends.megatron_utils.lora_utils.save_lora_checkpoint": (
        "(model, args, save_dir, *, optimizer=None, opt_param_scheduler=None, iteration=None)",
        "miles/backends/megatron_utils/lora_utils.py:407",
    ),
    "miles.backends.megatron_utils.model.initialize_model_and_optimizer": (
        "(args, role='actor', checkpointing_context=None)",
        "miles/backends/megatron_utils/model.py:920",
    ),
    "miles.backends.megatron_utils.model.save": (
        "(iteration, model, optimizer, opt_param_scheduler, checkpointing_context=None, non_persistent_ckpt=False)",
        "miles/backends/megatron_utils/model.py:873",
    ),
    "miles.backends.megatron_utils.model.setup_model_and_optimizer": (
        "(args, role='actor')",
        "miles/backends/megatron_utils/model.py:125",
    ),
    "miles.backends.megatron_utils.multi_lora_scheduler.drop_slot_scheduler": (
        "(optimizer, slot)",
        "miles/backends/megatron_utils/multi_lora_scheduler.py:74",
    ),
    "miles.backends.megatron_utils.multi_lora_scheduler.install_slot_scheduler": (
        "(args, optimizer, adapter, resume_step)",
        "miles/backends/megatron_utils/multi_lora_scheduler.py:67",
    ),
    "miles.backends.megatron_utils.multi_lora_utils._deregister_adapter": (
        "(adapter, args, model, optimizer)",
        "miles/backends/megatron_utils/multi_lora_utils.py:333",
    ),
    "miles.backends.megatron_utils.multi_lora_utils._register_adapter": (
        "(adapter, model)",
        "miles/backends/megatron_utils/multi_lora_utils.py:299",
    ),
    "miles.backends.megatron_utils.multi_lora_utils.adapter_shard_topology": (
        "()",
        "miles/backends/megatron_utils/multi_lora_utils.py:60",
    ),
    "miles.backends.megatron_utils.multi_lora_utils.all_megatron_checkpoints_exist": (
        "(step_dir, shard_names)",
        "miles/backends/megatron_utils/multi_lora_utils.py:80",
    ),
    "miles.backends.megatron_utils.multi_lora_utils.cleanup_adapters": (
        "(args, model, optimizer, adapters)",
        "miles/backends/megatron_utils/multi_lora_utils.py:391",
    ),
    "miles.backends.megatron_utils.multi_lora_utils.find_latest_checkpoint": (
        "(ckpt_dir)",
        "miles/backends/megatron_utils/multi_lora_utils.py:84",
    ),
    "miles.backends.megatron_utils.multi_lora_utils.load_adapters": (
        "(args, model, optimizer, adapters)",
        "miles/backends/megatron_utils/multi_lora_utils.py:365",
    ),
    "miles.backends.megatron_utils.multi_lora_utils.megatron_shard_name": (
        "(tp_rank, pp_rank, ep_rank, ep_size)",
        "miles/backends/megatron_utils/multi_lora_utils.py:51",
    ),
    "miles.backends.megatron_utils.multi_lora_utils.save_due_adapter_checkpoints": (
        "(args, model)",
        "miles/backends/megatron_utils/multi_lora_utils.py:448",
    ),
    "miles.backends.megatron_utils.multi_lora_utils.save_multi_lora_checkpoints": (
        "(args, model, adapter_steps, adapters)",
        "miles/backends/megatron_utils/multi_lora_utils.py:184",
    ),
    "miles.backends.megatron_utils.multi_lora_utils.slice_lora_to_rank": (
        "(hf_name, tensor, adapter_rank)",
        "miles/backends/megatron_utils/multi_lora_utils.py:158",
    ),
    "miles.backends.megatron_utils.multi_lora_utils.zero_optimizer_state_for_adapter": (
        "(optimizer, model, idx)",
        "miles/backends/megatron_utils/multi_lora_utils.py:118",
    ),
    "miles.utils.arguments.miles_validate_args": ("(args)", "miles/utils/arguments.py:2848"),
    "miles.utils.arguments.parse_args": ("(add_custom_arguments=None)", "miles/utils/arguments.py:2664"),
    "miles.utils.lora.is_lora_enabled": ("(args)", "miles/utils/lora.py:6"),
    "miles.utils.lora.lora_rollout_enabled": ("(args)", "miles/utils/lora.py:11"),
    "miles.utils.megatron_bridge_utils.patch_megatron_model": ("(model)", "miles/utils/megatron_bridge_utils.py:10"),
    "miles.utils.misc.load_function": ("(path, *, sync_required=False)", "miles/utils/misc.py:45"),
    "miles.utils.misc.should_run_periodic_action": (
        "(rollout_id, interval, num_rollout_per_epoch=None, num_rollout=None)",
        "miles/utils/misc.py:130",
    ),
}

# names a stand-in defines in a SOURCE_MODULES module that the source at SOURCE_COMMIT lacks there
NOT_DEFINED_IN_SOURCE = {
    "miles.backends.megatron_utils.actor.WeightBackups.__init__": "harness record of the ref/old-actor loads; Miles uses TensorBackuper",
    "miles.backends.megatron_utils.actor.WeightBackups.loading": "harness record of the ref/old-actor loads; Miles uses TensorBackuper",
    "miles.backends.megatron_utils.actor.get_checkpoint_name": "Megatron-LM's, imported by Miles (inside save_model)",
    "miles.backends.megatron_utils.checkpoint._load_checkpoint_megatron": "Megatron-LM's load_checkpoint, imported under this name",
    "miles.backends.megatron_utils.checkpoint.get_args": "Megatron-LM's, imported",
    "miles.backends.megatron_utils.checkpoint.save_checkpoint": "Megatron-LM's, imported",
    "miles.backends.megatron_utils.model.save_checkpoint": "Megatron-LM's, imported (through checkpoint)",
    "miles.backends.megatron_utils.model.harness_train_step": "the harness's training step (Miles: train_one_step)",
    "miles.backends.megatron_utils.multi_lora_utils.clear_adapter_slot": "Megatron-Bridge's, imported inside a function",
    "miles.backends.megatron_utils.multi_lora_utils.zero_adapter_slot_grads": "multi_lora_optimizer's, imported inside a function",
    "miles.backends.megatron_utils.multi_lora_utils.drop_slot_scheduler": "multi_lora_scheduler's, imported inside a function",
    "miles.backends.megatron_utils.multi_lora_utils.install_slot_scheduler": "multi_lora_scheduler's, imported inside a function",
}


def drift(standin: dict[str, str]) -> dict[str, str]:
    """What disagrees with the facts, by name.

    `standin` maps each stand-in function in a module of SOURCE_MODULES to
    `render_signature(f, defaults=True)`. A name neither in the table nor listed as not defined in
    the source is reported too: a new stand-in function must be checked against the source."""
    problems = {}
    for name, signature in sorted(standin.items()):
        if name in SIGNATURES_2026_08:
            real, where = SIGNATURES_2026_08[name]
            if signature != real:
                problems[name] = f"stand-in {signature}, Miles at 31f1ca961a94 {real} ({where})"
        elif name not in NOT_DEFINED_IN_SOURCE:
            problems[name] = f"stand-in {signature}: not in the table (check it against the 2026-08 source)"
    return problems
