"""The HF PEFT LoRA adapter format as this package writes it, and the checks that PEFT loads it.

An adapter directory holds the two files `PeftModel.from_pretrained(base, path)` reads::

    adapter_model.safetensors   `base_model.model.<HF module path>.lora_A.weight` [r, in] and
                                `.lora_B.weight` [out, r], no adapter name in the key; header
                                metadata `{"format": "pt", ...}`; mode 0644 (readable by a server)
    adapter_config.json         `peft_type` "LORA", `r`, `lora_alpha`, `target_modules`,
                                `rank_pattern`, ...; bytes as Bridge's `save_hf_adapter` writes them

PEFT is lenient when it loads. It drops a key it does not expect, and a module it adapts but finds
no key for keeps its init (B = 0) with only a warning. So the exporter proves the files itself
(`check_state`, `structure_problems`), mirroring PEFT's matching rules (`is_targeted`, `rank_for`).
Fused 3-D expert stacks are refused: PEFT 0.21's packed layout reads them in another column order.

This module imports no torch at import time, so `verify` can run its header checks on a login
node. Its conversion helpers are used where the installed Bridge lacks its `peft_bridge` ones.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_lora_ckpt.core import file_reader, json_files, safetensors_format
from miles_lora_ckpt.core.errors import Problem
from miles_lora_ckpt.core.finite import all_finite

if TYPE_CHECKING:
    import torch

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
KEY_PREFIX = "base_model.model."
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
SAFETENSORS_METADATA = {"format": "pt"}  # what transformers/PEFT write; readers may check it
# What each file is in a generation's manifest (format v2); the weights' metadata carries it too
WEIGHTS_BINDING = {"role": "peft-adapter-weights"}
CONFIG_BINDING = {"role": "peft-adapter-config"}
_LAYER_RE = re.compile(r"(^|\.)layers\.(\d+)\.")
_FLOAT_TAGS = {"F64", "F32", "F16", "BF16"}

__all__ = [
    "CONFIG_BINDING",
    "CONFIG_NAME",
    "LORA_A",
    "LORA_B",
    "SAFETENSORS_METADATA",
    "WEIGHTS_BINDING",
    "WEIGHTS_NAME",
    "LoraSpec",
    "build_config",
    "check_peft_dir",
    "check_state",
    "config_bytes",
    "exact_target_modules_needed",
    "generation_problems",
    "infer_rank_pattern",
    "infer_target_modules",
    "is_targeted",
    "layer_index",
    "module_kind",
    "rank_for",
    "slice_to_rank",
    "split_lora_name",
    "structure_problems",
    "to_peft_state",
    "unprefixed",
]


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA hyperparameters an export records.

    `r` is the default rank; other ranks go to `rank_pattern`. Raises ValueError for an `r` that is
    not a positive int.
    """

    r: int
    alpha: float
    dropout: float = 0.0
    use_dora: bool = False
    base_model_name_or_path: str = ""
    task_type: str = "CAUSAL_LM"

    def __post_init__(self):
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise ValueError(f"LoRA rank r must be a positive integer, got {self.r!r}")

    @classmethod
    def from_miles_args(cls, args) -> LoraSpec:
        """From Miles' flags: `--lora-rank`, `--lora-alpha`, `--lora-dropout`, `--hf-checkpoint`."""
        return cls(
            r=int(args.lora_rank),
            alpha=float(args.lora_alpha),
            dropout=float(getattr(args, "lora_dropout", 0.0) or 0.0),
            base_model_name_or_path=str(getattr(args, "hf_checkpoint", "") or ""),
        )

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict."""
        return {
            "r": self.r,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "use_dora": self.use_dora,
            "base_model_name_or_path": self.base_model_name_or_path,
            "task_type": self.task_type,
        }

    @property
    def bridge_peft_config(self):
        """The object Bridge's `build_adapter_config_dict` reads: `dim`, `alpha`, `dropout`."""
        from types import SimpleNamespace

        return SimpleNamespace(dim=self.r, alpha=self.alpha, dropout=self.dropout)


# --------------------------------------------------------------------------- names


def split_lora_name(name: str) -> tuple[str, str]:
    """`(module, "A" or "B")` of a LoRA weight name; ValueError for any other name.

    `model.layers.0.mlp.up_proj.lora_A.weight` gives `("model.layers.0.mlp.up_proj", "A")`.
    """
    for suffix, which in ((LORA_A, "A"), (LORA_B, "B")):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], which
    raise ValueError(f"{name!r} is not a LoRA weight name (expected '<module>.lora_A.weight' or '.lora_B.weight')")


def unprefixed(name: str) -> str:
    """The HF name without PEFT's `base_model.model.`, which the fork's save adds."""
    return name[len(KEY_PREFIX) :] if name.startswith(KEY_PREFIX) else name


