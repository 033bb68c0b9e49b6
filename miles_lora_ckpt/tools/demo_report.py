"""What a demo prints of one train job's ranks (shared by the single- and multi-LoRA demos)."""

from __future__ import annotations


def report_train(results: list, crash_at: str | None) -> None:
    """One line per rank of a train job: its summary, the injected SIGKILL, or its error; a failure
    with no crash injected ends the demo (SystemExit with every rank's error)."""
    for result in results:
        if result.ok:
            print(f"  rank {result.rank}: {result.result['summary']}")
        elif result.exitcode is not None and result.exitcode < 0:
            print(f"  rank {result.rank}: killed by signal {-result.exitcode} (crash injected at {crash_at})")
        else:
            print(f"  rank {result.rank}: failed: {(result.error or '').strip().splitlines()[-1:]}")
    if crash_at is None and not all(r.ok for r in results):
        raise SystemExit("train phase failed without an injected crash:\n" + "\n".join(r.error or "" for r in results))
