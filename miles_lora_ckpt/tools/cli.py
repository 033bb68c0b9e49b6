"""`miles-lora-ckpt`: operator tools. Runs on a login node: no megatron, Miles or GPU needed.

Exit codes (verify): 0 intact, 1 damaged / torn / uncommitted (or a PEFT adapter in it that PEFT
would load wrongly), 2 not a checkpoint or usage error. `verify-peft` and `export-peft` live in
`peft_tools` (torch, transformers and peft are imported only when they run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from miles_lora_ckpt import __version__
from miles_lora_ckpt.core.errors import GenerationDamaged, NotACheckpoint

EXIT_OK, EXIT_DAMAGED, EXIT_USAGE = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    if not getattr(args, "handler", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.handler(args)
    except NotACheckpoint as exc:
        print(f"ERROR {exc}", file=sys.stderr)
        return EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-lora-ckpt",
        description="Crash-safe LoRA checkpoints for Miles (Megatron backend): verify, inspect, list, "
        "prune, benchmark and demonstrate; export HF PEFT adapters and check that PEFT loads them.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(metavar="COMMAND")

    verify = sub.add_parser("verify", help="check that a generation (or a save root's newest) is committed and intact")
    verify.add_argument(
        "path", help="a save root (its newest intact generation is checked) or one generation directory"
    )
    verify.add_argument("--all", action="store_true", help="check every generation of the save root")
    verify.set_defaults(handler=cmd_verify)

    inspect = sub.add_parser("inspect", help="show what a generation holds")
    inspect.add_argument("path", help="a save root or one generation directory")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(handler=cmd_inspect)

    ls = sub.add_parser("ls", help="list generations and staging directories of a save root")
    ls.add_argument("root", help="a save root")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(handler=cmd_ls)

    gc = sub.add_parser("gc", help="keep the newest N intact generations, remove the rest and abandoned staging")
    gc.add_argument("root", help="a save root")
    gc.add_argument("--keep", type=int, required=True, help="how many intact generations to keep (>= 1)")
    gc.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    gc.add_argument(
        "--staging-min-age",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="leave staging directories younger than this alone (a save may be running; default 3600)",
    )
    gc.set_defaults(handler=cmd_gc)

    _add_lazy_subcommands(sub)
    return parser


def _add_lazy_subcommands(sub) -> None:
    """Subcommands whose modules import torch/megatron only when they run."""
    from miles_lora_ckpt.tools import bench, demo, peft_tools

    bench.add_parser(sub)
    demo.add_parser(sub)
    peft_tools.add_parsers(sub)


# --------------------------------------------------------------------------- handlers


def cmd_verify(args) -> int:
    from miles_lora_ckpt.core.verify import committed_candidates, resolve, verify_generation

    path = _follow_latest(Path(args.path))
    try:
        if args.all:
            candidates, _ = committed_candidates(path)
            generations = [verify_generation(c) for c in candidates]
            skipped = []
        else:
            gen, skipped = resolve(path)
            generations = [gen]
    except GenerationDamaged as exc:
        _print_problems(Path(exc.path), path, exc.problems)
        return EXIT_DAMAGED
    for gen in skipped:
        print(f"WARNING skipped damaged newer generation {gen.path.name}", file=sys.stderr)
        _print_problems(gen.path, path, gen.problems, stream=sys.stderr)
    status = EXIT_OK
    for gen in generations:
        if gen.intact:
            gen.problems += _peft_problems(gen)
        if gen.intact:
            m = gen.manifest
            size = sum(r.bytes for r in m.files.values())
            print(
                f"OK {gen.path} generation {m.generation} iteration {m.iteration} ({len(m.files)} files, {size} bytes)"
            )
        else:
            _print_problems(gen.path, path, gen.problems)
            status = EXIT_DAMAGED
    return status


def _follow_latest(path: Path) -> Path:
    """An export root's `latest` symlink stands for the generation it names (a sibling, nothing else)."""
    if path.name == "latest" and path.is_symlink():
        target = path.resolve()
        if target.parent == path.parent.resolve():
            return target
    return path


