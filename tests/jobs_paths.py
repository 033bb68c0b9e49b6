"""Where worker-job modules live (they run in spawned processes, which get this on sys.path)."""

from pathlib import Path

JOBS = str(Path(__file__).parent / "jobs")
