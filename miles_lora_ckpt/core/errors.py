"""The errors users see, all derived from one base, `MilesLoraCkptError`.

`CheckpointError` is collective: every rank raises the same text once the ranks agreed a phase
failed. `GenerationDamaged` is the one damage exception; a save root's loader falls back past it to
an older generation. `IncompatibleCheckpoint` refuses an intact generation and never falls back.
Any other exception in a load's checks is a bug: see docs/guarantees.md, "A bug is not damage".
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CheckpointError",
    "CommittedButFailed",
    "GenerationDamaged",
    "IncompatibleCheckpoint",
    "MilesLoraCkptError",
    "NotACheckpoint",
    "NothingCommitted",
    "Problem",
    "RankFailure",
]


class MilesLoraCkptError(Exception):
    """Base of every error this package raises on purpose (catch it to catch them all)."""


@dataclass(frozen=True)
class RankFailure:
    """The first error one rank saw in a phase."""

    rank: int
    error: str


class CheckpointError(MilesLoraCkptError, RuntimeError):
    """A checkpoint phase failed on at least one rank; raised identically on every rank.

    Takes the phase's name and each failed rank's first error; the text names both.
    """

    def __init__(self, phase: str, failures: list[RankFailure]):
        self.phase = phase
        self.failures = sorted(failures, key=lambda f: f.rank)
        ranks = self.failed_ranks
        lines = [f"checkpoint phase '{phase}' failed on rank(s) {ranks}:"]
        lines += [f"  rank {f.rank}: {f.error}" for f in self.failures]
        super().__init__("\n".join(lines))

    @property
    def failed_ranks(self) -> list[int]:
        """The ranks that failed, in order."""
        return sorted({f.rank for f in self.failures})


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a generation: the file (relative to the generation) and why."""

    file: str
    reason: str

    def __str__(self) -> str:
        return f"ERROR {self.file}: {self.reason}"


class GenerationDamaged(MilesLoraCkptError, ValueError):
    """The one damage exception: what a check found wrong with a generation's bytes.

    `GenerationDamaged(path, problems)`: verification's findings in the generation directory `path`.
    `GenerationDamaged(reason)`: one check's finding, its text exactly `reason`; the caller names
    the file. It is a ValueError too, so code that catches ValueError to refuse a bad file still
    does.
    """

    def __init__(self, path: str, problems: list[Problem] | None = None):
        if problems is None:  # one check's finding: the text is the reason
            self.path, self.problems = "", [Problem(".", path)]
            super().__init__(path)
            return
        self.path = path
        self.problems = problems
        super().__init__(f"{path} is damaged: " + "; ".join(str(p) for p in problems))


class NothingCommitted(GenerationDamaged):
    """A save root holds staging directories but no committed generation (yet)."""


class NotACheckpoint(MilesLoraCkptError):
    """A path holds neither a committed generation nor a save root."""


class IncompatibleCheckpoint(MilesLoraCkptError, ValueError):
    """An intact generation that cannot be restored into this run, such as another saver's.

    It refuses the whole load, and is never a reason to fall back to an older generation.
    """


class CommittedButFailed(CheckpointError):
    """A save published its generation, but a step after the rename failed on some rank.

    The generation is valid and loaders see it; the failed step was the root's fsync, the tracker
    or a link. Raised identically on every rank, its text begins `generation <dir> committed`.
    """

    def __init__(self, generation: str, failures: list[RankFailure]):
        super().__init__("publish", failures)
        self.generation = generation
        self.args = (f"generation {generation} committed; the failure after it: {self.args[0]}",)
