"""`miles-lora-ckpt verify`, `inspect`, `ls` and `gc`: the login-node commands, and their exit codes.

No megatron, Miles or GPU is needed. `tools.cli` parses the command line and calls these handlers.
The harness's demos call `verify_report` directly, so nothing here imports the CLI. `verify` also
fails a generation holding a PEFT adapter that PEFT would load wrongly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from miles_lora_ckpt.core.errors import GenerationDamaged, NotACheckpoint

__all__ = [
    "EXIT_OK",
    "EXIT_DAMAGED",
    "EXIT_USAGE",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "verify_report",
    "cmd_verify",
    "cmd_inspect",
    "cmd_ls",
    "cmd_gc",
]

EXIT_OK, EXIT_DAMAGED, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def verify_report(path: str | Path) -> int:
    """`miles-lora-ckpt verify PATH` as a function: prints the same report, returns the exit code."""
    return cmd_verify(argparse.Namespace(path=str(path), all=False))


def cmd_verify(args) -> int:
    """`verify`: take the parsed args, return `EXIT_OK` or `EXIT_DAMAGED`.

    Raises NotACheckpoint for a path that holds no generation; the CLI exits `EXIT_USAGE` then."""
    several = _each_root(args, "path", cmd_verify)
    if several is not None:
        return several
    from miles_lora_ckpt.core import signing
    from miles_lora_ckpt.core.verify import find_candidates, resolve, verify_generation

    path, key = _follow_latest(Path(args.path)), signing.configured_key()
    try:
        if args.all:
            candidates = find_candidates(path, key=key)
            generations = [verify_generation(c, key=key) for c in candidates.paths]
            skipped, warnings = [], candidates.warnings
        else:
            resolution = resolve(path, key=key)
            generations, skipped, warnings = [resolution.generation], resolution.skipped, resolution.warnings
    except GenerationDamaged as exc:
        _print_problems(Path(exc.path), path, exc.problems)
        return EXIT_DAMAGED
    for warning in warnings:
        print(f"WARNING {warning}", file=sys.stderr)
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
            rng = f"; {_rng_summary(m)}" if m.metadata.get("rng_saved") is not None else ""
            print(
                f"OK {gen.path} generation {m.generation} iteration {m.iteration} {_sequence(m)} "
                f"({len(m.files)} files, {size} bytes; {signing.describe(m.signature, key)}{rng})"
            )
        else:
            _print_problems(gen.path, path, gen.problems)
            status = EXIT_DAMAGED
    return status


def _sequence(manifest) -> str:
    return f"sequence {manifest.sequence}" if manifest.sequence is not None else "(format v1: no sequence)"


def _rng_summary(manifest) -> str:
    """What a single-LoRA generation holds of its ranks' RNG states (`core.rng_state`), in words."""
    from miles_lora_ckpt.core.rng_state import ROLE_RNG

    saved = manifest.metadata.get("rng_saved")
    if saved is None:
        return "no RNG state (saved before RNG states were saved)"
    if saved is False:
        return "no RNG state (saved with --no-save-rng)"
    ranks = {r.binding.get("rank") for rel, r in manifest.files.items() if manifest.role_of(rel) == ROLE_RNG}
    return f"RNG states of {len(ranks)} rank(s), restored at this layout only"


def _follow_latest(path: Path) -> Path:
    """A root's generation link stands for the generation it names (a sibling `gen-*`, nothing
    else): `latest` (see `layout.LATEST`) or a multi-LoRA slot root's reader name such as `step_6`;
    the rule every reader applies (`core.verify.follow_generation_link`)."""
    from miles_lora_ckpt.core.verify import follow_generation_link

    return follow_generation_link(path)


