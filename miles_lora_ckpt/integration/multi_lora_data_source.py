"""The rollout side of multi-LoRA: each adapter's data state committed in its slot's generations.

Miles' multi-LoRA data source (`miles.rollout.multi_lora.data_source.MultiLoRAAsyncDataSource`,
multi-LoRA v2) keeps one data source per adapter, built lazily when a draw first sees the adapter in
the controller's snapshot and deleted when the adapter leaves; its `load` reaches only the sources
that exist, none at a relaunch. So every adapter, and every adapter retired and registered again,
starts over at offset 0.

`CheckpointedMultiLoRADataSource` (Miles' `--data-source-path
miles_lora_ckpt.hooks.CheckpointedMultiLoRADataSource`) builds the class `data_state.multi_lora_source`
names and passes every call on, except:

- `create_source(adapter)` (the wrapped class's `reconcile` builds every source through it): the
  stock source, then, when the adapter resumed at step S > 0 (the controller's step after its slot
  was loaded), its state from the slot's committed generation of step S (the slot root: Miles v1's
  `<adapter save>/checkpoints`, or v2's `<adapter save>`), never from another step's; a generation without a data state warns and
  the source starts over. Staged states of steps > S (drawn before a kill, never committed) are
  removed. A source class whose state the plugin does not understand is refused, as single-LoRA.
- every draw: the adapter's groups are counted; when its count reaches k * (its
  `adapter_global_batch_size / n_samples_per_prompt`), the draw of its step k is complete, and the
  state of its source is staged, sealed, as step k in the adapter's save directory
  (`core.data_state.stage`). The slot save of step k (v1 periodic or retire, v2 `save_slot`) commits
  it inside the slot generation (`integration.multi_lora`). Groups handed
  back (`add_samples`) are counted off: they are drawn again.
- `save(rollout_id)`: no pickle is written; staged states below each slot's newest committed step
  are removed (that step's own stays: a retire saves the same step again). `load(rollout_id)`: nothing (each source restores when it is built).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from miles_lora_ckpt.core import data_state
from miles_lora_ckpt.core.errors import NotACheckpoint, NothingCommitted
from miles_lora_ckpt.core.verify import check_file_content, check_structure, committed_candidates
from miles_lora_ckpt.integration.config import PluginConfig, apply_core_settings, load_config
from miles_lora_ckpt.integration.data_source import Codec, codec_for, generation_at, load_object
from miles_lora_ckpt.integration.data_state import MULTI_HOOK, DataStateRefused

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
        log.info(
            "miles-lora-ckpt: multi-LoRA data source %s; each adapter's data state staged in its slot root",
            self.source_path,
        )

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
        if root is not None:
            data_state.discard_staged(root, above=step)  # drawn before a kill, never committed
            if step > 0:
                self._restore(plan, source, step)
        plan.drawn = step * plan.groups_per_step
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
        log.info(
            "miles-lora-ckpt: data source of adapter %s resumed from %s: %s",
            plan.name,
            generation.name,
            data_state.summary(doc),
        )

    # Miles' interface --------------------------------------------------------------------------

    def get_samples(self, num_samples: int = 1):
        groups = self.inner.get_samples(num_samples)
        for group in groups:
            plan = self.adapters.get(_adapter_of(group))
            if plan is None:
                continue
            plan.drawn += 1
            if plan.drawn % plan.groups_per_step == 0 and plan.root is not None:
                self._stage(plan, plan.drawn // plan.groups_per_step)
        return groups

    def _stage(self, plan: AdapterSource, step: int) -> Path:
        source = self.inner.sources[plan.name]
        state = plan.codec.capture(source, getattr(source, "args", self.args))
        return data_state.stage(plan.root, data_state.document(step, plan.source_path, state, adapter=plan.name))

    def add_samples(self, samples) -> None:
        for group in samples:  # handed back: drawn again later, so not part of a step's draw
            plan = self.adapters.get(_adapter_of(group))
            if plan is not None and plan.name in self.inner.sources:
                plan.drawn -= 1
        return self.inner.add_samples(samples)

    def save(self, rollout_id) -> None:
        """After the saves: no pickle; staged states below each slot's newest committed step removed
        (that step's own stays: a retire saves the same step again)."""
        for plan in self.adapters.values():
            if plan.root is not None and (step := newest_committed_step(plan.root)) is not None:
                data_state.discard_staged(plan.root, upto=step - 1)

    def load(self, rollout_id=None) -> None:
        """Nothing to do: each adapter's source is restored when it is built (`create_source`)."""


def _adapter_of(group) -> str | None:
    ref = getattr(group[0], "adapter", None) if group else None
    return None if ref is None else str(ref.name)