def layer_index(module: str) -> int | None:
    """The `layers.<i>` index in a module path, or None when it has none."""
    match = _LAYER_RE.search(module)
    return int(match.group(2)) if match else None


def module_kind(module: str) -> str:
    """The module path with its layer index removed: `model.layers.*.self_attn.q_proj`."""
    return _LAYER_RE.sub(lambda m: f"{m.group(1)}layers.*.", module, count=1)


# --------------------------------------------------------------------------- PEFT's matching rules


def is_targeted(module: str, target_modules) -> bool:
    """Whether PEFT adapts `module` under `target_modules`, as PEFT 0.17-0.21 decides it.

    It mirrors PEFT's `check_target_module_exists`.
    """
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module) is not None
    return module in target_modules or any(module.endswith(f".{t}") for t in target_modules)


def rank_for(module: str, r: int, rank_pattern: Mapping[str, int]) -> int:
    """The rank PEFT gives `module`: the first `rank_pattern` key matching it, else `r`.

    It mirrors PEFT's `get_pattern_key`.
    """
    for key in rank_pattern:
        if re.match(rf"(.*\.)?({key})$", module):
            return int(rank_pattern[key])
    return r


def slice_to_rank(name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """The LoRA factor `tensor` named `name`, padded to a larger rank, cut to `rank`.

    Multi-LoRA slots share padded buffers. `lora_A` [.., R, in] keeps its first `rank` rows and
    `lora_B` [.., out, R] its first `rank` columns. Raises ValueError when the cut-off part is not
    zero, for the slot's rank would then be wrong, or when `tensor` is smaller than `rank`.
    """
    _, which = split_lora_name(unprefixed(name))
    dim = tensor.ndim - 2 if which == "A" else tensor.ndim - 1
    if tensor.shape[dim] < rank:
        raise ValueError(f"{name}: rank dimension {tensor.shape[dim]} is smaller than the slot's rank {rank}")
    if bool(tensor.narrow(dim, rank, tensor.shape[dim] - rank).any()):
        raise ValueError(f"{name}: non-zero values beyond rank {rank}; refusing to cut them off")
    return tensor.narrow(dim, 0, rank).contiguous()


# --------------------------------------------------------------------------- our conversion helpers


def to_peft_state(weights: Iterable) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """`(state_dict, module weight names, target_parameters)` with PEFT keys.

    It does what Bridge's `convert_adapter_weights_to_peft_state` does. `weights` have
    `.param_name` and `.weight`. Raises ValueError for a tensor that is not 2-D.
    """
    state, names = {}, []
    for item in weights:
        if item.weight.ndim != 2:
            raise ValueError(f"{item.param_name}: {item.weight.ndim}-D tensor; only 2-D LoRA factors convert")
        state[KEY_PREFIX + item.param_name] = item.weight
        names.append(item.param_name)
    return state, names, []


def infer_target_modules(names: Iterable[str]) -> list[str]:
    """Short module names (`q_proj`, ...) of the weights `names`.

    It does what Bridge's `infer_target_modules_from_adapter_weights` does.
    """
    return sorted({split_lora_name(n)[0].rsplit(".", 1)[-1] for n in names})


def infer_rank_pattern(weights: Iterable, *, default_rank: int) -> dict[str, int]:
    """`{module path: rank}` for modules whose rank is not `default_rank`.

    Raises ValueError when a module's two factors give two ranks.
    """
    ranks: dict[str, int] = {}
    for item in weights:
        module, which = split_lora_name(item.param_name)
        rank = int(item.weight.shape[0] if which == "A" else item.weight.shape[-1])
        if ranks.setdefault(module, rank) != rank:
            raise ValueError(f"{module}: inconsistent LoRA ranks {ranks[module]} and {rank}")
    return {m: rank for m, rank in sorted(ranks.items()) if rank != default_rank}


def config_bytes(config: Mapping[str, Any]) -> bytes:
    """The bytes of `adapter_config.json`, as Megatron-Bridge's `save_hf_adapter` writes them.

    That is `json.dump(config, f, indent=2)`: keys in the order the config was built, no trailing
    newline. A non-finite number raises ValueError. `build_config` and Bridge's
    `build_adapter_config_dict` list the same keys in the same order. A republished config keeps its
    file's order. So the same adapter always gives the same bytes and digest.
    """
    return json.dumps(dict(config), indent=2, allow_nan=False).encode()


def build_config(
    lora: LoraSpec,
    target_modules: list[str],
    *,
    rank_pattern: dict[str, int] | None = None,
) -> dict[str, Any]:
    """`adapter_config.json` for a LoRA adapter.

    It has the keys Bridge's `build_adapter_config_dict` writes.
    """
    return {
        "peft_type": "LORA",
        "auto_mapping": None,
        "base_model_name_or_path": lora.base_model_name_or_path,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "modules_to_save": None,
        "r": lora.r,
        "rank_pattern": dict(rank_pattern or {}),
        "alpha_pattern": {},
        "target_modules": list(target_modules),
        "task_type": lora.task_type,
        "use_dora": lora.use_dora,
        "use_rslora": False,
    }


def exact_target_modules_needed(modules: Iterable[str], model_layers: int | None) -> bool:
    """Whether short names (`q_proj`) would make PEFT adapt modules the export has no weights for.

    Short names match every layer of the base, so they are exact only when every module kind is
    present in the same layers and those are all of the model's layers (`model_layers`, when known).
    Otherwise `target_modules` must list full module paths.
    """
    modules = sorted(set(modules))
    if any(layer_index(m) is None for m in modules):
        return True
    layers_by_short: dict[str, set[int]] = defaultdict(set)
    for module in modules:
        layers_by_short[module.rsplit(".", 1)[-1]].add(layer_index(module))
    kinds_by_short: dict[str, set[str]] = defaultdict(set)
    for module in modules:
        kinds_by_short[module.rsplit(".", 1)[-1]].add(module_kind(module))
    if any(len(kinds) > 1 for kinds in kinds_by_short.values()):
        return True  # one short name, two places in the block (e.g. attn.proj and mlp.proj)
    every = set().union(*layers_by_short.values())
    if any(layers != every for layers in layers_by_short.values()):
        return True
    return model_layers is not None and every != set(range(model_layers))


# --------------------------------------------------------------------------- the self-check


def structure_problems(shapes: Mapping[str, tuple[str, list[int]]], config: Mapping[str, Any]) -> list[str]:
    """Everything that would make PEFT load `shapes` wrongly or partially under `config`.

    `shapes` is `{key: (dtype tag, shape)}`. An empty list means every key loads into a module PEFT
    creates, with its shape.
    """
    problems = _config_problems(config)
    if problems:
        return problems
    if not shapes:
        return ["the adapter holds no tensors (PEFT would adapt nothing, or fail with target_modules: [])"]
    r, rank_pattern, targets = config["r"], config.get("rank_pattern") or {}, config["target_modules"]
    pairs: dict[str, dict[str, tuple[str, list[int]]]] = defaultdict(dict)
    for key, (tag, shape) in sorted(shapes.items()):
        if not key.startswith(KEY_PREFIX):
            problems.append(f"{key}: does not start with {KEY_PREFIX!r}; PEFT would drop it silently")
            continue
        try:
            module, which = split_lora_name(key[len(KEY_PREFIX) :])
        except ValueError as exc:
            problems.append(f"{key}: {exc}; PEFT would drop it silently")
            continue
        if tag not in _FLOAT_TAGS:
            problems.append(f"{key}: dtype {tag} is not a floating type")
        if len(shape) == 3:
            problems.append(
                f"{key}: fused 3-D expert stack {shape}; PEFT's packed parameter layout reads it in another "
                "order in known versions, so it is refused (export per-expert 2-D adapters instead)"
            )
            continue
        if len(shape) != 2:
            problems.append(f"{key}: {len(shape)}-D tensor {shape}; a LoRA factor is 2-D")
            continue
        pairs[module][which] = (tag, shape)
    for module, pair in sorted(pairs.items()):
        problems += _pair_problems(module, pair, r, rank_pattern, targets)
    return problems


def _config_problems(config: Mapping[str, Any]) -> list[str]:
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"{CONFIG_NAME}: peft_type is {config.get('peft_type')!r}, expected 'LORA'")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        problems.append(f"{CONFIG_NAME}: r is {r!r}, expected a positive integer")
    if not isinstance(config.get("lora_alpha"), int | float) or isinstance(config.get("lora_alpha"), bool):
        problems.append(f"{CONFIG_NAME}: lora_alpha is {config.get('lora_alpha')!r}, expected a number")
    targets = config.get("target_modules")
    if not (isinstance(targets, str) and targets) and not (
        isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)
    ):
        problems.append(f"{CONFIG_NAME}: target_modules is {targets!r}; PEFT would adapt nothing")
    elif isinstance(targets, str) and (why := _regex_problem(targets)):
        problems.append(f"{CONFIG_NAME}: target_modules {targets[:80]!r} is not a valid regular expression ({why})")
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pattern.values()
    ):
        problems.append(f"{CONFIG_NAME}: rank_pattern is {pattern!r}, expected {{module: positive rank}}")
    else:
        for key in pattern:
            if why := _regex_problem(rf"(.*\.)?({key})$"):
                problems.append(
                    f"{CONFIG_NAME}: rank_pattern key {key[:80]!r} is not a valid regular expression ({why})"
                )
    if config.get("use_dora"):
        problems.append(f"{CONFIG_NAME}: use_dora is set, but DoRA magnitudes are not exported (PEFT would load none)")
    if config.get("target_parameters"):
        problems.append(f"{CONFIG_NAME}: target_parameters (fused expert stacks) are not exported by this tool")
    return problems


