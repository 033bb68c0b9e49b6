"""The checkpoint's hyperparameters against the ones the launch built.

A resume restores the optimizer's param groups and scheduler, which would silently override a
relaunch's new `--lr` or betas. So, before anything changes, they are compared with the ones the
launch built:

- a saved param group with a key the live group does not have is refused, under every policy;
- a key the checkpoint lacks keeps the launch's value (reported);
- every other difference is reported, naming group, key and both values, and settled by the policy:

    "checkpoint"  the checkpoint's values are restored
                  (megatron's --use-checkpoint-opt-param-scheduler)
    "launch"      the launch's values are kept, in the param groups and the scheduler
                  (--override-opt-param-scheduler)
    "refuse"      any difference refuses the load (IncompatibleCheckpoint), before anything changes
    "megatron"    (or None) megatron's own behaviour: param groups from the checkpoint, the
                  scheduler's fields checked by its `load_state_dict` (its two flags decide);
                  differences reported

`HyperparameterPolicy` names them by the strings above. Not compared: `params`, `param_names`, the
`step` counter, and `lr` and `weight_decay`, which the scheduler sets at every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from miles_lora_ckpt.core import bounded
from miles_lora_ckpt.core.errors import IncompatibleCheckpoint
from miles_lora_ckpt.core.jsoncodec import to_json

__all__ = ["REFUSED", "SCHEDULER_FIELDS", "HyperparameterPolicy", "Reconciler"]


class HyperparameterPolicy(StrEnum):
    """How a load settles a checkpoint hyperparameter that differs from the launch's."""

    CHECKPOINT = "checkpoint"  # the checkpoint's values restored
    LAUNCH = "launch"  # the launch's values kept
    REFUSE = "refuse"  # any difference refuses the load
    MEGATRON = "megatron"  # megatron's own behaviour (None means this too)

    @classmethod
    def parse(cls, value: HyperparameterPolicy | str | None) -> HyperparameterPolicy:
        """`value` as a policy (None: MEGATRON); ValueError naming the accepted values otherwise."""
        if value is None:
            return cls.MEGATRON
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"hyperparameters policy {value!r} is not one of {list(POLICIES)} or None (megatron's behaviour)"
            ) from None


POLICIES = tuple(policy.value for policy in HyperparameterPolicy)
REFUSED = "the checkpoint's hyperparameters differ from the ones this launch built"  # starts the refusal
NOT_COMPARED = ("params", "param_names", "lr", "weight_decay", "step")
# Megatron's OptimizerParamScheduler fields that its `load_state_dict` checks (`_check_and_set`).
SCHEDULER_FIELDS = (
    "max_lr",
    "min_lr",
    "lr_warmup_steps",
    "lr_decay_steps",
    "lr_decay_style",
    "start_wd",
    "end_wd",
    "wd_incr_steps",
    "wd_incr_style",
)


# What a difference's report says happened to it, per policy.
_OUTCOMES = {
    HyperparameterPolicy.CHECKPOINT: "the checkpoint's restored",
    HyperparameterPolicy.LAUNCH: "the launch's kept",
    HyperparameterPolicy.REFUSE: "refused",
    HyperparameterPolicy.MEGATRON: "the checkpoint's restored (megatron's behaviour)",
}


def _same(a: Any, b: Any) -> bool:
    try:
        return to_json(a, "checkpoint value") == to_json(b, "launch value")
    except TypeError:
        return False


def _show(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


@dataclass
class Reconciler:
    """One load's policy and the differences it found; ValueError for an unknown policy."""

    policy: HyperparameterPolicy | str | None = None  # parsed into a HyperparameterPolicy (None: MEGATRON)
    differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # launch values kept for keys the checkpoint lacks

    def __post_init__(self) -> None:
        self.policy = HyperparameterPolicy.parse(self.policy)

    def param_groups(self, where: str, saved: list[dict], live: list[dict]) -> None:
        """Check the saved param groups (decoded, changed in place) against the live ones, in order.

        `where` names the optimizer in messages. Raises ValueError for another number of groups or a
        key the live group does not have.
        """
        if len(saved) != len(live):
            raise ValueError(f"{where}: the checkpoint has {len(saved)} param groups, this run's optimizer {len(live)}")
        for index, (ours, theirs) in enumerate(zip(saved, live, strict=True)):
            label = f"{where} param group {index}"
            unknown = sorted(set(ours) - set(theirs) - set(NOT_COMPARED))
            if unknown:
                raise ValueError(
                    f"{label}: the checkpoint holds keys this run's optimizer does not have: {bounded.names(unknown)} "
                    f"(it has {sorted(set(theirs) - {'params'})}); refusing to put them into the live optimizer"
                )
            for key in sorted(set(theirs) - set(NOT_COMPARED)):
                if key not in ours:
                    ours[key] = theirs[key]
                    self.notes.append(f"{label}: the checkpoint has no {key!r}, the launch's {_show(theirs[key])} kept")
                elif not _same(ours[key], theirs[key]):
                    self._differ(f"{label}: {key}", ours, key, theirs[key])

    def scheduler(self, saved: dict, live: dict) -> None:
        """Check the saved scheduler state against the live one; 'launch' changes it in place."""
        for key in SCHEDULER_FIELDS:
            if key in saved and key in live and not _same(saved[key], live[key]):
                self._differ(f"scheduler: {key}", saved, key, live[key])

    def _differ(self, label: str, saved: dict, key: str, launch: Any) -> None:
        outcome = _OUTCOMES[self.policy]
        self.differences.append(f"{label} differs: checkpoint {_show(saved[key])}, launch {_show(launch)} ({outcome})")
        if self.policy is HyperparameterPolicy.LAUNCH:
            saved[key] = launch

    def settle(self) -> None:
        """Under 'refuse', raise IncompatibleCheckpoint naming every difference found."""
        if self.policy is HyperparameterPolicy.REFUSE and self.differences:
            raise IncompatibleCheckpoint(
                f"{REFUSED}: "
                + "; ".join(self.differences)
                + ". Continue with the checkpoint's (--use-checkpoint-opt-param-scheduler, or resume.hyperparameters "
                '= "checkpoint"), keep the launch\'s (--override-opt-param-scheduler, or resume.hyperparameters = '
                '"launch"), or relaunch the original command'
            )
