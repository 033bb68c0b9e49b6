"""`miles-lora-ckpt verify-peft` and `export-peft`: the PEFT side of the operator tools.

`verify-peft ADAPTER --base HF_MODEL_DIR` loads the adapter with the real HF PEFT
(`PeftModel.from_pretrained`) onto the base, offline (no hub access), and reports the keys PEFT
would silently get wrong: missing (a module PEFT adapts but no tensor was found: it keeps B = 0),
unexpected (a tensor no adapted module takes: PEFT drops it), mismatched (shape differs from the
module PEFT built). Exit 0 when all three are empty, 1 otherwise, 2 for usage errors. ADAPTER is an
adapter directory, an export root (its newest export), or a checkpoint generation or save root
holding `peft/`. torch, transformers and peft are imported only when the command runs.

`export-peft GENERATION --out DIR` publishes a committed generation's adapter as a new export in
the export root DIR (`savers/peft_export/offline.py` says what it converts without a model).
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "add_parsers",
    "LoadReport",
    "resolve_adapter_dir",
    "load_report",
]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_parsers(subparsers) -> None:
    # verify-peft --help shows the module docstring's second paragraph: edit it as help text.
    """Add the `verify-peft` and `export-peft` commands to the CLI's `subparsers`."""
    verify = subparsers.add_parser(
        "verify-peft",
        help="load a PEFT adapter onto an HF base with the real PEFT (offline); report missing/unexpected keys",
        description=__doc__.split("\n\n")[1],
    )
    verify.add_argument(
        "adapter",
        metavar="ADAPTER_DIR",
        help="an adapter directory, an export root (its newest export), or a checkpoint (generation or "
        "save root) holding peft/",
    )
    verify.add_argument("--base", required=True, metavar="HF_MODEL_DIR", help="local HF model directory (no hub)")
    verify.set_defaults(handler=cmd_verify_peft)

    export = subparsers.add_parser(
        "export-peft",
        help="export a committed generation's adapter as an HF PEFT directory (offline, no live model)",
        description="Publish a committed generation's adapter into the export root DIR (DIR/gen-*/ and "
        "DIR/latest): its peft/ export as is, or, without one, its Megatron adapter shards converted "
        "for a dense Qwen2/Llama-style decoder (needs --base for the model's config.json).",
    )
    export.add_argument(
        "generation", metavar="GENERATION", help="a save root (its newest intact generation) or one generation"
    )
    export.add_argument("--out", required=True, metavar="DIR", help="the export root to publish into")
    export.add_argument(
        "--base", metavar="HF_MODEL_DIR", help="HF base whose config.json gives heads/groups/sizes (shard conversion)"
    )
    export.add_argument("--lora-alpha", type=float, help="LoRA alpha when the generation does not record it")
    export.add_argument("--keep", type=int, help="prune the export root to its newest N exports afterwards")
    export.set_defaults(handler=cmd_export_peft)


# --------------------------------------------------------------------------- verify-peft


@dataclass
class LoadReport:
    """What PEFT did with an adapter: keys it expected but did not get, got but did not expect, ..."""

    adapter_dir: str
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # "key: file [a, b], model [c, d]"
    error: str | None = None  # PEFT refused to load at all
    loaded_tensors: int = 0
    model: object = None  # the PeftModel, for callers that go on to use it (not for JSON)

    @property
    def ok(self) -> bool:
        return self.error is None and not (self.missing or self.unexpected or self.mismatched)

    def headline(self) -> str:
        counts = f"{len(self.missing)} missing, {len(self.unexpected)} unexpected"
        counts += f", {len(self.mismatched)} mismatched" if self.mismatched else ""
        if self.error:
            return f"PEFT: NOT loadable ({self.error})"
        return f"PEFT: {'loadable' if self.ok else 'NOT loadable'} ({counts})"


def resolve_adapter_dir(path: Path) -> Path:
    """The adapter directory `path` stands for; raises FileNotFoundError naming what is missing."""
    from miles_lora_ckpt.core.verify import resolve
    from miles_lora_ckpt.savers.peft_export import CONFIG_NAME, GENERATION_SUBDIR, LATEST

    path = Path(path)
    if (path / CONFIG_NAME).is_file():
        return path
    if (path / LATEST / CONFIG_NAME).is_file():
        return path / LATEST
    gen = resolve(path, content=False).generation
    for candidate in (gen.path, gen.path / GENERATION_SUBDIR):
        if (candidate / CONFIG_NAME).is_file():
            return candidate
    raise FileNotFoundError(f"{path} holds no PEFT adapter ({CONFIG_NAME} not found, nor in peft/ or latest/)")


