"""Fault injection at named protocol phases, for tests, the demo and drills.

A fault is armed for one rank and one phase, and either raises `InjectedFault` or SIGKILLs the
process. Arm it in code (`arm`) or from the environment, before the process starts::

    MILES_LORA_CKPT_FAULT="mid-write@1:kill"          # rank 1 SIGKILLs itself mid-write
    MILES_LORA_CKPT_FAULT="before-publish@0:raise"    # rank 0 raises just before publishing

When nothing is armed, `point()` is one dict lookup.
"""

from __future__ import annotations

import os
import signal

from miles_lora_ckpt.core.errors import MilesLoraCkptError

__all__ = [
    "LOAD_PHASES",
    "PEFT_PHASES",
    "PHASES",
    "PREPARE_PHASES",
    "SAVE_PHASES",
    "InjectedFault",
    "arm",
    "arm_from_env",
    "disarm",
    "point",
]

SAVE_PHASES = (
    "before-write",
    "mid-write",
    "after-write",
    "after-consensus",
    "mid-manifest",
    "before-publish",
    "after-publish",
)
# The prepare phase of a save, on every rank; on the coordinator its staging directory exists.
# Kept out of SAVE_PHASES, which the protocol's multi-rank matrices and `demo --crash-at` walk.
PREPARE_PHASES = ("after-prepare",)
LOAD_PHASES = ("before-read", "after-preflight")
# PEFT export (savers/peft_export): binding the Megatron-Bridge source on every rank, then the
# collective Bridge export. Its staging, write and publish use the protocol's phases above.
PEFT_PHASES = ("peft-setup", "peft-export")
PHASES = SAVE_PHASES + PREPARE_PHASES + LOAD_PHASES + PEFT_PHASES
ACTIONS = ("raise", "kill")
ENV_VAR = "MILES_LORA_CKPT_FAULT"


class InjectedFault(MilesLoraCkptError, RuntimeError):
    """Raised by an armed `raise` fault."""


_armed: dict[tuple[str, int], str] = {}


def arm(phase: str, rank: int, action: str = "raise") -> None:
    """Arm a fault at `phase` on `rank`: `raise` an InjectedFault or `kill` the process (SIGKILL).

    An unknown phase or action raises ValueError.
    """
    if phase not in PHASES:
        raise ValueError(f"unknown fault phase {phase!r}; known: {', '.join(PHASES)}")
    if action not in ACTIONS:
        raise ValueError(f"unknown fault action {action!r}; known: {', '.join(ACTIONS)}")
    _armed[(phase, rank)] = action


def disarm() -> None:
    """Forget every armed fault."""
    _armed.clear()


def arm_from_env(environ: dict[str, str] | None = None) -> None:
    """Arm every `phase@rank:action` of the comma-separated `MILES_LORA_CKPT_FAULT`.

    `environ` defaults to `os.environ`. A malformed item raises ValueError.
    """
    spec = (environ if environ is not None else os.environ).get(ENV_VAR, "")
    for item in filter(None, (part.strip() for part in spec.split(","))):
        where, _, action = item.partition(":")
        phase, _, rank = where.partition("@")
        arm(phase, int(rank), action or "raise")


def point(phase: str, rank: int) -> None:
    """A named place in the protocol: fire the fault armed for `(phase, rank)`, once.

    Raises InjectedFault for a `raise` fault; a `kill` fault never returns.
    """
    if not _armed:
        return
    action = _armed.pop((phase, rank), None)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "raise":
        raise InjectedFault(f"injected fault at phase '{phase}' on rank {rank}")


arm_from_env()
