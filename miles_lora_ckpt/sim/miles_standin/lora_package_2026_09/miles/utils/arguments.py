"""Stand-in of miles/utils/arguments.py: megatron's gloo switch is `use_gloo_process_groups` here (PR #2673)."""

from miles_lora_ckpt.sim.miles_standin.common import args as common


def parse_args(argv=None):
    return common.build_parser("use_gloo_process_groups").parse_args(argv)


def miles_validate_args(args) -> None:
    common.validate(args)
