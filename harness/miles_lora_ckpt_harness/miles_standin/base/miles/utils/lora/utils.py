"""Stand-in of miles/utils/lora/utils.py (miles/utils/lora.py became a package)."""

from argparse import Namespace


def is_lora_enabled(args: Namespace) -> bool:
    return getattr(args, "lora_rank", 0) > 0 or getattr(args, "lora_adapter_path", None) is not None


def lora_rollout_enabled(args: Namespace) -> bool:
    return is_lora_enabled(args) and not getattr(args, "lora_train_only", False)