def _peft_problems(gen) -> list:
    """A PEFT adapter in the generation (an export's, or a checkpoint's `peft/`) must also load in PEFT."""
    from miles_lora_ckpt.savers.peft_export.format import generation_problems

    return generation_problems(gen.path, gen.manifest.files)


def _print_problems(gen_path: Path, given: Path, problems, stream=None) -> None:
    prefix = "" if gen_path.resolve() == given.resolve() else f"{gen_path.name}/"
    for problem in problems:
        rel = problem.file if problem.file != "." else gen_path.name
        print(f"ERROR {prefix if problem.file != '.' else ''}{rel}: {problem.reason}", file=stream or sys.stdout)


def cmd_inspect(args) -> int:
    from miles_lora_ckpt.core.verify import resolve

    try:
        gen, skipped = resolve(_follow_latest(Path(args.path)))
    except GenerationDamaged as exc:
        _print_problems(Path(exc.path), Path(args.path), exc.problems)
        return EXIT_DAMAGED
    m = gen.manifest
    info = {
        "path": str(gen.path.resolve()),
        "generation": m.generation,
        "iteration": m.iteration,
        "saver": m.saver,
        "created_unix_ns": m.created_unix_ns,
        "format_version": m.format_version,
        "topology": m.topology.to_dict(),
        "files": {rel: rec.to_dict() for rel, rec in sorted(m.files.items())},
        "metadata": m.metadata,
        "skipped_damaged": [str(g.path) for g in skipped],
    }
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True))
        return EXIT_OK
    print(f"path        {info['path']}")
    print(f"generation  {m.generation}   iteration {m.iteration}   saver {m.saver}")
    print("topology    " + " ".join(f"{k}={v}" for k, v in info["topology"].items()))
    for key, value in sorted(m.metadata.items()):
        print(f"meta        {key} = {json.dumps(value, sort_keys=True)[:200]}")
    print(f"files       {len(m.files)} ({sum(r.bytes for r in m.files.values())} bytes)")
    for rel, rec in sorted(m.files.items()):
        print(f"  {rec.bytes:>12}  {rec.digest}  {rel}")
    for g in skipped:
        print(f"WARNING skipped damaged newer generation {g.path.name}")
    return EXIT_OK


def cmd_ls(args) -> int:
    from miles_lora_ckpt.core.verify import is_save_root, read_tracker, scan_root

    root = Path(args.root)
    if not is_save_root(root):
        raise NotACheckpoint(f"{root} is not a save root")
    tracked = read_tracker(root)
    entries = scan_root(root)
    if args.json:
        rows = [
            {
                "name": e.name,
                "state": e.state,
                "iteration": e.iteration,
                "created_unix_ns": e.created_unix_ns,
                "tracked": e.name == tracked,
                "problems": [str(p) for p in e.problems],
            }
            for e in entries
        ]
        print(json.dumps({"root": str(root.resolve()), "tracker": tracked, "entries": rows}, indent=1))
        return EXIT_OK
    print(f"{'STATE':<10} {'ITERATION':>9}  NAME")
    for e in entries:
        mark = "  <- tracker" if e.name == tracked else ""
        iteration = "-" if e.iteration is None else str(e.iteration)
        print(f"{e.state:<10} {iteration:>9}  {e.name}{mark}")
    return EXIT_OK


def cmd_gc(args) -> int:
    from miles_lora_ckpt.core.retention import prune
    from miles_lora_ckpt.core.verify import is_save_root

    if args.keep < 1:
        print("ERROR --keep must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    if not is_save_root(Path(args.root)):
        raise NotACheckpoint(f"{args.root} is not a save root")
    removed = prune(Path(args.root), keep=args.keep, staging_min_age_s=args.staging_min_age, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    print(f"{verb} {len(removed)} director{'y' if len(removed) == 1 else 'ies'}")
    return EXIT_OK
