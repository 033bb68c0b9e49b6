"""The rollout side of multi-LoRA: each adapter's data state committed in its slot's generations.

Miles' multi-LoRA data source builds one source per adapter lazily and drops it when the adapter
leaves. Its `load` reaches none at a relaunch, so every adapter starts over at offset 0.
`CheckpointedMultiLoRADataSource` wraps the class `data_state.multi_lora_source` names and passes
every call on, except the checkpoint ones.

`create_source(adapter)` restores a resumed adapter's source from its slot's committed generation
of the step it resumed at. Staged states of later steps are removed. Every draw is counted per
adapter. When the draw of its step k is complete, the source's state is staged as step k in the
slot root, and the slot save of step k commits it.

Miles' async producer trains groups out of draw order and drops some silently. So the constructor
puts `generate_multi_lora_rollout` in front of `--rollout-function-path`. It records the groups
drawn and not yet shipped (`in_flight`), and a resume gives them back first.

`save(rollout_id)` writes no pickle; it removes staged states below each slot's newest committed
step. `load(rollout_id)` does nothing, because each source restores when it is built.
docs/multi-lora.md, "The data state per adapter", has the details.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from miles_lora_ckpt.core import data_state, jsoncodec
from miles_lora_ckpt.core.errors import NotACheckpoint, NothingCommitted
from miles_lora_ckpt.core.verify import check_file_content, check_structure, committed_candidates
from miles_lora_ckpt.integration.config import PluginConfig, apply_core_settings, load_config
from miles_lora_ckpt.integration.data_source import Codec, codec_for, generation_at, load_object, sample_json
from miles_lora_ckpt.integration.data_state import MULTI_HOOK, MULTI_ROLLOUT_HOOK, DataStateRefused

__all__ = [
    "CheckpointedMultiLoRADataSource",
    "generate_multi_lora_rollout",
    "newest_committed_step",
]

log = logging.getLogger("miles_lora_ckpt.integration")


@dataclass
class AdapterSource:
    """What the plugin keeps of one adapter's source: where it stages, how it reads the state."""

    name: str
    root: Path | None  # the adapter's save directory: where its states are staged (`slot_roots`)
    groups_per_step: int
    codec: Codec
    source_path: str
    drawn: int  # groups drawn since step 0 (the resumed step's count at build)
    slot: int = 0
    shipped: int = 0  # groups shipped for training since step 0 (the resumed step's count at build)
    outstanding: dict = field(default_factory=dict)  # draw stamp -> group drawn, not shipped yet
    returning: list = field(default_factory=list)  # in-flight groups of the resumed state, as JSON


def groups_per_step(adapter, args) -> int:
    """An adapter step's prompt groups: `adapter_global_batch_size / n_samples_per_prompt`."""
    config = adapter.config
    samples = int(getattr(config, "adapter_global_batch_size", 0) or 0)
    per_prompt = int(getattr(config, "n_samples_per_prompt", None) or getattr(args, "n_samples_per_prompt", 1) or 1)
    if samples <= 0 or samples % per_prompt:
        raise DataStateRefused(
            f"adapter {config.name}: adapter_global_batch_size {samples} is not a positive multiple of "
            f"n_samples_per_prompt {per_prompt}: the plugin cannot tell where its steps' draws end"
        )
    return samples // per_prompt


V1_SLOT_DIR = "checkpoints"  # Miles v1 keeps an adapter's slot root in `<adapter save>/checkpoints`


def _committed(root: Path) -> list[Path]:
    """The committed-looking generations of `root`, newest first (none while nothing is committed)."""
    try:
        return committed_candidates(root)[0]
    except (NotACheckpoint, NothingCommitted):  # only staged data states, or a killed first save's staging
        return []


def slot_roots(save: Path) -> tuple[Path, Path]:
    """Where an adapter's slot generations may be: Miles v1's `<save>/checkpoints`, then v2's `<save>`
    (the directory of the path `save_slot` names). Its data states are staged in `<save>` in both."""
    return save / V1_SLOT_DIR, save


def _slot_committed(save: Path) -> list[Path]:
    """The committed-looking generations of the adapter's slot root (v1's first, where it has any)."""
    for root in slot_roots(save):
        if candidates := _committed(root):
            return candidates
    return []


