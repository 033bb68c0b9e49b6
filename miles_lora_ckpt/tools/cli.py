"""`miles-lora-ckpt`: operator tools. Runs on a login node: no megatron, Miles or GPU needed.

The command never prints a traceback: every failure is one `ERROR ...` line and an exit code
(`EXIT_CODES`); `--debug` adds the traceback of an internal error. The login-node commands live in
`root_commands`, `verify-peft` and `export-peft` in `peft_tools`. `demo` and `bench` belong to the
harness, a separate distribution: the CLI hands their arguments to it, imported only when one of
them runs. Without the harness they print one line saying what to install.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from miles_lora_ckpt import __version__
from miles_lora_ckpt.core.errors import NotACheckpoint
from miles_lora_ckpt.tools.root_commands import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    cmd_gc,
    cmd_inspect,
    cmd_ls,
    cmd_verify,
)

__all__ = [
    "main",
    "build_parser",
]

EXIT_CODES = """\
exit codes:
  0    OK (verify: intact; ls and inspect: listed; gc: done)
  1    damaged, torn or uncommitted: one "ERROR <file>: <reason>" line per problem (verify,
       inspect; verify also for a PEFT adapter in it that PEFT would load wrongly); gc: an entry
       could not be removed, or no generation passed content verification
  2    not a checkpoint, usage error, or unusable configuration (e.g. the signing key)
  3    internal error: a bug in miles-lora-ckpt (rerun with --debug for its traceback; please report it)
  130  interrupted
"""

# Where the commands are documented (tests/test_docs.py checks that every page named in a help text exists).
DOCS = """
documentation: docs/cli.md (every command and flag), docs/use-with-miles.md, docs/file-format.md
  in the miles-lora-ckpt source tree
