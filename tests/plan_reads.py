"""What a load at the saved layout reads through the global-layout plan, against the reader of v1
and v2 generations (used by the rank jobs in test_reshard and test_multi_lora)."""

from __future__ import annotations

from contextlib import contextmanager

from miles_lora_ckpt.savers.single_lora import load as load_module


@contextmanager
def through_the_plan():
    """Record, for a load at the saved layout, whether the global-layout plan (`ReshardPlan`)
    planned it and read exactly the files and ranges the reader of v1 and v2 generations would
    read there (its own files). Yields `{"planned": bool, "same_files": bool, "files": [that
    reader's, what the load read]}`, each list sorted."""
    found: dict = {}
    real = load_module.LoadRequest.files_for_rank

    def files_for_rank(self, manifest):
        new = real(self, manifest)
        try:
            old = [*self._own_files(manifest), *(self.rng_files or [])]
        except Exception as exc:  # noqa: BLE001 - that reader would refuse it: recorded, not raised
            old = [f"refused: {exc}"]
        listed = [sorted(map(repr, files)) for files in (old, new)]
        found.update(planned=self.reshard is not None, same_files=listed[0] == listed[1], files=listed)
        return new

    load_module.LoadRequest.files_for_rank = files_for_rank
    try:
        yield found
    finally:
        load_module.LoadRequest.files_for_rank = real
