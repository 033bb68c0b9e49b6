"""Stand-in of miles/rollout/multi_lora/data_source.py: one data source per adapter, drawn in turn.

Miles has the same class in both multi-LoRA shapes, lora-utils-2026-08 (v1) and
lora-package-2026-09 (v2). The v2 tree's `miles/rollout/multi_lora/data_source.py` re-exports it,
and a v1 launch names it here (`data_state.multi_lora_source`, `--data-source-path`).

Miles' `MultiLoRAAsyncDataSource` keeps a dict `sources` of per-adapter data sources and a queue of
adapter names. Every `get_samples(1)` takes the controller's snapshot (active and retiring adapters)
and reconciles. The source of an adapter that left is deleted, and a missing one is built with
`create_source(adapter)`: a copy of the args with the adapter's prompt file, and its save directory
as `--save` and `--load`. Then it turns the queue once and returns one prompt group from the first
adapter whose source yields, each sample stamped with the adapter (`sample.adapter.name`, `.slot`).
`add_samples` hands groups back to their adapter's source (groups of an adapter that left are
dropped); `save(rollout_id)` and `load(rollout_id)` pass on to the sources that exist.

So a relaunch's `load` reaches no source (none is built before the first draw), and a retired
adapter that is registered again gets a new source: each starts at offset 0.

Stand-in simplifications: each adapter's source is the stand-in shapes' `PromptSource` (Miles' is
`RolloutDataSource`); sources are built one after another (Miles uses a thread pool); no `num_step`
resolution, reward spec or metadata stamping.
"""

from __future__ import annotations

import copy
from collections import deque

from miles_lora_ckpt_harness.miles_standin.common import multi_lora as common
from miles_lora_ckpt_harness.miles_standin.common.rollout import AdapterRef, PromptSource


def fetch_snapshot() -> dict:
    return common.controller().snapshot()


def sampleable(snapshot: dict) -> dict:
    return {**snapshot["active"], **snapshot["retiring"]}


class MultiLoRAAsyncDataSource:
    def __init__(self, args):
        self.args = args
        self.sources: dict = {}
        self.source_queue: deque = deque()

    def reconcile(self, adapters: dict) -> None:
        for name in [n for n in self.sources if n not in adapters]:
            del self.sources[name]
        for name, adapter in adapters.items():
            if name not in self.sources:
                self.sources[name] = self.create_source(adapter)
        self.update_queue(set(adapters))

    def create_source(self, adapter):
        config = adapter.config
        adapter_args = copy.copy(self.args)
        adapter_args.prompt_data = config.data
        adapter_args.save = str(config.save) if config.save else self.args.save
        adapter_args.load = adapter_args.save
        return PromptSource(adapter_args)

    def update_queue(self, names: set) -> None:
        kept = [n for n in self.source_queue if n in names]
        self.source_queue = deque(kept + sorted(names - set(kept)))

    def get_samples(self, num_samples: int = 1) -> list:
        if num_samples != 1:
            raise ValueError("the multi-LoRA data source hands out one prompt group at a time")
        adapters = sampleable(fetch_snapshot())
        self.reconcile(adapters)
        for _ in range(len(self.source_queue)):
            name = self.source_queue.popleft()
            self.source_queue.append(name)
            groups = self.sources[name].get_samples(1)
            if not groups:
                continue
            for sample in groups[0]:
                sample.adapter = AdapterRef(name, adapters[name].slot)
            return groups
        return []

    def add_samples(self, samples: list) -> None:
        adapters = sampleable(fetch_snapshot())
        self.reconcile(adapters)
        for group in samples:
            name = group[0].adapter.name if group and getattr(group[0], "adapter", None) else None
            if name in self.sources and name in adapters:
                self.sources[name].add_samples([group])

    def save(self, rollout_id) -> None:
        for source in self.sources.values():
            source.save(rollout_id)

    def load(self, rollout_id=None) -> None:
        for source in self.sources.values():
            source.load(rollout_id)