def _each_root(args, attr: str, command) -> int | None:
    """A directory of save roots (a multi-LoRA save directory: one slot root per adapter) runs
    `command` on each root in turn, under a `== ROOT ==` heading; the worst exit code wins.
    None when `args.<attr>` is not such a directory."""
    import copy

    from miles_lora_ckpt.core.verify import find_save_roots

    roots = find_save_roots(Path(getattr(args, attr)))
    if not roots:
        return None
    worst = EXIT_OK
    for root in roots:
        print(f"== {root} ==")
        one = copy.copy(args)
        setattr(one, attr, str(root))
        try:
            code = command(one)
        except (NotACheckpoint, GenerationDamaged) as exc:
            print(f"ERROR {exc}")
            code = EXIT_DAMAGED
        worst = max(worst, code)
    return worst


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
    """`inspect`: take the parsed args, print what a generation holds, return the exit code."""
    several = _each_root(args, "path", cmd_inspect)
    if several is not None:
        return several
    from miles_lora_ckpt.core import signing
    from miles_lora_ckpt.core.verify import resolve

    key = signing.configured_key()
    try:
        resolution = resolve(_follow_latest(Path(args.path)), key=key)
    except GenerationDamaged as exc:
        _print_problems(Path(exc.path), Path(args.path), exc.problems)
        return EXIT_DAMAGED
    gen, skipped = resolution.generation, resolution.skipped
    m = gen.manifest
    info = {
        "path": str(gen.path.resolve()),
        "generation": m.generation,
        "iteration": m.iteration,
        "sequence": m.sequence,
        "saver": m.saver,
        "created_unix_ns": m.created_unix_ns,
        "format_version": m.format_version,
        "signature": signing.describe(m.signature, key),
        "topology": m.topology.to_dict(),
        "files": {rel: rec.to_dict() for rel, rec in sorted(m.files.items())},
        "metadata": m.metadata,
        "skipped_damaged": [str(g.path) for g in skipped],
        "warnings": resolution.warnings,
        "data_state": _data_state_summary(gen),
    }
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True))
        return EXIT_OK
    print(f"path        {info['path']}")
    print(f"generation  {m.generation}   iteration {m.iteration}   {_sequence(m)}   saver {m.saver}")
    print(f"format      v{m.format_version}, {info['signature']}")
    print("topology    " + " ".join(f"{k}={v}" for k, v in info["topology"].items()))
    if m.saver == "single-lora":
        print(f"rng         {_rng_summary(m)}")
    for key_name, value in sorted(m.metadata.items()):
        print(f"meta        {key_name} = {json.dumps(value, sort_keys=True)[:200]}")
    print(f"data state  {info['data_state'] or 'none (no rollout data state in this generation)'}")
    print(f"files       {len(m.files)} ({sum(r.bytes for r in m.files.values())} bytes)")
    for rel, rec in sorted(m.files.items()):
        binding = " ".join(f"{k}={v}" for k, v in sorted(rec.binding.items()))
        print(f"  {rec.bytes:>12}  {rec.digest}  {rel}" + (f"  [{binding}]" if binding else ""))
    for g in skipped:
        print(f"WARNING skipped damaged newer generation {g.path.name}")
    for warning in resolution.warnings:
        print(f"WARNING {warning}")
    return EXIT_OK


def cmd_ls(args) -> int:
    """`ls`: take the parsed args, list a save root's generations, return the exit code."""
    several = _each_root(args, "root", cmd_ls)
    if several is not None:
        return several
    from miles_lora_ckpt.core import lease, signing
    from miles_lora_ckpt.core.verify import is_save_root, view_root

    root = Path(args.root)
    if not is_save_root(root):
        raise NotACheckpoint(f"{root} is not a save root")
    view = view_root(root, content=not args.fast, key=signing.configured_key())
    writer = lease.read_state(root)
    tracked = view.tracker.generation_dir if view.tracker else None
    live_writer = writer is not None and writer.live
    from miles_lora_ckpt.core import data_state

    links = _links_by_target(root, view)
    staged = data_state.staged_rollouts(root)
    if args.json:
        rows = [
            {
                "name": e.name,
                "state": e.state,
                "sequence": e.sequence,
                "iteration": e.iteration,
                "created_unix_ns": e.created_unix_ns,
                "tracked": e.name == tracked,
                "live_writer": e.state == "staging" and live_writer,
                "links": links.get(e.name, []),
                "slot": _slot_index(e),
                "data_state": _has_data_state(e),
                "problems": [str(p) for p in e.problems],
                "order_known": e.state not in ("intact", "committed", "damaged") or e.order_known,
            }
            for e in view.entries
        ]
        listing = {
            "root": str(root.resolve()),
            "content_checked": not args.fast,
            "tracker": tracked,
            "lease": None if writer is None else {"live": writer.live, "description": writer.describe()},
            "warnings": view.warnings,
            "entries": rows,
            "staged_data_states": staged,
        }
        print(json.dumps(listing, indent=1))
        return EXIT_OK
    if args.fast:
        print(
            "content NOT checked (--fast): states come from names, manifests and sizes; run without --fast to read every byte"
        )
    print(f"writer lease: {'none' if writer is None else writer.describe()}")
    print(f"{'STATE':<10} {'SEQUENCE':>8} {'ITERATION':>9}  NAME")
    for e in view.entries:
        marks = f"  [slot {_slot_index(e)}]" if _slot_index(e) is not None else ""
        marks += "  [data state]" if _has_data_state(e) else ""
        marks += "".join(f"  <- {link}" for link in links.get(e.name, []))
        marks += "  <- tracker" if e.name == tracked else ""
        marks += "  (the root has a live writer: may be in progress)" if e.state == "staging" and live_writer else ""
        sequence = "-" if e.sequence is None else str(e.sequence)
        iteration = "-" if e.iteration is None else str(e.iteration)
        print(f"{e.state:<10} {sequence:>8} {iteration:>9}  {e.name}{marks}")
        for problem in e.problems[:5]:
            print(f"{'':<10} {'':>8} {'':>9}    {problem}")
    if staged:
        print(f"rollout data states staged, not committed yet: rollouts {', '.join(map(str, staged))}")
    for warning in view.warnings:
        print(f"WARNING {warning}", file=sys.stderr)
    return EXIT_OK


