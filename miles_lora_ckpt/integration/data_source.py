"""The rollout side: the plugin's data source, Miles' `--data-source-path` in the rollout manager.

The init hook runs only in the train actors; the rollout manager builds its data source in its own
process, from `--data-source-path`. `CheckpointedDataSource` is that entry point. It wraps the
class `data_state.source` names and passes every call on, except the checkpoint ones.

Construction refuses a class whose state it cannot read (`codec_for`). It also puts
`generate_rollout` in front of `--rollout-function-path`, to see where each rollout ends. Each
finished rollout's state is staged, sealed (`core.data_state.stage`). The train side's save of
generation N commits rollout N's (`integration.data_state`). `save(N)` writes no pickle: it removes
the staged states that generation N and older hold. `load(N)` reads the state from the committed
generation N, never from a loose file. It removes later staged states, which the relaunch draws
again.

docs/use-with-miles.md, "The rollout data state", says what each case does.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_lora_ckpt.core import data_state, jsoncodec
from miles_lora_ckpt.core.verify import check_file_content, check_structure, committed_candidates
from miles_lora_ckpt.integration import resume
from miles_lora_ckpt.integration.config import PluginConfig, apply_core_settings, load_config
from miles_lora_ckpt.integration.data_state import HOOK, ROLLOUT_HOOK, DataStateRefused

__all__ = [
    "CheckpointedDataSource",
    "generate_rollout",
    "DataStateRefused",
    "Codec",
    "codec_for",
    "generation_at",
    "load_object",
    "read_stock_state",
    "sample_json",
]

log = logging.getLogger("miles_lora_ckpt.integration")

MILES_MODULE = "miles.rollout.data_source"
MILES_CLASSES = ("RolloutDataSource", "RolloutDataSourceWithBuffer")  # their state is read by attribute
STOCK_FILE = "rollout/global_dataset_state_dict_{rollout_id}.pt"


def load_object(path: str) -> Any:
    """The object a dotted path names, as Miles' `load_function` resolves it."""
    module, _, name = path.rpartition(".")
    if not module:
        raise DataStateRefused(f"{path!r} is not a dotted path (module.name)")
    return getattr(importlib.import_module(module), name)


# --------------------------------------------------------------------------- what state a class has


@dataclass(frozen=True)
class Codec:
    """How the plugin reads and restores one data source class's state: 'miles' (Miles' own
    classes, by attribute), 'custom' (the class's `state_dict()` / `load_state_dict()`), or
    'none' (accepted by `data_state.accept_none`: no state)."""

    kind: str

    def capture(self, inner, args) -> dict | None:
        if self.kind == "custom":
            return {"kind": "custom", "value": jsoncodec.to_json(inner.state_dict(), "state_dict()")}
        if self.kind == "miles":
            return capture_miles(inner, args)
        return None

    def restore(self, inner, args, state: dict | None, where: str) -> None:
        if state is None:
            log.warning("miles-lora-ckpt: %s holds no data state (accepted): the data source starts over", where)
            return
        if state["kind"] == "custom" and self.kind == "custom":
            inner.load_state_dict(jsoncodec.from_json(state["value"], "state_dict()"))
        elif state["kind"] == "miles" and self.kind == "miles":
            restore_miles(inner, args, state, where)
        else:
            raise DataStateRefused(f"{where} holds a '{state['kind']}' data state; this data source's is '{self.kind}'")


def codec_for(cls: type, path: str, accept_none: bool) -> Codec:
    """The codec of `cls`, or DataStateRefused naming the class and what it lacks."""
    if callable(getattr(cls, "state_dict", None)) and callable(getattr(cls, "load_state_dict", None)):
        return Codec("custom")
    if cls.__module__ == MILES_MODULE and cls.__qualname__ in MILES_CLASSES:
        return Codec("miles")
    if accept_none:
        log.warning(
            "miles-lora-ckpt: data source %s has no state the plugin understands; accepted: a resume restarts it", path
        )
        return Codec("none")
    raise DataStateRefused(
        f"data source class {path} has no state miles-lora-ckpt understands: it is not Miles' "
        f"{' or '.join(MILES_CLASSES)} (a subclass may hold state of its own) and lacks state_dict() and "
        "load_state_dict() (returning / taking JSON-able state); add them, or set data_state.accept_none = true "
        "to resume without its data state"
    )


def capture_miles(inner, args) -> dict:
    """The state of Miles' RolloutDataSource(WithBuffer) as JSON: cursor, metadata, dataset, buffer."""
    dataset = getattr(inner, "dataset", None)
    buffer = getattr(inner, "buffer", None)
    return {
        "kind": "miles",
        "cursor": {key: int(getattr(inner, key)) for key in data_state.CURSOR_KEYS},
        "metadata": jsoncodec.to_json(inner.metadata, "metadata"),
        "dataset": None
        if dataset is None
        else {
            "size": len(dataset.origin_samples),
            "shuffle": bool(getattr(args, "rollout_shuffle", False)),
            "seed": dataset.seed,
        },
        "buffer": None
        if buffer is None
        else [[sample_json(s, f"buffer[{g}][{i}]") for i, s in enumerate(group)] for g, group in enumerate(buffer)],
    }