"""


def main(argv: list[str] | None = None) -> int:
    """Run `miles-lora-ckpt` on `argv` (default `sys.argv[1:]`); return the exit code, never raise.

    An internal error prints one line (the traceback with `--debug`) and returns `EXIT_INTERNAL`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print("INTERRUPTED", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the CLI never shows a traceback unless asked to
        if "--debug" in argv:
            traceback.print_exc()
        print(
            f"INTERNAL ERROR {type(exc).__name__}: {exc} (a bug in miles-lora-ckpt; rerun with --debug "
            "for the traceback and please report it)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


def _run(argv: list[str]) -> int:
    from miles_lora_ckpt.core import settings
    from miles_lora_ckpt.core.signing import SigningKeyError

    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if not getattr(args, "handler", None):
        parser.print_help()
        return EXIT_USAGE
    options = {"hmac_key_file": args.hmac_key_file} if args.hmac_key_file else {}
    try:
        with settings.overridden(**options):
            return args.handler(args)
    except (NotACheckpoint, SigningKeyError) as exc:
        print(f"ERROR {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # the path itself (not a generation in it) cannot be read
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"ERROR {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE


_PARSER: argparse.ArgumentParser | None = None


def _parser() -> argparse.ArgumentParser:
    """The parser, built once per process (building it costs more than most commands)."""
    global _PARSER
    if _PARSER is None:
        _PARSER = build_parser()
    return _PARSER


def build_parser() -> argparse.ArgumentParser:
    """The whole `miles-lora-ckpt` parser, every command included (the docs check its flags)."""
    parser = argparse.ArgumentParser(
        prog="miles-lora-ckpt",
        description="Crash-safe LoRA checkpoints for Miles (Megatron backend): verify, inspect, list, "
        "prune, benchmark and demonstrate; export HF PEFT adapters and check that PEFT loads them.",
        epilog=EXIT_CODES + DOCS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_common_options(parser, defaults=True)
    sub = parser.add_subparsers(metavar="COMMAND")

    def command(name: str, help_text: str):
        cmd = sub.add_parser(name, help=help_text, description=help_text, epilog=EXIT_CODES)
        cmd.formatter_class = argparse.RawDescriptionHelpFormatter
        _add_common_options(cmd, defaults=False)
        return cmd

    verify = command(
        "verify", "check that a generation (or a save root's newest) is committed and intact, every byte read"
    )
    verify.add_argument(
        "path", help="a save root (its newest intact generation is checked) or one generation directory"
    )
    verify.add_argument("--all", action="store_true", help="check every generation of the save root")
    verify.set_defaults(handler=cmd_verify)

    inspect = command("inspect", "show what a generation holds (the newest intact one of a save root)")
    inspect.add_argument("path", help="a save root or one generation directory")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(handler=cmd_inspect)

    ls = command(
        "ls", "list a save root: generations in commit order with their content state, staging, the writer lease"
    )
    ls.add_argument("root", help="a save root")
    ls.add_argument(
        "--fast",
        action="store_true",
        help="check names, manifests and sizes only: skip reading the files (states say 'committed', not 'intact')",
    )
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(handler=cmd_ls)

    gc = command(
        "gc",
        "keep the newest N content-verified generations, remove older ones and abandoned staging; "
        "never removes the newest loadable generation, nor a generation directory whose manifest cannot "
        "be read (its order is unknown: it is reported, for you to look at)",
    )
    gc.add_argument("root", help="a save root")
    gc.add_argument("--keep", type=int, required=True, help="how many intact generations to keep (>= 1)")
    gc.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    gc.add_argument(
        "--staging-min-age",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="leave staging directories younger than this alone when no writer holds the root's lease "
        "(default 3600); with a live lease, staging directories are never touched",
    )
    gc.set_defaults(handler=cmd_gc)

    _add_lazy_subcommands(sub)
    return parser


def _add_common_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    # Given before or after the command; a subcommand's copy must not reset the main one's value.
    parser.add_argument(
        "--debug",
        action="store_true",
        default=False if defaults else argparse.SUPPRESS,
        help="show the traceback of an internal error",
    )
    parser.add_argument(
        "--hmac-key-file",
        default=None if defaults else argparse.SUPPRESS,
        metavar="PATH",
        help="check manifest signatures with this key (overrides $MILES_LORA_CKPT_HMAC_KEY_FILE); with a "
        "key, unsigned or mis-signed generations are damaged",
    )


def _add_lazy_subcommands(sub) -> None:
    """Subcommands whose modules import torch/megatron (or the harness) only when they run."""
    from miles_lora_ckpt.tools import peft_tools

    _add_harness_command(sub, "bench", "time protocol save/load against raw I/O, torch.save and DCP")
    _add_harness_command(
        sub, "demo", "crash a real megatron LoRA run mid-save on CPU, resume it, check it is bit-exact"
    )
    peft_tools.add_parsers(sub)


# What to install where the harness is missing: from an index, or in a clone of the source tree.
HARNESS_MISSING = (
    "ERROR `miles-lora-ckpt {command}` needs the harness distribution miles-lora-ckpt-harness, which is not "
    "installed: pip install 'miles-lora-ckpt[demo]' (in a clone of the source tree: make install, or "
    "pip install ./harness)"
)


def _add_harness_command(sub, name: str, help_text: str) -> None:
    # Every argument after the name goes to the harness unparsed (its parser has the flags and the full
    # --help); prefix_chars "\0" keeps argparse from reading any of them as an option of this parser.
    cmd = sub.add_parser(name, help=help_text, add_help=False, prefix_chars="\0")
    cmd.add_argument("harness_args", nargs=argparse.REMAINDER)
    cmd.set_defaults(handler=lambda args: _hand_off(name, args.harness_args))


def _hand_off(command: str, argv: list[str]) -> int:
    try:
        from miles_lora_ckpt_harness import commands
    except ImportError as exc:
        if exc.name is None or not exc.name.startswith("miles_lora_ckpt_harness"):
            raise  # the harness is there, something it imports is not: an internal error, not a missing harness
        print(HARNESS_MISSING.format(command=command), file=sys.stderr)
        return EXIT_USAGE
    return commands.run(command, argv)
