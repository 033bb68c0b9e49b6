"""What a test puts on its workers' sys.path: the tests directory, so a rank imports its job from the
test module itself (``run_workers(2, "test_reshard:reshard_job", payload, sys_path=[TESTS])``) and
the small shared modules beside it (``single_lora_steps``, ``protocol_generations``, ...)."""

from pathlib import Path

TESTS = str(Path(__file__).parent)