def sample_json(sample, where: str) -> dict:
    """One Miles `Sample` as JSON (its `to_dict()`); a value JSON cannot hold is refused, named."""
    return jsoncodec.to_json(sample.to_dict(), where)


def restore_miles(inner, args, state: dict, where: str) -> None:
    """Put a captured state back into Miles' RolloutDataSource(WithBuffer), as Miles' own `load`
    does for the cursor (and the epoch's shuffle), plus the buffered groups."""
    dataset, saved = getattr(inner, "dataset", None), state["dataset"]
    if dataset is not None and saved is not None:
        size = len(dataset.origin_samples)
        shuffle = bool(getattr(args, "rollout_shuffle", False))
        if (saved["size"], saved["seed"], saved["shuffle"]) != (size, dataset.seed, shuffle):
            raise DataStateRefused(
                f"{where}: saved over a dataset of {saved['size']} prompts (seed {saved['seed']}, shuffle "
                f"{saved['shuffle']}); this launch has {size} (seed {dataset.seed}, shuffle {shuffle}): its cursor "
                "would point at other prompts"
            )
    for key in data_state.CURSOR_KEYS:
        setattr(inner, key, state["cursor"][key])
    inner.metadata = jsoncodec.from_json(state["metadata"], "metadata")
    if dataset is not None and getattr(args, "rollout_shuffle", False):
        dataset.shuffle(inner.epoch_id)
    groups = state["buffer"] or []
    if not hasattr(inner, "buffer"):
        if groups:
            raise DataStateRefused(f"{where} holds {len(groups)} buffered groups; {type(inner).__name__} has no buffer")
        return
    from miles.utils.types import Sample  # the rollout manager's Miles

    inner.buffer[:] = [[Sample.from_dict(jsoncodec.from_json(s, "sample")) for s in group] for group in groups]


# --------------------------------------------------------------------------- the data source


class CheckpointedDataSource:
    """Miles' data source interface (`get_samples`, `add_samples`, `save`, `load`), over the class
    `data_state.source` names; every other attribute is the wrapped source's. Raises
    DataStateRefused at construction for a class whose state it cannot checkpoint (see module doc)."""

    def __init__(self, args, *, config: PluginConfig | None = None):
        self.args = args
        self.config = config or load_config()
        apply_core_settings(self.config)  # the signing key, as the train side's init hook applies it
        self.source_path = str(self.config["data_state.source"])
        if self.source_path == HOOK:
            raise DataStateRefused(
                f"data_state.source names the plugin's own data source {HOOK}: name the class it wraps"
            )
        source_cls = load_object(self.source_path)
        self.codec = codec_for(source_cls, self.source_path, bool(self.config["data_state.accept_none"]))
        self.inner = source_cls(args)
        save = getattr(args, "save", None)
        self.root = resume.save_root(self.config, save) if save else None
        self.rollout_function = self._wrap_rollout_function(args)
        log.info("miles-lora-ckpt: data source %s; rollout data states staged in %s", self.source_path, self.root)

    def _wrap_rollout_function(self, args):
        path = getattr(args, "rollout_function_path", None)
        if path == ROLLOUT_HOOK:
            raise DataStateRefused(
                f"--rollout-function-path is {ROLLOUT_HOOK}, which the plugin's data source sets itself: "
                "give the rollout function the run uses"
            )
        function = load_object(path)
        if inspect.isclass(function):
            raise DataStateRefused(
                f"--rollout-function-path {path} is a class (Miles' experimental rollout interface): the plugin's "
                "data source cannot see where its rollouts end; use a rollout function"
            )
        args.rollout_function_path = ROLLOUT_HOOK  # the manager loads it right after this constructor
        return function

    def __getattr__(self, name: str):
        if name == "inner":  # not built yet (a failed constructor): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    # Miles' interface --------------------------------------------------------------------------

    def get_samples(self, num_samples: int):
        return self.inner.get_samples(num_samples)

    def add_samples(self, samples) -> None:
        return self.inner.add_samples(samples)

    def save(self, rollout_id) -> None:
        """After the actor's save of `rollout_id`: no pickle is written; the staged states up to it
        are removed (generation `rollout_id` holds its own)."""
        if self.root is not None:
            data_state.discard_staged(self.root, upto=int(rollout_id))

    def load(self, rollout_id=None) -> None:
        """A relaunch at rollout `rollout_id + 1`: the state committed in generation `rollout_id`."""
        rollout = -1 if rollout_id is None else int(rollout_id)
        load = getattr(self.args, "load", None)
        if self.root is not None:
            data_state.discard_staged(self.root, above=rollout)  # drawn before the kill, never committed
        if rollout < 0 or not load:
            return
        root = resume.plugin_root(self.config, load)
        if root is None:
            self._load_stock(Path(load), rollout, f"{load} holds no miles-lora-ckpt save root")
            return
        generation = committed_generation(root, rollout)
        manifest = check_structure(generation).manifest
        if data_state.DATA_STATE not in manifest.files:
            self._load_stock(
                Path(load),
                rollout,
                f"{generation} (rollout {rollout}) holds no rollout data state (saved before miles-lora-ckpt "
                "committed it, or with data_state.missing = 'warn'): no cursor, epoch, sample counters, metadata or "
                "buffered samples",
            )
            return
        try:
            doc = check_file_content(generation, data_state.DATA_STATE, manifest).value
        except (OSError, ValueError) as exc:
            raise DataStateRefused(f"{generation / data_state.DATA_STATE}: {exc}") from exc
        self.codec.restore(self.inner, self.args, doc["state"], str(generation / data_state.DATA_STATE))
        log.info("miles-lora-ckpt: data source resumed from %s: %s", generation.name, data_state.summary(doc))

    # the plugin's own ---------------------------------------------------------------------------

    def rollout_done(self, rollout_id: int) -> Path | None:
        """Stage the data state of `rollout_id` (its draw complete; the next one not started)."""
        if self.root is None:
            return None
        doc = data_state.document(rollout_id, self.source_path, self.codec.capture(self.inner, self.args))
        return data_state.stage(self.root, doc)

    def _load_stock(self, load: Path, rollout: int, lacks: str) -> None:
        """A generation (or `--load`) without the plugin's data state: Miles' own file, read with
        `torch.load(weights_only=True)` if it is there (refused, named, if that fails), else start over."""
        path = load / STOCK_FILE.format(rollout_id=rollout)
        if self.codec.kind != "miles":  # Miles' file holds the cursor of Miles' own classes only
            log.warning("miles-lora-ckpt: %s: %s starts over", lacks, self.source_path)
            return
        if not path.is_file():
            log.warning("miles-lora-ckpt: %s, and %s does not exist: the data source starts over", lacks, path)
            return
        state = read_stock_state(path)
        for key in data_state.CURSOR_KEYS:
            setattr(self.inner, key, state.get(key, 0))
        self.inner.metadata = state.get("metadata", {})
        dataset = getattr(self.inner, "dataset", None)
        if dataset is not None and getattr(self.args, "rollout_shuffle", False):
            dataset.shuffle(self.inner.epoch_id)
        log.warning(
            "miles-lora-ckpt: %s; read the cursor from %s (no buffered samples: Miles never saves them)", lacks, path
        )