def _regex_problem(pattern: str) -> str | None:
    """Why `pattern` does not compile as the regular expression PEFT makes of it; None if it does.

    A config's patterns are checked before they are matched. So a hostile one is a refusal naming
    the file, never an exception out of `verify`.
    """
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError, ValueError) as exc:
        return str(exc)[:120] or type(exc).__name__
    return None


def _pair_problems(module, pair, r, rank_pattern, targets) -> list[str]:
    key = KEY_PREFIX + module
    missing = [which for which in "AB" if which not in pair]
    if missing:
        return [f"{key}: lora_{missing[0]} is missing (partial adapter: PEFT would keep B = 0 there)"]
    if not is_targeted(module, targets):
        return [f"{key}: target_modules {targets!r} does not adapt this module; PEFT would drop its weights"]
    rank = rank_for(module, r, rank_pattern)
    (_, a_shape), (_, b_shape) = pair["A"], pair["B"]
    problems = []
    if a_shape[0] != rank:
        problems.append(f"{key}.lora_A.weight: shape {a_shape} but PEFT gives this module rank {rank}")
    if b_shape[1] != rank:
        problems.append(f"{key}.lora_B.weight: shape {b_shape} but PEFT gives this module rank {rank}")
    return problems


def check_state(state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
    """The exporter's self-check on the tensors it is about to write.

    Returns None; raises ValueError naming the problems (`structure_problems`, non-finite values).
    """
    shapes = {key: (_tag(t), list(t.shape)) for key, t in state.items()}
    problems = structure_problems(shapes, config)
    for key, tensor in sorted(state.items()):
        if tensor.is_floating_point() and not all_finite(tensor):
            problems.append(f"{key}: holds NaN or Inf")
    if problems:
        raise ValueError("PEFT self-check failed: " + "; ".join(problems[:8]) + _more(problems, 8))


def check_peft_dir(path: Path) -> list[Problem]:
    """The problems of the adapter directory `path`, from headers only (no torch); raises nothing.

    It checks the config, keys, pairs, shapes against ranks, and the `format: pt` metadata.
    Finiteness and digests are core verify's job, through the manifest.
    """
    path = Path(path)
    try:
        config = json_files.read_json(path / CONFIG_NAME)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        return [Problem(CONFIG_NAME, _reason(exc))]
    try:
        metadata, entries = safetensors_format.parse_safetensors_header(
            file_reader.read_file_verified(path / WEIGHTS_NAME)
        )
    except (OSError, ValueError) as exc:
        return [Problem(WEIGHTS_NAME, _reason(exc))]
    problems = []
    if metadata.get("format") != "pt":
        problems.append(Problem(WEIGHTS_NAME, f"metadata format is {metadata.get('format')!r}, expected 'pt'"))
    shapes = {key: (tag, shape) for key, (tag, shape, _, _) in entries.items()}
    for text in structure_problems(shapes, config):
        file = CONFIG_NAME if text.startswith(CONFIG_NAME) else WEIGHTS_NAME
        problems.append(Problem(file, text.removeprefix(f"{CONFIG_NAME}: ")))
    return problems


def generation_problems(gen_dir: Path, files: Iterable[str]) -> list[Problem]:
    """The PEFT problems of the adapter among a generation's `files`.

    It sits at the top of an export root's generation, or in `peft/` of a checkpoint generation.
    Both files or neither must be there. Problems name files relative to `gen_dir`.
    """
    files = set(files)
    problems = []
    for prefix in ("", "peft/"):
        present = [name for name in (WEIGHTS_NAME, CONFIG_NAME) if prefix + name in files]
        if not present:
            continue
        if len(present) == 1:
            missing = CONFIG_NAME if present == [WEIGHTS_NAME] else WEIGHTS_NAME
            problems.append(Problem(prefix + missing, "missing: a PEFT adapter needs both files"))
            continue
        problems += [Problem(prefix + p.file, p.reason) for p in check_peft_dir(Path(gen_dir) / prefix)]
    return problems


def _tag(tensor) -> str:
    return {
        "float64": "F64",
        "float32": "F32",
        "float16": "F16",
        "bfloat16": "BF16",
    }.get(str(tensor.dtype).removeprefix("torch."), str(tensor.dtype))


def _more(items: list, shown: int) -> str:
    return f" (and {len(items) - shown} more)" if len(items) > shown else ""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "missing"
    return str(exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)