def load_report(adapter_dir: str | Path, base_dir: str | Path, *, dtype=None) -> LoadReport:
    """Load `base_dir` with transformers and the adapter with `PeftModel.from_pretrained`, offline."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # no hub access, whatever the paths look like
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from miles_lora_ckpt.core import file_reader, safetensors_format
    from miles_lora_ckpt.savers.peft_export import WEIGHTS_NAME

    hf_logging.disable_progress_bar()
    adapter_dir = Path(adapter_dir)
    report = LoadReport(str(adapter_dir))
    try:
        _, entries = safetensors_format.parse_safetensors_header(
            file_reader.read_file_verified(adapter_dir / WEIGHTS_NAME)
        )
    except ValueError as exc:  # a FIFO or device is refused without being opened; named either way
        raise ValueError(f"{adapter_dir / WEIGHTS_NAME}: {exc}") from None
    provided = {_with_adapter_name(key): shape for key, (_, shape, _, _) in entries.items()}
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), local_files_only=True, **_dtype(dtype))
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # we count what PEFT only warns about
        try:
            model = PeftModel.from_pretrained(base, str(adapter_dir), ignore_mismatched_sizes=True)
        except Exception as exc:  # noqa: BLE001 - any refusal by PEFT is the finding
            report.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            return report
    expected = {name: list(p.shape) for name, p in model.named_parameters() if ".lora_" in name}
    report.unexpected = sorted(set(provided) - set(expected))
    report.mismatched = [
        f"{k}: file {provided[k]}, model {expected[k]}"
        for k in sorted(set(provided) & set(expected))
        if provided[k] != expected[k]
    ]
    bad_shapes = {line.split(":")[0] for line in report.mismatched}
    report.missing = sorted(set(expected) - set(provided) - bad_shapes)
    report.loaded_tensors = len(set(provided) & set(expected)) - len(bad_shapes)
    report.model = model
    return report


def _with_adapter_name(key: str, adapter: str = "default") -> str:
    """The parameter name PEFT gives a file key (`...lora_A.weight` -> `...lora_A.default.weight`)."""
    return re.sub(r"\.(lora_[AB])\.weight$", rf".\1.{adapter}.weight", key)


def _dtype(dtype) -> dict:
    return {} if dtype is None else {"dtype": dtype}


def cmd_verify_peft(args) -> int:
    """`verify-peft`: take the parsed args; return 0 (PEFT loads it right), 1 (it would not), 2."""
    from miles_lora_ckpt.core.errors import GenerationDamaged, NotACheckpoint
    from miles_lora_ckpt.savers.peft_export import check_peft_dir

    try:
        adapter_dir = resolve_adapter_dir(Path(args.adapter))
    except (FileNotFoundError, NotACheckpoint, GenerationDamaged) as exc:
        print(f"ERROR {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not (Path(args.base) / "config.json").is_file():
        print(f"ERROR {args.base} is not a local HF model directory (no config.json)", file=sys.stderr)
        return EXIT_USAGE
    print(f"adapter {adapter_dir}")
    problems = check_peft_dir(adapter_dir)
    for problem in problems:
        print(problem)
    report = load_report(adapter_dir, args.base)
    for title, keys in (
        ("missing", report.missing),
        ("unexpected", report.unexpected),
        ("mismatched", report.mismatched),
    ):
        for key in keys:
            print(f"  {title}: {key}")
    print(report.headline())
    return EXIT_OK if report.ok and not problems else EXIT_FAILED


# --------------------------------------------------------------------------- export-peft


def cmd_export_peft(args) -> int:
    """`export-peft`: take the parsed args, publish the export, return the exit code."""
    from miles_lora_ckpt.core.errors import CheckpointError, GenerationDamaged, NotACheckpoint
    from miles_lora_ckpt.savers.peft_export import LATEST
    from miles_lora_ckpt.savers.peft_export.offline import OfflineExportError, export_generation

    if args.keep is not None and args.keep < 1:
        print("ERROR --keep must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        published = export_generation(
            args.generation, args.out, base=args.base, lora_alpha=args.lora_alpha, keep=args.keep
        )
    except NotACheckpoint as exc:
        print(f"ERROR {exc}", file=sys.stderr)
        return EXIT_USAGE
    except GenerationDamaged as exc:
        print(f"ERROR {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (OfflineExportError, CheckpointError, OSError) as exc:
        print(f"ERROR {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"OK exported {args.generation} -> {published}")
    print(f"PEFT adapter directory: {Path(args.out) / LATEST}")
    return EXIT_OK