def generation_at(paths: list[Path], iteration: int) -> Path | None:
    """The first of `paths` (committed generations, newest first) that is intact and holds
    `iteration`, or None."""
    for path in paths:
        generation = check_structure(path)
        if generation.manifest is not None and generation.manifest.iteration == iteration and not generation.problems:
            return path
    return None


def committed_generation(root: Path, rollout: int) -> Path:
    """The newest intact committed generation of `root` whose rollout is `rollout` (the one the
    train side resumed from), or DataStateRefused."""
    path = generation_at(committed_candidates(root)[0], rollout)
    if path is not None:
        return path
    raise DataStateRefused(
        f"{root} has no intact committed generation of rollout {rollout}, the rollout the train side resumed from: "
        "the data source refuses to start from another rollout's state"
    )


def read_stock_state(path: Path) -> dict:
    """Miles' `global_dataset_state_dict_N.pt`, with `torch.load(weights_only=True)` and checked."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure is this file's
        raise DataStateRefused(
            f"{path}: cannot be read with torch.load(weights_only=True) ({type(exc).__name__}: {exc}); "
            "miles-lora-ckpt never unpickles it: remove it to start the data source over"
        ) from exc
    if not isinstance(state, dict):
        raise DataStateRefused(f"{path}: holds a {type(state).__name__}, not Miles' data-source state dict")
    for key in data_state.CURSOR_KEYS:
        value = state.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise DataStateRefused(f"{path}: {key} is {value!r}, not a non-negative integer")
    try:
        jsoncodec.to_json(state.get("metadata", {}), "metadata")
    except TypeError as exc:
        raise DataStateRefused(f"{path}: {exc}") from exc
    return state


def generate_rollout(args, rollout_id, data_source, evaluation: bool = False):
    """The rollout function the plugin's data source puts in front of the configured one: runs it,
    then (training rollouts) stages the data state of `rollout_id`."""
    if not isinstance(data_source, CheckpointedDataSource):
        raise DataStateRefused(
            f"{ROLLOUT_HOOK} got a {type(data_source).__name__} data source, not the plugin's: set "
            f"--data-source-path {HOOK} and leave --rollout-function-path as it was"
        )
    output = data_source.rollout_function(args, rollout_id, data_source, evaluation=evaluation)
    if not evaluation:
        data_source.rollout_done(int(rollout_id))
    return output