def slot_generation(save: Path, step: int, name: str) -> Path:
    """The newest intact committed generation at step `step` of the slot root of the adapter whose
    save directory is `save`, or DataStateRefused."""
    path = generation_at(_slot_committed(save), step)
    if path is not None:
        return path
    raise DataStateRefused(
        f"{save} (nor {save / V1_SLOT_DIR}) has no intact committed generation of step {step}, the step adapter "
        f"{name} resumed at: its data source refuses to start from another step's state"
    )


def newest_committed_step(save: Path) -> int | None:
    """The step of the newest intact committed generation of the adapter's slot root (None if none)."""
    for path in _slot_committed(save):
        generation = check_structure(path)
        if generation.manifest is not None and not generation.problems:
            return int(generation.manifest.iteration)
    return None


class CheckpointedMultiLoRADataSource:
    """Miles' multi-LoRA data source interface over the class `data_state.multi_lora_source` names
    (see module doc); every other attribute is the wrapped source's. Raises DataStateRefused at
    construction when that class builds no per-adapter sources (`create_source`, `sources`)."""

    def __init__(self, args, *, config: PluginConfig | None = None):
        self.args = args
        self.config = config or load_config()
        apply_core_settings(self.config)
        self.source_path = str(self.config["data_state.multi_lora_source"])
        if self.source_path == MULTI_HOOK:
            raise DataStateRefused(
                f"data_state.multi_lora_source names the plugin's own data source {MULTI_HOOK}: name the class it wraps"
            )
        source_cls = load_object(self.source_path)
        if not callable(getattr(source_cls, "create_source", None)):
            raise DataStateRefused(
                f"multi-LoRA data source class {self.source_path} has no create_source(adapter): the plugin cannot "
                "see where each adapter's source is built, so it cannot restore it"
            )
        self.inner = source_cls(args)
        if not isinstance(getattr(self.inner, "sources", None), dict):
            raise DataStateRefused(f"multi-LoRA data source {self.source_path} keeps no `sources` dict per adapter")
        self._stock_create = source_cls.create_source
        self.inner.create_source = self.create_source  # its reconcile builds every source through this
        self.adapters: dict[str, AdapterSource] = {}
        self.lock = threading.RLock()  # Miles' producer thread draws while the rollout function ships
        self.ready: deque = deque()  # groups given back (or drawn alongside them), handed out first
        self.sample_class = None  # the class of the drawn samples: what given-back groups are rebuilt as
        self.draws = 0
        self.shipping = False  # set by the first `generate_multi_lora_rollout`: stage by shipped groups
        self.rollout_function_path = self._wrap_rollout_function(args)
        self._rollout_function = None
        log.info(
            "miles-lora-ckpt: multi-LoRA data source %s; each adapter's data state staged in its slot root",
            self.source_path,
        )

    def _wrap_rollout_function(self, args) -> str | None:
        path = getattr(args, "rollout_function_path", None)
        if path is None:
            return None
        if path == MULTI_ROLLOUT_HOOK:
            raise DataStateRefused(
                f"--rollout-function-path is {MULTI_ROLLOUT_HOOK}, which the plugin's multi-LoRA data source sets "
                "itself: give the rollout function the run uses"
            )
        args.rollout_function_path = MULTI_ROLLOUT_HOOK  # the manager loads it right after this constructor
        return str(path)

    def rollout_function(self):
        """The rollout function the run configured (loaded on first use)."""
        if self._rollout_function is None:
            function = load_object(self.rollout_function_path)
            if inspect.isclass(function):
                raise DataStateRefused(
                    f"--rollout-function-path {self.rollout_function_path} is a class (Miles' experimental rollout "
                    "interface): the plugin's data source cannot see which groups it ships; use a rollout function"
                )
            self._rollout_function = function
        return self._rollout_function

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # the source of one adapter ------------------------------------------------------------------

    def create_source(self, adapter):
        """The stock source of `adapter`, resumed from its slot's generation of the adapter's step."""
        source = self._stock_create(self.inner, adapter)
        name, step = str(adapter.config.name), int(getattr(adapter, "step", 0) or 0)
        cls = type(source)
        path = f"{cls.__module__}.{cls.__qualname__}"
        codec = codec_for(cls, path, bool(self.config["data_state.accept_none"]))
        save = getattr(adapter.config, "save", None)
        root = Path(save) if save else None
        plan = AdapterSource(name, root, groups_per_step(adapter, self.args), codec, path, 0)
        plan.slot = int(getattr(adapter, "slot", 0) or 0)
        if root is not None:
            data_state.discard_staged(root, above=step)  # drawn before a kill, never committed
            if step > 0:
                self._restore(plan, source, step)
        plan.drawn = plan.shipped = step * plan.groups_per_step
        self.adapters[name] = plan
        return source

    def _restore(self, plan: AdapterSource, source, step: int) -> None:
        generation = slot_generation(plan.root, step, plan.name)
        manifest = check_structure(generation).manifest
        if data_state.DATA_STATE not in manifest.files:
            log.warning(
                "miles-lora-ckpt: %s (adapter %s, step %d) holds no data state: its data source starts over",
                generation,
                plan.name,
                step,
            )
            return
        where = str(generation / data_state.DATA_STATE)
        try:
            doc = check_file_content(generation, data_state.DATA_STATE, manifest).value
        except (OSError, ValueError) as exc:
            raise DataStateRefused(f"{where}: {exc}") from exc
        if doc.get("adapter") != plan.name:
            raise DataStateRefused(
                f"{where} holds the data state of adapter {doc.get('adapter')!r}, not of {plan.name!r}: refused"
            )
        plan.codec.restore(source, getattr(source, "args", self.args), doc["state"], where)
        plan.returning = data_state.in_flight(doc)  # given back first, before new draws
        log.info(
            "miles-lora-ckpt: data source of adapter %s resumed from %s: %s",
            plan.name,
            generation.name,
            data_state.summary(doc),
        )

    # Miles' interface --------------------------------------------------------------------------

    def get_samples(self, num_samples: int = 1):
        with self.lock:
            if self.ready:
                return [self.ready.popleft()]
            groups = self.inner.get_samples(num_samples)  # builds (and restores) the sources it needs
            if groups and self.sample_class is None:
                self.sample_class = type(groups[0][0])
            for plan in self.adapters.values():
                while plan.returning and self.sample_class is not None and plan.name in self.inner.sources:
                    group = self._given_back(plan, plan.returning[0])
                    plan.returning.pop(0)
                    self._drawn(group)  # drawn again: in flight until shipped
                    self.ready.append(group)
            for group in groups:
                self._drawn(group)
            if not self.ready:
                return groups
            self.ready.extend(groups)  # drawn now, handed out after the given-back groups
            return [self.ready.popleft()]

    def _drawn(self, group) -> None:
        plan = self.adapters.get(_adapter_of(group))
        if plan is None:
            return
        self.draws += 1
        metadata = getattr(_first_sample(group), "metadata", None)
        if self.shipping and isinstance(metadata, dict):  # stamped so the shipped group is known again
            metadata[DRAW_STAMP] = self.draws
            plan.outstanding[self.draws] = group
        plan.drawn += 1
        if not self.shipping and plan.drawn % plan.groups_per_step == 0 and plan.root is not None:
            self._stage(plan, plan.drawn // plan.groups_per_step)

    def _given_back(self, plan: AdapterSource, saved: list):
        """An in-flight group of the resumed state as the drawn samples' class, for the adapter's slot now."""
        from_dict = getattr(self.sample_class, "from_dict", None)
        if not callable(from_dict):
            raise DataStateRefused(
                f"adapter {plan.name}'s data state holds {len(plan.returning) + 1} groups in flight, and samples of "
                f"{self.sample_class.__qualname__} have no from_dict(): they cannot be given back"
            )
        group = [from_dict(jsoncodec.from_json(sample, "in-flight sample")) for sample in saved]
        for sample in group:
            ref = getattr(sample, "adapter", None)
            if dataclasses.is_dataclass(ref) and getattr(ref, "slot", plan.slot) != plan.slot:
                sample.adapter = dataclasses.replace(ref, slot=plan.slot)
        return group

    def shipped(self, groups) -> None:
        """The rollout function shipped `groups` for training: each adapter whose shipped count
        completes a step stages that step's state with its groups still in flight."""
        with self.lock:
            self.shipping = True
            for group in groups:
                plan = self.adapters.get(_adapter_of(group))
                if plan is None:
                    continue
                metadata = getattr(_first_sample(group), "metadata", None)
                stamp = metadata.get(DRAW_STAMP) if isinstance(metadata, dict) else None
                if plan.outstanding.pop(stamp, None) is None:
                    raise DataStateRefused(
                        f"the rollout function shipped a group of adapter {plan.name} its data source did not draw "
                        "(no draw stamp in its first sample's metadata): the plugin cannot tell which groups are "
                        "still in flight"
                    )
                plan.shipped += 1
                if (
                    plan.shipped % plan.groups_per_step == 0
                    and plan.root is not None
                    and plan.name in self.inner.sources
                ):
                    self._stage(plan, plan.shipped // plan.groups_per_step, in_flight=True)

    def _stage(self, plan: AdapterSource, step: int, *, in_flight: bool = False) -> Path:
        source = self.inner.sources[plan.name]
        state = plan.codec.capture(source, getattr(source, "args", self.args))
        flying = None
        if in_flight:
            flying = [
                [
                    _sample_json(sample, f"adapter {plan.name} in-flight group {g}[{i}]")
                    for i, sample in enumerate(group)
                ]
                for g, group in enumerate(plan.outstanding.values())
            ]
            flying += plan.returning  # not given back yet: still in flight
        doc = data_state.document(step, plan.source_path, state, adapter=plan.name, in_flight=flying)
        return data_state.stage(plan.root, doc)

    def add_samples(self, samples) -> None:
        with self.lock:
            for group in samples:  # handed back: drawn again later, so not part of a step's draw
                plan = self.adapters.get(_adapter_of(group))
                if plan is not None and plan.name in self.inner.sources:
                    plan.drawn -= 1
                    metadata = getattr(_first_sample(group), "metadata", None) if group else None
                    if isinstance(metadata, dict):
                        plan.outstanding.pop(metadata.get(DRAW_STAMP), None)
            return self.inner.add_samples(samples)

    def save(self, rollout_id) -> None:
        """After the saves: no pickle; staged states below each slot's newest committed step removed
        (that step's own stays: a retire saves the same step again)."""
        for plan in self.adapters.values():
            if plan.root is not None and (step := newest_committed_step(plan.root)) is not None:
                data_state.discard_staged(plan.root, upto=step - 1)

    def load(self, rollout_id=None) -> None:
        """Nothing to do: each adapter's source is restored when it is built (`create_source`)."""


DRAW_STAMP = "miles_lora_ckpt_draw"  # the metadata key of a drawn group's first sample


def _first_sample(group):
    """A group's first sample (Miles' generate functions may return a list of samples per rollout)."""
    head = group[0]
    return head[0] if isinstance(head, list) else head


def _sample_json(sample, where: str) -> dict:
    if not callable(getattr(sample, "to_dict", None)):
        raise DataStateRefused(f"{where}: a {type(sample).__qualname__} sample has no to_dict(): it cannot be saved")
    return sample_json(sample, where)


def _adapter_of(group) -> str | None:
    ref = getattr(_first_sample(group), "adapter", None) if group else None
    return None if ref is None else str(ref.name)


def generate_multi_lora_rollout(args, rollout_id, data_source, evaluation: bool = False):
    """The rollout function the plugin's multi-LoRA data source puts in front of the configured
    one: runs it, then reports the groups it shipped (its output's `samples`) to the data source."""
    if not isinstance(data_source, CheckpointedMultiLoRADataSource):
        raise DataStateRefused(
            f"{MULTI_ROLLOUT_HOOK} got a {type(data_source).__name__} data source, not the plugin's: set "
            f"--data-source-path {MULTI_HOOK} and leave --rollout-function-path as it was"
        )
    if not evaluation:
        with data_source.lock:
            data_source.shipping = True  # from the first draw of this rollout on
    output = data_source.rollout_function()(args, rollout_id, data_source, evaluation=evaluation)
    if not evaluation:
        data_source.shipped(list(getattr(output, "samples", output)))
    return output
