"""The `demo` and `bench` command lines, handed off by the plugin's `miles-lora-ckpt` CLI.

The plugin's CLI parses its own options (`--debug`, `--hmac-key-file`) and the command name, then
calls `run` with the command's remaining arguments; `--help` here prints the command's full help.
"""

from __future__ import annotations

import argparse

COMMANDS = ("demo", "bench")


def build_parser() -> argparse.ArgumentParser:
    """A parser of the harness's commands only, named as the plugin's CLI so `--help` reads the same
    (the tests parse `demo ...` argument lists with it)."""
    return _parsers()[0]


def run(command: str, argv: list[str]) -> int:
    """Parse `argv` with `command`'s parser and run it; argparse's own exits (`--help`: 0, a usage
    error: 2) become the return code."""
    if command not in COMMANDS:
        raise ValueError(f"the harness has no command {command!r} (it has {', '.join(COMMANDS)})")
    try:  # the command's own parser: its usage line and errors name `miles-lora-ckpt <command>`
        args = _parsers()[1][command].parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    return args.handler(args)


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from miles_lora_ckpt_harness.bench import command as bench
    from miles_lora_ckpt_harness.demo import command as demo

    parser = argparse.ArgumentParser(prog="miles-lora-ckpt")
    sub = parser.add_subparsers(metavar="COMMAND")
    bench.add_parser(sub)
    demo.add_parser(sub)
    return parser, dict(sub.choices)
