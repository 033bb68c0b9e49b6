"""Stand-in of miles/utils/arguments.py: megatron's gloo switch is `use_gloo_process_groups` here (PR #2673)."""

from miles_lora_ckpt_harness.miles_standin.common import args as common


def parse_args(add_custom_arguments=None):
    """Miles' signature: the command line is sys.argv (`common.command_line`)."""
    return common.parse("use_gloo_process_groups", add_custom_arguments)


def miles_validate_args(args) -> None:
    common.validate(args)
