"""Rank-aligned failure consensus over a gloo group.

Code that can fail runs inside `attempt(...)`, which returns an `Outcome` and never raises. Then
`Consensus.agree(phase, outcome)` is one collective: if any rank failed, every rank raises the same
`CheckpointError`. So no rank skips a collective its peers entered. A dead or hung peer becomes an
error after the group's timeout. Payloads travel as JSON in uint8 tensors over gloo, which works on
CPU and survives a poisoned NCCL communicator; nothing is pickled.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from miles_lora_ckpt.core import settings
from miles_lora_ckpt.core.errors import CheckpointError, MilesLoraCkptError, RankFailure

__all__ = ["SLOT_BYTES", "Consensus", "Outcome", "attempt", "settle"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = settings.Settings.consensus_timeout_s


@dataclass(frozen=True)
class Outcome:
    """What one rank's guarded step produced: a JSON-able value, or the first error."""

    ok: bool
    value: Any = None
    error: str | None = None

    @staticmethod
    def success(value: Any = None) -> Outcome:
        """A successful outcome holding `value`."""
        return Outcome(ok=True, value=value)

    def map(self, fn: Callable[[Any], Any]) -> Outcome:
        """The same outcome with `fn(value)` as value (e.g. the JSON-able part to agree on)."""
        return Outcome.success(fn(self.value)) if self.ok else self

    def to_json(self) -> dict:
        """The outcome as an agreement round carries it (`from_json` reads it back)."""
        return {"ok": self.ok, "value": self.value, "error": self.error}

    @staticmethod
    def from_json(data: dict) -> Outcome:
        """The outcome `to_json` wrote."""
        return Outcome(ok=data["ok"], value=data["value"], error=data["error"])


def settle(phase: str, outcomes: list[Outcome]) -> list[Any]:
    """Every rank's value, by rank, from the `outcomes` a round carried (one per rank).

    Raises `CheckpointError` for `phase` naming every rank that failed, as `Consensus.agree` does.
    """
    failures = [RankFailure(r, o.error) for r, o in enumerate(outcomes) if not o.ok]
    if failures:
        raise CheckpointError(phase, failures)
    return [o.value for o in outcomes]


def attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Outcome:
    """Run `fn(*args, **kwargs)`; return its result or its exception as an `Outcome`.

    It never raises an Exception. One that is not a `MilesLoraCkptError` is a bug or the environment
    failing: its traceback goes to this rank's log, since the consensus carries only one line.
    """
    try:
        return Outcome.success(fn(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - every error must reach the consensus
        if not isinstance(exc, MilesLoraCkptError):
            log.error(
                "miles-lora-ckpt: unexpected %s (it fails the phase on every rank):", type(exc).__name__, exc_info=exc
            )
        return Outcome(ok=False, error=describe_exception(exc))


def describe_exception(exc: BaseException) -> str:
    """`Type: message` plus the innermost frame, short enough to print once per rank.

    For an exception that is not the package's own, it points to the traceback `attempt` logged.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno})" if frames else ""
    logged = "" if isinstance(exc, MilesLoraCkptError) else "; its traceback is in that rank's log"
    return f"{type(exc).__name__}: {exc}{where}{logged}"


class Consensus:
    """Agreement among all ranks of one process group, or a single process when world is 1."""

    def __init__(self, group: Any = None, *, rank: int = 0, world_size: int = 1):
        self.group = group
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def single_process(cls) -> Consensus:
        """The consensus of a single process: agreement is the process's own outcome."""
        return cls(None, rank=0, world_size=1)

    @classmethod
    def for_world(cls, timeout_s: float = DEFAULT_TIMEOUT_S) -> Consensus:
        """A consensus over every rank of the initialised default group, on a fresh gloo group.

        Collective: every rank must call it at the same point, since it creates a process group.
        Without torch.distributed initialised it returns the single-process consensus.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return cls.single_process()
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        return cls(group, rank=dist.get_rank(), world_size=dist.get_world_size())

    @classmethod
    def default(cls) -> Consensus:
        """The process-wide world consensus, made on first use (so first use is collective).

        Its timeout is the `consensus_timeout_s` setting (`$MILES_LORA_CKPT_TIMEOUT_S`, 600 s by
        default).
        """
        global _DEFAULT
        if _DEFAULT is None:
            _DEFAULT = cls.for_world(settings.current().consensus_timeout_s)
        return _DEFAULT

    # ------------------------------------------------------------------ collectives

    def agree(self, phase: str, outcome: Outcome) -> list[Any]:
        """Collective: every rank's value of `phase`, indexed by rank, on every rank.

        Raises `CheckpointError` on every rank if any rank failed, or if a peer died or timed out.
        """
        everyone = self._all_gather_json(phase, outcome.to_json())
        return settle(phase, [Outcome.from_json(o) for o in everyone])

    def agree_same(self, phase: str, outcome: Outcome) -> Any:
        """Like `agree`, but every rank's value must be identical; returns that value.

        Raises `CheckpointError` on every rank when any rank failed or the values differ.
        """
        values = self.agree(phase, outcome)
        distinct = {json.dumps(v, sort_keys=True) for v in values}
        if len(distinct) > 1:
            detail = [RankFailure(r, f"has {json.dumps(v, sort_keys=True)}") for r, v in enumerate(values)]
            raise CheckpointError(f"{phase} (ranks disagree)", detail)
        return values[0]

    def _all_gather_json(self, phase: str, obj: Any) -> list[Any]:
        """Every rank's `obj`, by rank.

        One all-gather of a `SLOT_BYTES` slot per rank (an 8-byte length, then the JSON) carries
        every payload that fits. When some rank's does not, a second all-gather carries the rest of
        every payload, padded to the longest.
        """
        if self.world_size == 1:
            return [json.loads(json.dumps(obj))]
        import torch
        import torch.distributed as dist

        raw = json.dumps(obj).encode()
        slot = torch.zeros(SLOT_BYTES, dtype=torch.uint8)
        head = len(raw).to_bytes(8, "little") + raw[: SLOT_BYTES - 8]
        slot[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        try:
            slots = [torch.empty(SLOT_BYTES, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(slots, slot, group=self.group)
            sizes = [int.from_bytes(s[:8].numpy().tobytes(), "little") for s in slots]
            parts = [s[8 : 8 + min(n, SLOT_BYTES - 8)].numpy().tobytes() for s, n in zip(slots, sizes, strict=True)]
            longest = max(sizes) - (SLOT_BYTES - 8)
            if longest > 0:  # some payload did not fit: every rank sends the rest of its own
                rest = torch.zeros(longest, dtype=torch.uint8)
                tail = raw[SLOT_BYTES - 8 :]
                if tail:
                    rest[: len(tail)] = torch.frombuffer(bytearray(tail), dtype=torch.uint8)
                gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
                dist.all_gather(gathered, rest, group=self.group)
                parts = [
                    part + t[: max(0, n - (SLOT_BYTES - 8))].numpy().tobytes()
                    for part, t, n in zip(parts, gathered, sizes, strict=True)
                ]
        except Exception as exc:  # noqa: BLE001 - a dead or hung peer: gloo reports it after the timeout, in any type
            raise CheckpointError(phase, [RankFailure(self.rank, peer_lost(phase, self.rank, exc))]) from None
        return [json.loads(part) for part in parts]


def peer_lost(phase: str, rank: int, exc: BaseException) -> str:
    """The one line an operator reads when a collective of `phase` failed on `rank`.

    A peer died, hung past the timeout or lost its connection. The transport's own message goes to
    the debug log with its traceback, not into the error.
    """
    log.debug("rank %d: the collective of phase %r failed in the transport", rank, phase, exc_info=exc)
    return (
        f"the collective of phase '{phase}' failed on rank {rank}: a peer died or timed out "
        f"({type(exc).__name__}; the transport's message is in the debug log, logger {log.name!r})"
    )


SLOT_BYTES = 2048  # the first all-gather's bytes per rank: most agreements fit in it whole


_DEFAULT: Consensus | None = None