def _has_data_state(entry) -> bool:
    """Whether a generation lists the rollout data state (`core.data_state`)."""
    from miles_lora_ckpt.core import data_state

    manifest = entry.generation.manifest if entry.generation else None
    return manifest is not None and data_state.DATA_STATE in manifest.files


def _data_state_summary(gen) -> str | None:
    """`data_state.summary` of a resolved (verified) generation's rollout data state, or None."""
    from miles_lora_ckpt.core import data_state
    from miles_lora_ckpt.core.verify import check_file_content

    if data_state.DATA_STATE not in gen.manifest.files:
        return None
    return data_state.summary(check_file_content(gen.path, data_state.DATA_STATE, gen.manifest).value)


def _links_by_target(root: Path, view) -> dict[str, list[str]]:
    """`{generation name: [links naming it]}` (`latest`, multi-LoRA reader names such as `step_6`);
    a link naming no generation of the root becomes a warning of `view`."""
    from miles_lora_ckpt.core.retention import generation_links

    present = {e.name for e in view.generations()}
    by_target: dict[str, list[str]] = {}
    for link, target in generation_links(root).items():
        if target in present:
            by_target.setdefault(target, []).append(link)
        else:
            view.warnings.append(f"link {link} names {target}, which is not in this root (gc removes it)")
    return by_target


def _slot_index(entry):
    """The slot a multi-LoRA slot generation holds (manifest metadata `slot.index`), else None."""
    manifest = entry.generation.manifest if entry.generation else None
    slot = manifest.metadata.get("slot") if manifest is not None and isinstance(manifest.metadata, dict) else None
    return slot.get("index") if isinstance(slot, dict) else None


def cmd_gc(args) -> int:
    """`gc`: take the parsed args, prune the save root, return the exit code.

    Raises NotACheckpoint when the path is not a save root."""
    several = _each_root(args, "root", cmd_gc)
    if several is not None:
        return several
    from miles_lora_ckpt.core import signing
    from miles_lora_ckpt.core.retention import prune
    from miles_lora_ckpt.core.verify import is_save_root

    if args.keep < 1:
        print("ERROR --keep must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    root = Path(args.root)
    if not is_save_root(root):
        raise NotACheckpoint(f"{args.root} is not a save root")
    report = prune(
        root,
        keep=args.keep,
        staging_min_age_s=args.staging_min_age,
        dry_run=args.dry_run,
        key=signing.configured_key(),
    )
    for name in report.kept:
        print(f"keeping {name} (content verified)")
    verb = "would remove" if args.dry_run else "removed"
    for path in report.remove:
        if args.dry_run or path in report.removed:
            print(f"{verb} {path}")
    for note in report.notes:
        print(f"NOTE {note}")
    for name in report.unordered:
        print(f"left alone {root / name} (its manifest cannot be read: order unknown)")
    for path, failure in report.failed:
        print(f"ERROR could not remove {path}: {failure}")
    count = len(report.remove) if args.dry_run else len(report.removed)
    print(f"{verb} {count} director{'y' if count == 1 else 'ies'}")
    return EXIT_DAMAGED if report.failed or not report.kept else EXIT_OK
