"""Entry points Miles loads by dotted path; all the logic lives in `miles_lora_ckpt.integration`.

Add to the Miles launch command (every train actor process calls it once)::

    --custom-megatron-init-path miles_lora_ckpt.hooks.megatron_init

and to the same command (the rollout manager builds its data source from it)::

    --data-source-path miles_lora_ckpt.hooks.CheckpointedDataSource

(multi-LoRA: `--data-source-path miles_lora_ckpt.hooks.CheckpointedMultiLoRADataSource`),

and, optionally, point `MILES_LORA_CKPT_CONFIG` at a config file (see `integration/config.py`).
`post_save` is not for users to pass: the init hook puts it in front of the user's own
`--custom-megatron-post-save-hook-path` so that hook receives the committed generation directory.
"""

from __future__ import annotations


def megatron_init(args) -> None:
    """Miles' `--custom-megatron-init-path` hook: bind the plugin into this training process."""
    from miles_lora_ckpt.integration.install import install

    install(args)


def post_save(args, rollout_id, checkpoint_dir, hf_checkpoint_dir) -> None:
    """Miles' post-save hook slot, installed by `megatron_init`: runs the user's hook, if any."""
    from miles_lora_ckpt.integration.install import run_user_post_save_hook

    run_user_post_save_hook(args, rollout_id, checkpoint_dir, hf_checkpoint_dir)


_ROLLOUT_SIDE = {"CheckpointedDataSource", "generate_rollout"}
_MULTI_LORA_SIDE = {"CheckpointedMultiLoRADataSource", "generate_multi_lora_rollout"}


def __getattr__(name: str):
    """The rollout manager's entry points, imported on first use (Miles' `load_function` does
    `getattr(module, name)`): `CheckpointedDataSource` for `--data-source-path`, and
    `generate_rollout`, which that data source puts in front of `--rollout-function-path`;
    `CheckpointedMultiLoRADataSource` for a multi-LoRA run's `--data-source-path`, and
    `generate_multi_lora_rollout`, which that one puts in front of `--rollout-function-path`."""
    if name in _MULTI_LORA_SIDE:
        from miles_lora_ckpt.integration import multi_lora_data_source

        return getattr(multi_lora_data_source, name)
    if name in _ROLLOUT_SIDE:
        from miles_lora_ckpt.integration import data_source

        return getattr(data_source, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
