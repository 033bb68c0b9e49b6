"""What a save or a load is asked to do, as one value each, built once where the call starts.

The public functions (`save_lora_checkpoint`, `load_lora_checkpoint`, ...) take keywords, as
Miles' do. They build a `SaveOptions` or `LoadOptions` from them and pass it down whole. The Miles
integration builds the same from Miles' arguments and the plugin config. The live objects (model,
optimizer, scheduler, consensus) are not options: they travel beside them.

`LoadSource` names what a load restored from (`LoadResult.source`). Its values are the strings
that results and JSON have always held.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from miles_lora_ckpt.core.hyperparameters import HyperparameterPolicy

if TYPE_CHECKING:
    from miles_lora_ckpt.savers.peft_export import PeftExport

__all__ = ["LoadOptions", "LoadSource", "SaveOptions", "children_tuple"]


class LoadSource(StrEnum):
    """What a load restored from (`LoadResult.source`)."""

    GENERATION = "generation"  # a committed generation of this plugin
    LEGACY_MILES = "legacy-miles"  # a stock Miles adapter directory of per-rank `.pt` files: weights only
    NATIVE_DIST = "native-dist"  # a stock Miles native `torch_dist` checkpoint (weights only)
    NONE = "none"  # nothing: a missing path or a root with nothing committed yet


def children_tuple(optimizer_children: Iterable[int] | None) -> tuple[int, ...] | None:
    """The leaf indices `optimizer_children`, sorted and without repeats; None (all) stays None."""
    return None if optimizer_children is None else tuple(sorted({int(i) for i in optimizer_children}))


@dataclass(frozen=True)
class SaveOptions:
    """What a save writes beyond the live state (`save_lora_checkpoint`'s keywords).

    - `iteration`: the generation's iteration (None: `args.iteration`, else 0).
    - `keep`: afterwards keep the newest `keep` intact generations (None: all).
    - `optimizer_children`: save only these children (leaf indices, sorted; None: all) and the
      adapter weights they step.
    - `peft`: also export an HF PEFT adapter into the generation (synchronous saves only).
    - `data_state`: rank 0's rollout data state of this rollout (`core.data_state.document`).
    """

    iteration: int | None = None
    keep: int | None = None
    optimizer_children: tuple[int, ...] | None = None
    peft: PeftExport | None = None
    data_state: dict | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizer_children", children_tuple(self.optimizer_children))

    @property
    def selection(self) -> list[int] | None:
        """The chosen children as the list the save's plan records (None: all)."""
        return None if self.optimizer_children is None else list(self.optimizer_children)


@dataclass(frozen=True)
class LoadOptions:
    """What a load restores (`load_lora_checkpoint`'s keywords).

    - `load_optim`: False (Miles' `--no-load-optim`) restores the adapter only. The masters are
      refreshed from it and the scheduler is repositioned from the iteration.
    - `weights_only`: the adapter only, as `load_optim=False`, and no RNG state (Miles'
      `--finetune`, `--lora-adapter-path`).
    - `load_rng`: False (Miles' `--no-load-rng`) leaves every RNG as megatron seeded it.
    - `optimizer_children`: restore only these children (sorted; None: all) and the adapter
      weights they step.
    - `hyperparameters`: how a checkpoint hyperparameter that differs from the launch's is settled
      (`core.hyperparameters`). A string or None is parsed; an unknown one raises ValueError.
    - `scheduler_increment_per_iteration`: the step a reposition multiplies the iteration by
      (None: derived from the saved scheduler).
    """

    load_optim: bool = True
    weights_only: bool = False
    load_rng: bool = True
    optimizer_children: tuple[int, ...] | None = None
    hyperparameters: HyperparameterPolicy = HyperparameterPolicy.MEGATRON
    scheduler_increment_per_iteration: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizer_children", children_tuple(self.optimizer_children))
        object.__setattr__(self, "hyperparameters", HyperparameterPolicy.parse(self.hyperparameters))

    @property
    def restore_optimizer(self) -> bool:
        """Whether saved optimizer state (masters, moments, param groups, scheduler) is restored."""
        return self.load_optim and not self.weights_only

    @property
    def restore_rng(self) -> bool:
        """Whether this rank's saved RNG states are restored (where the layout is the saved one)."""
        return self.load_rng and not self.weights_only

    @property
    def selection(self) -> list[int] | None:
        """The chosen children as a list (None: all)."""
        return None if self.optimizer_children is None else list(self.optimizer_children)
