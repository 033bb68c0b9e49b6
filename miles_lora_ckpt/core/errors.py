"""The errors users see, all derived from one base, `MilesLoraCkptError`.

`CheckpointError` is collective: it is raised with the same text on every rank, after the ranks
agreed that some phase failed somewhere. `GenerationDamaged` is the one damage exception: what a
check finds wrong with the bytes of one generation (a list of `(relative file, reason)` problems,
or one reason). Loaders turn it into a `CheckpointError` through the consensus, so that no rank goes
on alone; a save root's loader falls back past a damaged generation to an older one.
`IncompatibleCheckpoint` is what a loader raises for an intact generation it must not restore into
this run: the load fails, it never falls back.

Any other exception met inside a load's checks is a bug (ours, or an environment failure that is
not about the generation's bytes): the load fails on every rank, the traceback goes to the log, and
no older generation is tried.
"""

from __future__ import annotations

from dataclasses import dataclass


class MilesLoraCkptError(Exception):
    """Base of every error this package raises on purpose (catch it to catch them all)."""


@dataclass(frozen=True)
class RankFailure:
    """The first error one rank saw in a phase."""

    rank: int
    error: str


class CheckpointError(MilesLoraCkptError, RuntimeError):
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


class GenerationDamaged(MilesLoraCkptError, ValueError):
    """The one damage exception: what a check found wrong with a generation's bytes.

    `GenerationDamaged(path, problems)`: verification's findings in the generation directory `path`.
    `GenerationDamaged(reason)`: one check's finding, its text exactly `reason` (the caller names
    the file). A ValueError too, so code that refused a bad file by catching ValueError still does.
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
    """An intact generation that cannot be restored into this run (another model-parallel layout,
    another saver): a refusal of the whole load, never a reason to fall back to an older one."""


class CommittedButFailed(CheckpointError):
    """A save whose generation was published (renamed into place: loaders see it, it is valid), but
    a step after the rename failed on some rank (the root's fsync, the tracker, a link): raised
    identically on every rank, its text `generation <dir> committed; the failure after it: ...`."""

    def __init__(self, generation: str, failures: list[RankFailure]):
        super().__init__("publish", failures)
        self.generation = generation
        self.args = (f"generation {generation} committed; the failure after it: {self.args[0]}",)
