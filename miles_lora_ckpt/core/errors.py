"""The two errors users see.

`CheckpointError` is collective: it is raised with the same text on every rank, after the ranks
agreed that some phase failed somewhere. `GenerationDamaged` is what verification finds in one
generation directory (a list of `(relative file, reason)` problems); loaders turn it into a
`CheckpointError` through the consensus so that no rank goes on alone. `IncompatibleCheckpoint`
is what a loader raises for an intact generation it must not restore into this run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankFailure:
    """The first error one rank saw in a phase."""

    rank: int
    error: str


class CheckpointError(RuntimeError):
    """A checkpoint phase failed on at least one rank; raised identically on every rank."""

    def __init__(self, phase: str, failures: list[RankFailure]):
        self.phase = phase
        self.failures = sorted(failures, key=lambda f: f.rank)
        ranks = self.failed_ranks
        lines = [f"checkpoint phase '{phase}' failed on rank(s) {ranks}:"]
        lines += [f"  rank {f.rank}: {f.error}" for f in self.failures]
        super().__init__("\n".join(lines))

    @property
    def failed_ranks(self) -> list[int]:
        return sorted({f.rank for f in self.failures})


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a generation: the file (relative to the generation) and why."""

    file: str
    reason: str

    def __str__(self) -> str:
        return f"ERROR {self.file}: {self.reason}"


class GenerationDamaged(Exception):
    """A generation directory failed verification."""

    def __init__(self, path: str, problems: list[Problem]):
        self.path = path
        self.problems = problems
        super().__init__(f"{path} is damaged: " + "; ".join(str(p) for p in problems))


class NothingCommitted(GenerationDamaged):
    """A save root holds staging directories but no committed generation (yet)."""


class NotACheckpoint(Exception):
    """A path holds neither a committed generation nor a save root."""


class IncompatibleCheckpoint(ValueError):
    """An intact generation that cannot be restored into this run (another model-parallel layout,
    another saver): a refusal of the whole load, never a reason to fall back to an older one."""
