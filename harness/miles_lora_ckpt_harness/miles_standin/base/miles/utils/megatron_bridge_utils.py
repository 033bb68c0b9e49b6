"""Stand-in of miles/utils/megatron_bridge_utils.py: `patch_megatron_model`, Miles' context for Bridge calls."""

from miles_lora_ckpt_harness.miles_standin.common.bridge_utils import patch_megatron_model

__all__ = ["patch_megatron_model"]
