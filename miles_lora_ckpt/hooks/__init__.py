"""Entry points Miles loads by dotted path; all the logic lives in `miles_lora_ckpt.integration`.

Add both to the Miles launch command. Every train actor process calls the first once; the rollout
manager builds its data source from the second::

    --custom-megatron-init-path miles_lora_ckpt.hooks.megatron_init
    --data-source-path miles_lora_ckpt.hooks.CheckpointedDataSource

A multi-LoRA run names `miles_lora_ckpt.hooks.CheckpointedMultiLoRADataSource` instead.
`MILES_LORA_CKPT_CONFIG` may name a config file (docs/use-with-miles.md, "Config keys").
`post_save` is not for users: the init hook puts it in front of the user's own post-save hook, so
that hook receives the committed generation directory.
"""

from __future__ import annotations

__all__ = [
    "megatron_init",
    "post_save",
    "CheckpointedDataSource",
    "generate_rollout",
    "CheckpointedMultiLoRADataSource",
    "generate_multi_lora_rollout",
]


def megatron_init(args) -> None:
    """Miles' `--custom-megatron-init-path` hook: bind the plugin into this training process.

    Takes Miles' parsed args and returns nothing. A run the plugin cannot checkpoint raises a
    MilesLoraCkptError, the same on every rank, before anything in Miles is patched."""
    from miles_lora_ckpt.integration.install import install

    install(args)


def post_save(args, rollout_id, checkpoint_dir, hf_checkpoint_dir) -> None:
    """Miles' post-save hook slot, installed by `megatron_init`: runs the user's hook, if any, with
    the committed generation directory as `checkpoint_dir`."""
    from miles_lora_ckpt.integration.install import run_user_post_save_hook

    run_user_post_save_hook(args, rollout_id, checkpoint_dir, hf_checkpoint_dir)


_ROLLOUT_SIDE = {"CheckpointedDataSource", "generate_rollout"}
_MULTI_LORA_SIDE = {"CheckpointedMultiLoRADataSource", "generate_multi_lora_rollout"}


def __getattr__(name: str):
    """The rollout manager's entry points, imported on first use: Miles' `load_function` does
    `getattr(module, name)`.

    `CheckpointedDataSource` and `CheckpointedMultiLoRADataSource` are for `--data-source-path`.
    `generate_rollout` and `generate_multi_lora_rollout` are what those put in front of
    `--rollout-function-path`. Any other name raises AttributeError."""
    if name in _MULTI_LORA_SIDE:
        from miles_lora_ckpt.integration import multi_lora_data_source

        return getattr(multi_lora_data_source, name)
    if name in _ROLLOUT_SIDE:
        from miles_lora_ckpt.integration import data_source

        return getattr(data_source, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
